"""Mixture-of-experts MLP (Qwen3-MoE, DeepSeekMoE, gpt-oss): a float32 router (softmax top-k, or
DeepSeek's sigmoid scores with a selection bias and group-limited top-k), and a dropless mixture
of SwiGLU experts. DeepSeek's shared experts are a dense MLP beside it (`decoder.mlp_block`).
gpt-oss's routers and experts have biases and its SwiGLU is clamped (`MoEParams.plain` False):
those layers run XLA's stages here, whatever stages are passed (the Pallas GEMMs fuse a plain
SwiGLU and take no bias).

Every implementation has the contract `(params, x [R, H], weights [R, k], experts [R, k]) ->
[R, H]`: each row's output is sum_j weights[r, j] * expert_{experts[r, j]}(x[r]), summed in rank
order j = 0..k-1; an expert id E (one past the last) means "held elsewhere" and adds nothing
(expert parallelism: a shard's pairs for other shards' experts). No capacity factor: every
(token, expert) pair is computed, so no token is ever dropped (a dropped token would change the
output against AR). A row's output depends on its own routing alone, never on which other rows
share the batch. The router is `router_logits` then `select` (`route`); on Pallas at decode rows
the selection runs inside the first expert kernel (`pallas.moe_decode`).

  reference  every expert on every row, then the routing weights pick (tests; E x the work)
  grouped    the (row, expert) pairs sorted by expert, gate/up and down GEMMs over the groups,
             a weighted combine per row (XLA's ragged_dot or the Pallas kernels: `ExpertOps`)
  pairs      pair by pair, no sort: gate/up and down per (row, expert) pair, then each row's
             pairs summed in rank order (decode steps, few pairs; XLA's gather of each pair's
             expert or the Pallas kernels: `PairOps`)
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ddtree_jax.models import quant
from ddtree_jax.models.ops import einsum_weight, random_weight

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MoEParams:
  """One layer's experts. E experts, H hidden, I = moe_intermediate_size. The stacks are float
arrays or kept quantized (`quant.Int4Experts`, `quant.Fp8Experts`: the same [E, K, out...]
shape, dequantized inside the GEMM)."""
  router: Array            # [H, E], float32 (HF computes routing in float32)
  w_gate_up: Array         # [E, H, 2, I]  (gate, up)
  w_down: Array            # [E, I, H]
  bias: Array | None = None  # [E] float32: DeepSeek's e_score_correction_bias (selection only)
  # gpt-oss: the router's logit bias, the experts' gate/up and down biases, and the clamped
  # SwiGLU's (alpha, limit) (`_swiglu`; (): silu(gate) * up)
  router_bias: Array | None = None   # [E] float32, added to the router's logits
  gate_up_bias: Array | None = None  # [E, 2, I]
  down_bias: Array | None = None     # [E, H]
  swiglu_clamp: tuple[float, float] = dataclasses.field(default=(), metadata=dict(static=True))

  @property
  def plain(self) -> bool:
    """No biases and a plain SwiGLU: what the Pallas expert and decode kernels compute."""
    return (self.router_bias is None and self.gate_up_bias is None and self.down_bias is None
            and not self.swiglu_clamp)

  def partition_specs(self, axes) -> MoEParams:
    """Experts E over ep, their width I over tp (a quantized stack's packed words, scale
    groups and blocks along I must divide too); the router and bias replicated."""
    e = self.w_gate_up.shape[0]
    ep = axes("experts", e, "num_experts")
    ml = None
    for size in quant.split_sizes(self.w_gate_up, 3) + quant.split_sizes(self.w_down, 1):
      ml = axes("mlp", size, "moe_intermediate_size (or its packed words or scale groups)")
    return self.specs(ep, ml)

  def specs(self, ep, ml) -> MoEParams:
    """PartitionSpecs of every leaf: experts over mesh axis ep, their width over ml (None:
    replicated); the router and its biases replicated."""
    opt = lambda x, *spec: None if x is None else P(*spec)
    return MoEParams(router=P(), w_gate_up=quant.spec_like(self.w_gate_up, P(ep, None, None, ml)),
                     w_down=quant.spec_like(self.w_down, P(ep, ml, None)), bias=opt(self.bias),
                     router_bias=opt(self.router_bias),
                     gate_up_bias=opt(self.gate_up_bias, ep, None, ml),
                     down_bias=opt(self.down_bias, ep, None), swiglu_clamp=self.swiglu_clamp)


@dataclasses.dataclass(frozen=True)
class Routing:
  """How a router picks (hashable: `ModelConfig.routing`). softmax: Qwen3-MoE; sigmoid:
  DeepSeek-V3 (scores + bias choose, the scores weigh; top-k among the experts of the
  topk_group groups of n_group whose two best biased scores sum highest)."""
  top_k: int
  norm_topk_prob: bool = False
  scoring: str = "softmax"
  n_group: int = 1
  topk_group: int = 1
  scaling: float = 1.0

  def __post_init__(self):
    if self.scoring not in ("softmax", "sigmoid"):
      raise ValueError(f"Routing.scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")


def router_logits(params: MoEParams, x):
  """The router's logits of x [R, H] in float32 (plus gpt-oss's router bias): [R, E]."""
  logits = einsum_weight("rh,he->re", x.astype(jnp.float32), params.router.astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)  # (one row: a GEMM, not mul + reduce)
  return logits if params.router_bias is None else logits + params.router_bias.astype(jnp.float32)


def route(params: MoEParams, x, routing: Routing):
  """Router of x [R, H] in float32: the top_k experts (ties to the lower expert id) and their
  weights, renormalised over the chosen ones when norm_topk_prob, times routing.scaling.
  Returns (weights [R, k] in x's dtype, experts [R, k] int32)."""
  return select(router_logits(params, x), params.bias, routing, x.dtype)


def select(logits, bias, routing: Routing, dtype):
  """`route` from the router's logits [R, E] float32 (bias [E] or None): (weights [R, k] in
  dtype, experts [R, k] int32)."""
  if routing.scoring == "softmax":
    scores = choice = jax.nn.softmax(logits, axis=-1)
  else:
    scores = jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
  if routing.n_group > 1:
    r, e = choice.shape
    grouped_choice = choice.reshape(r, routing.n_group, e // routing.n_group)
    group_score = jnp.sum(jax.lax.top_k(grouped_choice, 2)[0], axis=-1)       # [R, G]
    _, best = jax.lax.top_k(group_score, routing.topk_group)
    keep = jnp.zeros(group_score.shape, bool).at[jnp.arange(r)[:, None], best].set(True)
    choice = jnp.where(jnp.repeat(keep, e // routing.n_group, axis=1), choice, -jnp.inf)
  _, experts = jax.lax.top_k(choice, routing.top_k)
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if routing.norm_topk_prob:
    denominator = jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights / (denominator + 1e-20 if routing.scoring == "sigmoid" else denominator)
  if routing.scaling != 1.0:
    weights = weights * routing.scaling
  return weights.astype(dtype), experts.astype(jnp.int32)


def _swiglu(gu, clamp=()):
  """[..., 2, I] (gate, up) -> silu(gate) * up [..., I]; with clamp = (alpha, limit) gpt-oss's
  (clip(up, -limit, limit) + 1) * (g * sigmoid(alpha * g)), g = min(gate, limit)."""
  gate, up = gu[..., 0, :], gu[..., 1, :]
  if not clamp:
    return jax.nn.silu(gate) * up
  alpha, limit = clamp
  gate = jnp.minimum(gate, limit)
  return (jnp.clip(up, -limit, limit) + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def _rows(bias, ids, dtype):
  """Each pair's row of a per-expert bias [E, ...] (ids [M] of experts < E), or 0 without one."""
  return 0 if bias is None else bias[ids].astype(dtype)


def reference(params: MoEParams, x, weights, experts):
  """Every expert on every row (E x the work), then each row's k outputs in rank order."""
  e = params.w_gate_up.shape[0]
  every = jnp.arange(e)
  gu = (jnp.einsum("rh,ehsi->resi", x, quant.dequantize(params.w_gate_up, x.dtype))
        + _rows(params.gate_up_bias, every, x.dtype))
  y = jnp.einsum("rei,eih->reh", _swiglu(gu, params.swiglu_clamp),
                 quant.dequantize(params.w_down, x.dtype)) + _rows(params.down_bias, every, x.dtype)
  here = experts < y.shape[1]
  picked = jnp.take_along_axis(y, jnp.where(here, experts, 0)[:, :, None], axis=1)  # [R, k, H]
  return _sum_ranks(jnp.where(here[:, :, None], picked, 0), weights)


def _sum_ranks(y, weights):
  """sum_j weights[:, j] * y[:, j] over the k ranks in order: [R, k, H] -> [R, H]."""
  out = y[:, 0] * weights[:, 0, None]
  for j in range(1, y.shape[1]):
    out = out + y[:, j] * weights[:, j, None]
  return out


def sort_pairs(experts, num_experts: int):
  """The R * k (row, expert) pairs sorted by expert (stable; "elsewhere" pairs, id E, last):
  (order [R*k] into the flattened pairs, group_sizes [E] int32, not counting those)."""
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[flat].add(1)
  return order, sizes[:num_experts]


def xla_gate_up(xs, w_gate_up, sizes, bias=0, clamp=()):
  """xs [M, H] sorted pairs, w_gate_up [E, H, 2, I], sizes [E] -> silu(gate) * up [M, I];
  bias [M, 2, I]: each pair's gate/up bias, clamp: `_swiglu`'s (gpt-oss)."""
  e, h, _, i = w_gate_up.shape
  w = quant.dequantize(w_gate_up, xs.dtype)
  gu = jax.lax.ragged_dot(xs, w.reshape(e, h, 2 * i), sizes)
  return _swiglu(gu.reshape(-1, 2, i) + bias, clamp).astype(xs.dtype)


def xla_combine(y, position, weights):
  """y [M, H] sorted pairs' outputs, position [R, k] of each row's pairs in y (-1: elsewhere),
  weights [R, k] -> [R, H]: the weighted sum over ranks j = 0..k-1 in order."""
  picked = y[jnp.maximum(position, 0)].astype(weights.dtype)              # [R, k, H]
  return _sum_ranks(jnp.where((position >= 0)[:, :, None], picked, 0), weights)


def xla_down(a, w_down, sizes):
  """`lax.ragged_dot(a, w_down, sizes)` (a quantized stack dequantized whole first)."""
  return jax.lax.ragged_dot(a, quant.dequantize(w_down, a.dtype), sizes)


@dataclasses.dataclass(frozen=True)
class ExpertOps:
  """The three stages of `grouped` over the sorted pairs (rows past sum(sizes) undefined):
  gate_up (xs [M, H], w_gate_up, sizes [E]) -> [M, I]; down (a [M, I], w_down, sizes) -> [M, H]
  (`lax.ragged_dot`'s contract); combine (y, position, weights) -> [R, H] as `xla_combine`."""
  gate_up: Callable = xla_gate_up
  down: Callable = xla_down
  combine: Callable = xla_combine


def grouped(params: MoEParams, x, weights, experts, ops: ExpertOps = ExpertOps()):
  """The (row, expert) pairs sorted by expert through `ops` (XLA's ragged_dot by default; the
  Pallas kernels: `pallas.grouped_gemm.expert_ops`), then each row's pairs summed in rank order.
  Experts that are not `plain` (gpt-oss) take XLA's stages with each pair's biases."""
  r, k = experts.shape
  e = params.w_gate_up.shape[0]
  order, sizes = sort_pairs(experts, e)
  xs = x[order // k]                                                   # [R*k, H]
  if params.plain:
    y = ops.down(ops.gate_up(xs, params.w_gate_up, sizes), params.w_down, sizes)  # [R*k, H]
  else:  # (rows of elsewhere pairs, sorted last, are undefined either way)
    ids = jnp.minimum(experts.reshape(-1)[order], e - 1)
    a = xla_gate_up(xs, params.w_gate_up, sizes, _rows(params.gate_up_bias, ids, xs.dtype),
                    params.swiglu_clamp)
    y = xla_down(a, params.w_down, sizes) + _rows(params.down_bias, ids, xs.dtype)
  position = jnp.zeros_like(order).at[order].set(jnp.arange(r * k, dtype=order.dtype))
  position = jnp.where(experts < e, position.reshape(r, k), -1)
  return ops.combine(y, position, weights.astype(jnp.float32)).astype(x.dtype)


def xla_pair_gate_up(x, w_gate_up, experts, bias=0, clamp=()):
  """x [R, H], w_gate_up [E, H, 2, I], experts [R, k] (E: elsewhere) -> silu(gate) * up per
  pair p = r * k + j [R*k, I], each pair's expert gathered (elsewhere pairs: zeros); bias
  [R*k, 2, I] and clamp as `xla_gate_up`'s."""
  e, k = w_gate_up.shape[0], experts.shape[1]
  flat = experts.reshape(-1)
  w = quant.dequantize(quant.take(w_gate_up, jnp.minimum(flat, e - 1)), x.dtype)
  gu = jnp.einsum("ph,phsi->psi", jnp.repeat(x, k, axis=0), w) + bias
  return jnp.where((flat < e)[:, None], _swiglu(gu, clamp), 0).astype(x.dtype)


def xla_pair_down(a, w_down, experts):
  """a [R*k, I], w_down [E, I, H], experts [R, k] -> each pair's down projection [R*k, H]."""
  flat = experts.reshape(-1)
  w = quant.dequantize(quant.take(w_down, jnp.minimum(flat, w_down.shape[0] - 1)), a.dtype)
  return jnp.einsum("pi,pih->ph", a, w)


@dataclasses.dataclass(frozen=True)
class PairOps:
  """The two GEMM stages of `pairs`, pair p = r * k + j of experts [R, k] (rows of elsewhere
  pairs undefined): gate_up (x [R, H], w_gate_up, experts) -> [R*k, I]; down (a [R*k, I],
  w_down, experts) -> [R*k, H]."""
  gate_up: Callable = xla_pair_gate_up
  down: Callable = xla_pair_down


def pairs(params: MoEParams, x, weights, experts, ops: PairOps = PairOps()):
  """Pair by pair through `ops`, no sort, then each row's k pairs summed in rank order. An
  expert two rows choose is read twice: for steps of few pairs (a decode step; the Pallas
  kernels: `pallas.grouped_gemm.pair_ops`). Experts that are not `plain` (gpt-oss) take XLA's
  stages with each pair's biases."""
  if params.plain:
    y = ops.down(ops.gate_up(x, params.w_gate_up, experts), params.w_down, experts)
  else:
    ids = jnp.minimum(experts.reshape(-1), params.w_gate_up.shape[0] - 1)
    a = xla_pair_gate_up(x, params.w_gate_up, experts, _rows(params.gate_up_bias, ids, x.dtype),
                         params.swiglu_clamp)
    y = xla_pair_down(a, params.w_down, experts) + _rows(params.down_bias, ids, x.dtype)
  return sum_pairs(y, weights, experts, params.w_gate_up.shape[0]).astype(x.dtype)


def sum_pairs(y, weights, experts, num_experts: int):
  """Pair outputs y [R*k, H] (pair p = r * k + j; rows of elsewhere pairs, id num_experts,
  ignored) summed per row in rank order with weights [R, k] -> [R, H] float32."""
  r, k = experts.shape
  y = jnp.where((experts < num_experts)[:, :, None], y.reshape(r, k, -1).astype(jnp.float32), 0)
  return _sum_ranks(y, weights.astype(jnp.float32))


def distinct_experts(experts, num_experts: int):
  """How many different experts rows [R, k] route to (what a step's MoE layer must read)."""
  hit = jnp.zeros((num_experts,), bool).at[experts.reshape(-1)].set(True)
  return jnp.sum(hit.astype(jnp.int32))


EXPERT_FORMATS = ("float", "int4", "fp8")


def init_params(key, hidden: int, num_experts: int, intermediate: int, dtype,
                std: float = 0.02, bias: bool = False, experts: str = "float",
                held: int | None = None, biases: bool = False,
                swiglu_clamp: tuple[float, float] = ()) -> MoEParams:
  """Random experts (benchmarks and tests) in `experts` format: float (`dtype`), int4 or fp8
  (drawn in the format: `quant.random_int4`, `quant.random_fp8`); the router (and bias) in
  float32. held: the stacks hold only the first `held` of the num_experts the router picks
  from (one device's share under expert parallelism: pairs for the others are elsewhere).
  biases, swiglu_clamp: gpt-oss's router and expert biases and clamped SwiGLU."""
  if experts not in EXPERT_FORMATS:
    raise ValueError(f"experts={experts!r}: choose one of {EXPERT_FORMATS}")
  k1, k2, k3 = jax.random.split(key, 3)
  extra = {}
  if biases:  # (drawn apart: the other leaves' streams unchanged)
    kb = jax.random.split(jax.random.fold_in(key, 5), 3)
    n = held or num_experts
    extra = dict(router_bias=std * jax.random.normal(kb[0], (num_experts,), jnp.float32),
                 gate_up_bias=random_weight(kb[1], (n, 2, intermediate), dtype, std),
                 down_bias=random_weight(kb[2], (n, hidden), dtype, std))
  w = {"float": lambda k, *shape: random_weight(k, shape, dtype, std),
       "int4": lambda k, *shape: quant.random_int4(k, shape, std=std),
       "fp8": lambda k, *shape: quant.random_fp8(k, shape, std=std)}[experts]
  return MoEParams(router=std * jax.random.normal(k1, (hidden, num_experts), jnp.float32),
                   w_gate_up=w(k2, held or num_experts, hidden, 2, intermediate),
                   w_down=w(k3, held or num_experts, intermediate, hidden),
                   bias=(0.1 * jax.random.normal(jax.random.fold_in(key, 4), (num_experts,),
                                                 jnp.float32) if bias else None),
                   swiglu_clamp=tuple(swiglu_clamp), **extra)
