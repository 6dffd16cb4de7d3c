"""Temperature > 0: chain and DDTree sampling follow the target's own distribution (Monte Carlo)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

import ddtree_jax as dj
from ddtree_jax import engine, model, verify
from ddtree_jax.checkpoint import Target
from ddtree_jax.config import ModelConfig
from helpers import oracle_drafter, write_drafter

V = 4
PROMPT = [1, 3, 2]
N = 16000  # samples (batch entries) per run: expected TV of pure noise ~0.01


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  cfg = ModelConfig(model_type="qwen3", vocab_size=V, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
  target = Target(params=model.init_params(cfg, jax.random.key(3), jnp.float32, std=0.4), config=cfg)
  path = write_drafter(str(tmp_path_factory.mktemp("d")), cfg, num_layers=1, block_size=4,
                       mask_token_id=3, target_layer_ids=(0, 1), std=0.5)
  return target, dj.load_drafter(path, target)


def exact_joint(target, temperature, top_k=None, top_p=None):
  """p(x1, x2) [V, V] of the target's own filtered sampling."""
  filt = lambda l: jax.nn.softmax(verify.filter_logits(l, temperature, top_k, top_p), axis=-1)
  p1 = np.asarray(filt(dj.forward_logits(target, [PROMPT])[0, -1]), np.float64)
  ext = [PROMPT + [x] for x in range(V)]
  p2 = np.asarray(filt(dj.forward_logits(target, ext)[:, -1]), np.float64)
  return p1[:, None] * p2


def empirical_joint(target, drafter, method, budget, temperature, seed=0, **kw):
  res = dj.generate(target, [PROMPT] * N, method=method, drafter=drafter, budget=budget,
                    max_new_tokens=2, temperature=temperature, seed=seed, stop_token_ids=(), **kw)
  toks = np.asarray(res.tokens)
  counts = np.zeros((V, V))
  np.add.at(counts, (toks[:, 0], toks[:, 1]), 1)
  return counts


def check(counts, p):
  n = counts.sum()
  live = p.ravel() > 0
  assert counts.ravel()[~live].sum() == 0, "sampled a token the filters removed"
  tv = 0.5 * np.abs(counts.ravel() / n - p.ravel()).sum()
  # Chi-squared needs expected counts >= 5: pool the rare cells into one.
  expected = p.ravel() / p.ravel().sum() * n
  common = expected >= 5
  rare = live & ~common
  obs, exp = counts.ravel()[common], expected[common]
  if rare.any():
    obs, exp = np.append(obs, counts.ravel()[rare].sum()), np.append(exp, expected[rare].sum())
  assert len(obs) >= 2, "degenerate distribution: pick filters that keep several outcomes"
  return tv, sps.chisquare(obs, exp).pvalue


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("method,budget", [("chain", None), ("ddtree", 4), ("ddtree", 16),
                                           ("ddtree", 64)])
def test_sampling_matches_target_distribution(pair, method, budget, temperature):
  target, drafter = pair
  tv, pvalue = check(empirical_joint(target, drafter, method, budget, temperature),
                     exact_joint(target, temperature))
  assert tv < 0.02 and pvalue > 1e-3, (tv, pvalue)


@pytest.mark.parametrize("kw", [dict(top_k=2), dict(top_p=0.9), dict(top_k=3, top_p=0.95)])
def test_filtered_sampling_matches(pair, kw):
  target, drafter = pair
  tv, pvalue = check(empirical_joint(target, drafter, "ddtree", 16, 1.0, **kw),
                     exact_joint(target, 1.0, **kw))
  assert tv < 0.02 and pvalue > 1e-3, (tv, pvalue)


def test_biased_acceptance_rule_is_caught(pair, monkeypatch):
  """Proof the test can fail: accept the drafter's top child at the root 30% of the time even
  when the target's sample disagrees (the kind of shortcut a min(1, p/q) port introduces)."""
  target, drafter = pair
  real_accept = verify.accept

  def biased(tokens, parents, depths, visibility, post, max_depth):
    u = jax.random.uniform(jax.random.key(7), post.shape[:1])
    root_post = jnp.where(u < 0.3, tokens[:, 1], post[:, 0])
    return real_accept(tokens, parents, depths, visibility, post.at[:, 0].set(root_post), max_depth)

  engine._PROGRAMS.clear()
  jax.clear_caches()
  monkeypatch.setattr(verify, "accept", biased)
  try:
    tv, pvalue = check(empirical_joint(target, drafter, "ddtree", 16, 1.0),
                       exact_joint(target, 1.0))
  finally:
    engine._PROGRAMS.clear()
    jax.clear_caches()
  assert tv > 0.02 or pvalue < 1e-3


def test_same_seed_same_output_and_greedy_limits(pair):
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


# ---------------------------------------------------------------- three tokens, multi-token steps

N3 = 24000
T3 = 0.4  # peaked enough that the greedy drafts are accepted two and three at a time


def exact_joint3(target, temperature):
  """p(x1, x2, x3) [V, V, V] of the target's own sampling after PROMPT."""
  probs = lambda seqs: np.asarray(jax.nn.softmax(verify.filter_logits(
      dj.forward_logits(target, seqs)[:, -1], temperature), axis=-1), np.float64)
  p1 = probs([PROMPT])[0]
  p2 = probs([PROMPT + [a] for a in range(V)])                      # [V, V]
  p3 = probs([PROMPT + [a, b] for a in range(V) for b in range(V)]).reshape(V, V, V)
  return p1[:, None, None] * p2[:, :, None] * p3


@pytest.fixture(scope="module")
def greedy_oracle(pair):
  """A drafter whose drafts are the target's greedy continuation of PROMPT (rows that sampled
  off it still draft it: any drafter is allowed, only acceptance changes)."""
  target, drafter = pair
  ar = dj.generate(target, [PROMPT], max_new_tokens=8, stop_token_ids=()).tokens
  return oracle_drafter(drafter, [PROMPT] * N3, ar * N3, corruption=0.0)


def empirical_joint3(target, drafter, method, budget, temperature, seed=0):
  res = dj.generate(target, [PROMPT] * N3, method=method, drafter=drafter, budget=budget,
                    max_new_tokens=3, temperature=temperature, seed=seed, stop_token_ids=())
  toks = np.asarray(res.tokens)
  counts = np.zeros((V, V, V))
  np.add.at(counts, (toks[:, 0], toks[:, 1], toks[:, 2]), 1)
  lengths = [a for seq in res.stats["acceptance_lengths"] for a in seq]
  return counts, np.mean(np.asarray(lengths) >= 2)


@pytest.mark.parametrize("method,budget", [("chain", None), ("ddtree", 4), ("ddtree", 20)])
def test_three_token_sampling_with_multi_token_steps(pair, greedy_oracle, method, budget):
  """The joint law of the first three tokens equals the target's when most steps commit two or
  more tokens at once (chain with greedy drafts; DDTree B=20 covers depths 1-2 entirely)."""
  target, _ = pair
  counts, multi = empirical_joint3(target, greedy_oracle, method, budget, T3)
  assert multi > 0.5, f"only {multi:.0%} of steps accepted 2+ tokens: the test needs more"
  tv, pvalue = check(counts, exact_joint3(target, T3))
  assert tv < 0.02 and pvalue > 1e-3, (tv, pvalue)


def test_biased_rule_is_caught_over_three_tokens(pair, greedy_oracle, monkeypatch):
  """Proof the three-token test can fail: accept the drafted child of every node 20% of the
  time even when the target's sample there disagrees."""
  target, _ = pair
  real_accept = verify.accept

  def biased(tokens, parents, depths, visibility, post, max_depth):
    u = jax.random.uniform(jax.random.key(11), post.shape)
    first_child = jnp.argmax(parents[:, None, :] == jnp.arange(post.shape[1])[None, :, None],
                             axis=-1)  # [B, N]: the first node whose parent is n (0 if none)
    forced = jnp.take_along_axis(tokens, first_child, axis=1)
    return real_accept(tokens, parents, depths, visibility,
                       jnp.where((u < 0.2) & (first_child > 0), forced, post), max_depth)

  engine._PROGRAMS.clear()
  jax.clear_caches()
  monkeypatch.setattr(verify, "accept", biased)
  try:
    counts, _ = empirical_joint3(target, greedy_oracle, "chain", None, T3)
  finally:
    engine._PROGRAMS.clear()
    jax.clear_caches()
  tv, pvalue = check(counts, exact_joint3(target, T3))
  assert tv > 0.02 or pvalue < 1e-3
