"""Temperature > 0: chain and DDTree sampling follow the target's own distribution (Monte Carlo).

`test_sampling_over_accepted_trees` compares the joint law of the first K = 5 tokens (x1 from
prefill, x2..x5 from the rounds' walks) with the exact one while rounds commit drafted paths, so
the tree, the budget, the filters at every node and the acceptance walk all shape the output.
The drafter drafts the target's own per-depth marginals after each row's tokens so far
(`TableConfig`), so drafts are often accepted even though the target's law is spread; the full
budget V + V^2 + V^3 holds every path of depth <= L, so there every sampled path is in the tree
whatever the drafts, and the walk always reaches a leaf.
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

import ddtree_jax as dj
from ddtree_jax import engine
from ddtree_jax.speculative import decode
from ddtree_jax.models import decoder
from ddtree_jax.speculative import verify
from ddtree_jax.checkpoints.dflash import Drafter
from ddtree_jax.checkpoints.hf import Target
from ddtree_jax.models.config import ModelConfig
from ddtree_jax.models.drafter import DrafterConfig
from helpers import write_drafter

V = 4
H = 32                  # the target's hidden size
PROMPT = [1, 3, 2]
N = 16000               # samples (batch entries) per run
N_CHAIN = 40000         # chain accepts fewer drafts, so a bias there shows in fewer rows
K = 5                   # tokens per row compared with the exact joint law
L = 3                   # drafts per round (block size 4)
FULL = V + V**2 + V**3  # every path of depth <= L
PARTIAL = 12            # the best 12 prefixes: walks also stop inside the tree
ALPHA = 1e-3            # a case's false-alarm level (Bonferroni over its K p-values)


def make_target(seed=4, std=0.3):
  """A random 2-layer target whose last V hidden features carry the token's one-hot through
  every layer (the layers write nothing there), so the drafter can read the committed tokens
  back from the target's layer-0 taps. seed / std give a spread joint law (no cell dominates)."""
  cfg = ModelConfig(model_type="qwen3", vocab_size=V, hidden_size=H, intermediate_size=64,
                    num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
  p = decoder.init_params(cfg, jax.random.key(seed), jnp.float32, std=std)
  layers = [dataclasses.replace(l, wo=l.wo.at[..., H - V:].set(0),
                                w_down=l.w_down.at[:, H - V:].set(0)) for l in p.layers]
  return Target(params=dataclasses.replace(p, embed=p.embed.at[:, H - V:].set(jnp.eye(V)),
                                           layers=layers), config=cfg)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """The target and a random DFlash drafter for it (`TableConfig` drafts the tree tests)."""
  target = make_target()
  path = write_drafter(str(tmp_path_factory.mktemp("d")), target.config, num_layers=1,
                       block_size=L + 1, mask_token_id=3, target_layer_ids=(0, 1), std=0.5)
  return target, dj.load_drafter(path, target)


@pytest.fixture(scope="module")
def laws(pair):
  """laws(temperature, filters): `conditionals` of the pair's target K + L - 1 tokens deep (what
  `run_case` needs), computed once per setting: the biased-rule test samples a case's setting
  again, after clearing JAX's caches (which would compile the forward anew)."""
  target, _ = pair
  found = {}

  def get(temperature, filters):
    key = (temperature, tuple(sorted(filters.items())))
    if key not in found:
      found[key] = conditionals(target, temperature, depth=K + L - 1, **filters)
    return found[key]

  return get


# ---------------------------------------------------------------- exact laws and the decision


def conditionals(target, temperature, top_k=None, top_p=None, depth=K):
  """[p(x1), p(x2 | x1), ..., p(x_depth | x1..x_depth-1)] of the target's own filtered
  sampling after PROMPT: entry t has shape [V] * (t + 1), the last axis the next token."""
  seqs = [PROMPT + list(s) for s in itertools.product(range(V), repeat=depth - 1)]
  logits = verify.filter_logits(dj.forward_logits(target, seqs), temperature, top_k, top_p)
  probs = np.asarray(jax.nn.softmax(logits, axis=-1), np.float64)
  probs = probs.reshape([V] * (depth - 1) + [len(PROMPT) + depth - 1, V])
  # position len(PROMPT) - 1 + t holds p(x_t+1 | x1..x_t): any later tokens (index 0) do
  return [probs[(slice(None),) * t + (0,) * (depth - 1 - t) + (len(PROMPT) - 1 + t,)]
          for t in range(depth)]


def joint(conds, k):
  """p(x1..x_k) [V] * k from `conditionals`."""
  p = conds[0]
  for t in range(1, k):
    p = p[..., None] * conds[t]
  return p


def exact_joint(target, temperature, top_k=None, top_p=None, k=2):
  """p(x1..x_k) [V] * k of the target's own filtered sampling after PROMPT."""
  return joint(conditionals(target, temperature, top_k, top_p, depth=k), k)


def sample(target, drafter, method, budget, temperature, k=2, n=N, seed=0, **kw):
  """(counts [V] * k of the first k tokens of n rows after PROMPT, generate's result)."""
  res = dj.generate(target, [PROMPT] * n, method=method, drafter=drafter, budget=budget,
                    max_new_tokens=k, temperature=temperature, seed=seed, stop_token_ids=(), **kw)
  counts = np.zeros([V] * k)
  np.add.at(counts, tuple(np.asarray(res.tokens).T), 1)
  return counts, res


def empirical_joint(target, drafter, method, budget, temperature, seed=0, **kw):
  """counts [V, V] of the first two tokens of N rows (with `check`: tests/test_moe.py)."""
  return sample(target, drafter, method, budget, temperature, seed=seed, **kw)[0]


def check(counts, p):
  """(total variation, chi-squared p-value) of the counts against the law p (same shape)."""
  n = counts.sum()
  assert counts[p == 0].sum() == 0, "sampled a token the filters removed"
  assert (n * p >= 5).sum() >= 2, "degenerate distribution: pick filters that keep several outcomes"
  return 0.5 * np.abs(counts / n - p).sum(), pooled_chisquare(counts, n * p)


def pooled_chisquare(obs, exp):
  """Chi-squared p-value of counts against expected counts (same shape), the bins expected
  below 5 pooled into one."""
  obs, exp = obs.ravel(), exp.ravel()
  live = exp > 0
  exp = exp * obs[live].sum() / exp[live].sum()  # float32 laws: sums agree to ~1e-7 only
  common = live & (exp >= 5)
  o, e = obs[common], exp[common]
  if (live & ~common).any():
    o, e = np.append(o, obs[live & ~common].sum()), np.append(e, exp[live & ~common].sum())
  return sps.chi2.sf(np.sum((o - e)**2 / e), len(o) - 1) if len(o) >= 2 else 1.0


def verdict(counts, conds):
  """The test's statistics for counts [V] * k against the exact law: removed (samples of cells
  the filters removed), pvalues (per t = 1..k, the chi-squared p-value of the joint law of
  x1..x_t: a bias at depth t shows in few cells of the short prefixes, where it is not diluted
  over the V^k cells of the whole law), tv (total variation of the whole law, for messages)."""
  k, n = counts.ndim, counts.sum()
  p = joint(conds, k)
  pvalues = [pooled_chisquare(counts.sum(axis=tuple(range(t, k))), n * joint(conds, t))
             for t in range(1, k + 1)]
  return dict(removed=int(counts[p == 0].sum()), pvalues=pvalues,
              tv=0.5 * np.abs(counts / n - p).sum())


def passes(v):
  """The decision: no removed token and every p-value above ALPHA / k (Bonferroni)."""
  return v["removed"] == 0 and min(v["pvalues"]) > ALPHA / len(v["pvalues"])


# ------------------------------------------------------------------------- the table drafter


def history_table(conds, max_history=K - 1):
  """log q [sum_n V^n, L, V]: per depth d, the marginal law of token n + d after each history
  x1..x_n (n = 1..max_history, laid out as `TableConfig` indexes them). conds must reach
  max_history + L tokens."""
  rows = []
  for n in range(1, max_history + 1):
    ahead = conds[n][..., None, None] * conds[n + 1][..., None] * conds[n + 2]
    ahead = ahead.reshape(V**n, V, V, V)  # p(y1, y2, y3 | history)
    rows.append(np.stack([ahead.sum((2, 3)), ahead.sum((1, 3)), ahead.sum((1, 2))], axis=1))
  return np.log(np.maximum(np.concatenate(rows), 1e-30)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class TableConfig(DrafterConfig):
  """Drafts, after each row's tokens so far, the target's own per-depth marginals (params: a
  `history_table`): the best factorised drafter, so drafts are often accepted at any
  temperature. The committed tokens are read back from the target's layer-0 taps (`make_target`)
  into the drafter cache; the history is PROMPT's continuation only."""
  max_history: int = K - 1

  def draft(self, params, target_params, cache, bonus, kernels=None):
    tokens = jnp.argmax(cache.k[0, :, 0, :, :V], axis=-1)  # [B, S] the committed tokens
    j = jnp.arange(self.max_history)
    n = jnp.clip(cache.lens - len(PROMPT) + 1, 1, self.max_history)[:, None]  # with the bonus
    at = jnp.minimum(len(PROMPT) + j, cache.capacity - 1)
    rows = jnp.take_along_axis(tokens, jnp.broadcast_to(at, (tokens.shape[0], len(j))), axis=1)
    history = jnp.where(j == n - 1, bonus[:, None], rows)
    code = jnp.sum(jnp.where(j < n, history * V ** jnp.maximum(n - 1 - j, 0), 0), axis=1)
    offset = (V**n[:, 0] - V) // (V - 1)  # rows of the shorter histories
    return params[offset + code]

  def context(self, params, taps, positions):
    onehot = taps[..., H - V:H]  # the first tapped layer's one-hot features
    return [onehot[:, :, None]], [onehot[:, :, None]]

  def vocab(self, params):
    return None


def table_drafter(conds):
  """A Drafter of `TableConfig` for the sampling law of `conds` (K + L - 1 tokens deep)."""
  cfg = ModelConfig(model_type="qwen3", vocab_size=V, hidden_size=H, intermediate_size=64,
                    num_layers=1, num_heads=1, num_kv_heads=1, head_dim=V)
  return Drafter(params=jnp.asarray(history_table(conds)),
                 config=TableConfig(layers=cfg, block_size=L + 1, mask_token_id=0,
                                    target_layer_ids=(0,)))


# ---------------------------------------------------------------------- K tokens over trees

CASES = [  # (method, budget, temperature, filters, least share of rounds committing 3+ tokens)
    ("chain", None, 1.0, {}, 0.1),
    ("chain", None, 0.7, dict(top_p=0.9), 0.2),
    ("ddtree", PARTIAL, 1.0, dict(top_k=3), 0.4),
    ("ddtree", PARTIAL, 0.7, {}, 0.4),
    ("ddtree", FULL, 1.0, dict(top_k=3, top_p=0.9), 1.0),
]


def rows(method):
  """Rows per run of a method."""
  return N_CHAIN if method == "chain" else N


def run_case(target, method, budget, temperature, filters, seed=0, conds=None):
  """(verdict, share of rounds that committed 3+ tokens) of one case; conds: its
  `conditionals`, K + L - 1 tokens deep (None: computed here)."""
  if conds is None:
    conds = conditionals(target, temperature, depth=K + L - 1, **filters)
  counts, res = sample(target, table_drafter(conds), method, budget, temperature, k=K,
                       n=rows(method), seed=seed, **filters)
  lengths = np.asarray([a for seq in res.stats["acceptance_lengths"] for a in seq])
  return verdict(counts, conds[:K]), np.mean(lengths >= 3)


@pytest.mark.parametrize("method,budget,temperature,filters,multi", CASES)
def test_sampling_over_accepted_trees(pair, laws, method, budget, temperature, filters, multi):
  """The first K tokens follow the target's joint law while rounds commit drafted paths.

  Power against a 5 % non-root leak (`leaky_commit`): 0.98 to 1.00 per case, false alarm
  <= 0.0012 per case (the five together: false alarm <= 0.006 by Bonferroni);
  experiments/sampling_power.py."""
  target, _ = pair
  v, share = run_case(target, method, budget, temperature, filters,
                      conds=laws(temperature, filters))
  assert share >= multi, f"only {share:.0%} of rounds committed 3+ tokens"
  assert passes(v), v


def leaky_commit(real_commit, leak):
  """`decode.accept_and_commit` with a planted bug: at every non-root node with a child, the
  target's sample is replaced by the first child's token with probability `leak`, afresh each
  round (a draft leaking into the output: the walk takes the drafted child even though the
  target's sample disagrees)."""

  def accept_and_commit(dparams, dcfg, lc, state, tree, post, *rest):
    n = post.shape[1]
    first = jnp.argmax(tree.parents[:, None, :] == jnp.arange(n)[None, :, None], axis=-1)
    u = jax.random.uniform(jax.random.fold_in(rest[-1], 1), post.shape)  # rest[-1]: the key
    leaks = (u < leak) & (first > 0) & (jnp.arange(n) > 0)[None]           # first 0: no child
    post = jnp.where(leaks, jnp.take_along_axis(tree.tokens, first, axis=1), post)
    return real_commit(dparams, dcfg, lc, state, tree, post, *rest)

  return accept_and_commit


def test_biased_acceptance_rule_is_caught(pair, laws, monkeypatch):
  """Proof the test can fail: the 5 % non-root leak of `leaky_commit` (one seed)."""
  target, _ = pair
  conds = laws(1.0, dict(top_k=3))  # the exact law does not depend on the commit rule
  engine._PROGRAMS.clear()
  jax.clear_caches()
  monkeypatch.setattr(decode, "accept_and_commit", leaky_commit(decode.accept_and_commit, 0.05))
  try:
    v, _ = run_case(target, "ddtree", PARTIAL, 1.0, dict(top_k=3), conds=conds)
  finally:
    engine._PROGRAMS.clear()
    jax.clear_caches()
  assert not passes(v), v


def test_same_seed_same_output_and_greedy_limits(pair):
  """Sampling is a function of the seed; T = 0 and top_k = 1 give the greedy tokens."""
  target, drafter = pair
  prompts = [PROMPT, [3], [2, 2, 2, 0]]
  run = functools.partial(dj.generate, target, prompts, method="ddtree", drafter=drafter,
                          budget=8, max_new_tokens=12, stop_token_ids=())
  a, b = run(temperature=1.0, seed=5), run(temperature=1.0, seed=5)
  assert a.tokens == b.tokens
  assert run(temperature=1.0, seed=6).tokens != a.tokens
  greedy = dj.generate(target, prompts, max_new_tokens=12, stop_token_ids=()).tokens
  assert run(temperature=0.0).tokens == greedy
  assert run(temperature=1.0, top_k=1).tokens == greedy  # the sampling path with one choice
