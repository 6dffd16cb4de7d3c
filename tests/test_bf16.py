"""bfloat16 decoding (docs/design.md §8, the bf16 near-tie rule): chain and DDTree in bf16
against AR in bf16, on a dense, a Qwen3-MoE and a DeepSeek-V3 (latent attention) target.
Outputs may part, but only where one of the target's discrete choices was a near-tie; the rule
is tested to fail too."""

import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dj
from conftest import FIXTURES
from ddtree_jax.models import moe
from helpers import oracle_counts, oracle_drafter, write_drafter

M = 32
PROMPTS = [[3, 17, 99, 4, 250, 31, 8], [42], [7] * 11 + [9], [200, 1, 0, 3],
           [88, 77, 66, 55, 44, 33, 22, 11, 5], [15, 16], [101] * 6, [60, 61, 62, 63, 64]]
T = 64  # the referee forward's length: the longest prompt + M, rounded up
# fixture -> (drafter taps, runs): three runs on the dense target; fewer on the MoE / MLA ones,
# whose programs take several times longer to compile on CPU.
RUNS = {
    "qwen3_gqa": ((0, 1), (("chain", None), ("ddtree", 16), ("ddtree", 64))),
    "qwen3_moe_top2": ((0, 1), (("chain", None), ("ddtree", 16))),
    "dsv3_qlora_groups": ((0, 2), (("ddtree", 16),)),
}
NEAR_TIE_ULPS = 4
MAX_FLIP_SHARE = 0.25


def near_tie_eps(scale):
  """NEAR_TIE_ULPS bf16 ulps (8 significant bits) at magnitude `scale`: the near-tie bound (jnp
  or float input).

  Why this size: rounding to bf16 moves an activation by up to half an ulp of itself. AR and
  the speculative verify run the same bf16 model in different orders (one token on a cache
  against a block or tree of rows, each program fused its own way), so a few of those roundings
  land one ulp apart between them; the logits, float32 sums of bf16 products of the scale of the
  row's max |logit|, carry that as a fraction of their own ulp, and even all of bf16's rounding
  (against float32 math on the same weights) moves a dense model's top-2 gap by a few ulps. A
  flip needs the top two closer than the decodes' difference, measured through the referee
  forward's own: a few ulps. Not more: these models' top-2 gaps are mostly several times that,
  and a bound of their order would pass any bug."""
  if isinstance(scale, float):
    return NEAR_TIE_ULPS * 2.0 ** (math.floor(math.log2(scale)) - 7)
  return NEAR_TIE_ULPS * 2.0 ** (jnp.floor(jnp.log2(scale)) - 7)


def router_margin(params, x, routing):
  """Per row of x [R, H]: the smallest margin of `moe.route`'s discrete choices (k-th vs
  (k+1)-th expert among the kept groups, and the groups' own cut), in units of its near-tie
  bound: `near_tie_eps` of the row's router logits, carried to the scores it compares. Softmax
  routers compare logits (the scores' order); sigmoid ones biased scores, whose noise is the
  logits' times the slope (the row's largest), and group scores sum two of them."""
  logits = jnp.einsum("rh,he->re", x.astype(jnp.float32), params.router.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
  eps = near_tie_eps(jnp.max(jnp.abs(logits), axis=-1))
  choice = logits
  if routing.scoring == "sigmoid":
    choice = jax.nn.sigmoid(logits) + (0.0 if params.bias is None else params.bias)
    eps = eps * jnp.max(jax.nn.sigmoid(logits) * jax.nn.sigmoid(-logits), axis=-1)
  margin = jnp.full(logits.shape[:1], jnp.inf)
  if routing.topk_group < routing.n_group:
    r, e = choice.shape
    groups = jnp.sum(jax.lax.top_k(choice.reshape(r, routing.n_group, -1), 2)[0], axis=-1)
    best = jax.lax.top_k(groups, routing.topk_group + 1)[0]
    margin = (best[:, -2] - best[:, -1]) / (2 * eps)
    cut = best[:, -2:-1]
    choice = jnp.where(jnp.repeat(groups >= cut, e // routing.n_group, axis=1), choice, -jnp.inf)
  best = jax.lax.top_k(choice, routing.top_k + 1)[0]
  return jnp.minimum(margin, (best[:, -2] - best[:, -1]) / eps)


def referee(target, prompts, tokens):
  """One plain bf16 forward over each prompt + its reference tokens, padded to [B, T]: logits
  [B, T, V] and, per (row, position), the smallest router margin over the MoE layers
  (`router_margin`; inf for a dense target). Causal: the padding changes no earlier row."""
  ids = np.zeros((len(prompts), T), np.int32)
  assert max(len(p) + len(t) for p, t in zip(prompts, tokens)) <= T
  for b, (p, t) in enumerate(zip(prompts, tokens)):
    ids[b, :len(p) + len(t)] = list(p) + list(t)
  margins, route = [], moe.route

  def recording(params, x, routing):
    jax.debug.callback(lambda m: margins.append(np.asarray(m)), router_margin(params, x, routing),
                       ordered=True)
    return route(params, x, routing)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(moe, "route", recording)
    logits = np.asarray(dj.forward_logits(target, ids))
    jax.effects_barrier()
  assert len(margins) == len(target.config.moe_layers)  # traced afresh, every MoE layer seen
  router = np.min(np.stack(margins), axis=0).reshape(ids.shape) if margins else np.full(
      ids.shape, np.inf)
  return logits, router


class Divergence(NamedTuple):
  row: int
  index: int     # the first new token that differs from AR's
  gap: float     # top-1 minus top-2 logit before it
  spread: float  # top logit minus the lower of AR's and the speculative token's
  eps: float     # near_tie_eps of that logit row
  router: float  # the token's smallest router margin, in its own eps

  @property
  def near_tie(self):
    """Both tokens were contenders for the top, or an expert choice of the token was."""
    return (self.gap < self.eps and self.spread < self.eps) or self.router < 1


def first_divergences(prompts, reference, tokens, ref_logits, ref_router):
  """The sequences of `tokens` that differ from `reference` (AR), each at its first differing
  index: past it the prefixes differ and the outputs legitimately part, so nothing later counts.

  The near-tie is judged on `referee`'s bf16 forward over prompt + AR (its row before the index
  sees exactly the common prefix). AR's own step logits are the natural reference (they made
  the reference pick) but `generate` does not return them; the plain forward is the same bf16
  model in a third order, as far from AR's step as the verify is, and neither decode grades
  itself; `near_tie_eps` covers its noise. On MoE targets a near-tie of the router moves the
  logits by far more than rounding (another expert), so an expert choice of the token before
  the index within its bound also counts: the dense rule alone fails there."""
  out = []
  for b, (p, ref, got) in enumerate(zip(prompts, reference, tokens)):
    n = min(len(ref), len(got))
    i = next((j for j in range(n) if ref[j] != got[j]), None)
    if i is None:
      assert len(ref) == len(got), (b, len(ref), len(got))
      continue
    row = np.asarray(ref_logits[b, len(p) + i - 1], np.float64)
    top2 = np.sort(row)[-2:]
    out.append(Divergence(b, i, float(top2[1] - top2[0]),
                          float(top2[1] - min(row[ref[i]], row[got[i]])),
                          near_tie_eps(float(np.max(np.abs(row)))),
                          float(ref_router[b, len(p) + i - 1])))
  return out


def pick_margins(prompts, logits, router):
  """Per (sequence, new-token index) of `referee`'s output: AR's pick's top-1 minus top-2 logit
  gap and its token's smallest router margin, both in units of their near_tie_eps ([B, M] each;
  below 1: a near-tie)."""
  rows = np.stack([logits[b, len(p) - 1:len(p) + M - 1] for b, p in enumerate(prompts)])
  top = np.sort(rows, axis=-1)
  eps = np.vectorize(near_tie_eps)(np.max(np.abs(rows), axis=-1).astype(float))
  routed = np.stack([router[b, len(p) - 1:len(p) + M - 1] for b, p in enumerate(prompts)])
  return (top[..., -1] - top[..., -2]) / eps, routed


@pytest.fixture(scope="module", params=list(RUNS))
def setup(request, tmp_path_factory):
  """(name, bf16 target, drafter, AR's bf16 tokens, referee logits, referee router margins)."""
  name = request.param
  target = dj.load_target(os.path.join(FIXTURES, name), dtype="bfloat16")
  assert target.params.embed.dtype == jnp.bfloat16
  path = write_drafter(str(tmp_path_factory.mktemp("drafter")), target.config, block_size=8,
                       target_layer_ids=RUNS[name][0])
  drafter = dj.load_drafter(path, target)
  ar = dj.generate(target, PROMPTS, max_new_tokens=M, stop_token_ids=()).tokens
  return (name, target, drafter, ar, *referee(target, PROMPTS, ar))


def test_bf16_speculative_output_parts_from_ar_only_at_near_ties(setup):
  """Chain and DDTree (budgets 4-64) in bf16, drafts that follow AR's bf16 output and get
  accepted (multi-token steps, trees through non-first children): each sequence equals AR's or
  first differs at a near-tie. And few near-ties flip: at most MAX_FLIP_SHARE of those the
  compared prefixes passed through (up to and with each first difference). The bound is several
  times the decodes' noise, so most near-ties hold; a verify off by about the bound would flip
  about half of them (where its error favours the rival) and still pass the first check."""
  name, target, drafter, ar, logits, router = setup
  units, routed = pick_margins(PROMPTS, logits, router)
  oracle = oracle_drafter(drafter, PROMPTS, ar, corruption=0.3)
  for method, budget in RUNS[name][1]:
    res = dj.generate(target, PROMPTS, method=method, drafter=oracle, budget=budget,
                      max_new_tokens=M, stop_token_ids=())
    multi, branch = oracle_counts(oracle, PROMPTS, res)
    assert multi > 0 and (branch > 0 or method == "chain"), (method, budget, multi, branch)
    divs = first_divergences(PROMPTS, ar, res.tokens, logits, router)
    ends = np.full(len(PROMPTS), M)
    ends[[d.row for d in divs]] = [d.index + 1 for d in divs]
    ties = sum(int(np.sum((units[b, :e] < 1) | (routed[b, :e] < 1))) for b, e in enumerate(ends))
    print(f"\n{name} {method} {budget}: {len(divs)} of {len(PROMPTS)} differ from AR, near-ties "
          f"passed {ties}, tau {res.stats['tau']:.2f}, multi-token steps {multi}: {divs}")
    assert all(d.near_tie for d in divs), (name, method, budget, divs)
    assert len(divs) <= MAX_FLIP_SHARE * ties, (name, method, budget, ties, divs)


def test_near_tie_rule_flags_divergences_at_clear_picks(setup):
  """The same rule on forged outputs: a first difference at AR's clearest pick (the runner-up
  or the least likely token), or at a near-tie but with neither contender, is flagged; the
  runner-up at a near-tie passes whatever follows it. On MoE targets the router's near-ties are
  counted (a clear logit pick passes where the token's experts were a near-tie) and can fail."""
  _, _, _, ar, logits, router = setup
  units, routed = pick_margins(PROMPTS, logits, router)
  order = np.argsort(np.stack([logits[b, len(p) - 1:len(p) + M - 1]
                               for b, p in enumerate(PROMPTS)]), axis=-1)
  mine = np.array([t[:M] for t in ar])
  rival = np.where(order[..., -1] == mine, order[..., -2], order[..., -1])  # the other contender
  last = order[..., 0]

  def forge(*edits):
    out = [list(t) for t in ar]
    for b, i, pick in edits:
      out[b][i] = int(pick)
    return first_divergences(PROMPTS, ar, out, logits, router)

  def near_ties(divs, at):
    assert [(d.row, d.index) for d in divs] == [at], (divs, at)
    return divs[0].near_tie

  assert not forge()
  clear = np.unravel_index(np.argmax(np.where(routed >= 1, units, 0)), units.shape)
  assert units[clear] > 1 and routed[clear] >= 1
  tie = np.unravel_index(np.argmin(np.where(routed >= 1, units, np.inf)[:, :-1]),
                         (len(PROMPTS), M - 1))  # not at the last index, not at a router near-tie
  assert units[tie] < 1 and routed[tie] >= 1
  for at, pick in ((clear, rival[clear]), (clear, last[clear]), (tie, last[tie])):
    assert not near_ties(forge((*at, pick)), at), (at, pick)
  assert near_ties(forge((*tie, rival[tie])), tie)
  assert near_ties(forge((*tie, rival[tie]), (tie[0], M - 1, last[tie[0], M - 1])), tie)
  if np.isfinite(routed).any():  # a router near-tie at a clear logit pick passes
    expert = np.unravel_index(np.argmin(np.where(units > 1, routed, np.inf)), units.shape)
    assert routed[expert] < 1 and units[expert] > 1, (routed[expert], units[expert])
    assert near_ties(forge((*expert, last[expert])), expert)
