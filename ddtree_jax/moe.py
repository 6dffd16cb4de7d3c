"""Mixture-of-experts MLP (Qwen3-MoE): a float32 softmax router, top-k experts per token, and a
dropless mixture of SwiGLU experts.

Every implementation has the contract `(params, x [R, H], weights [R, k], experts [R, k]) ->
[R, H]`: each row's output is sum_j weights[r, j] * expert_{experts[r, j]}(x[r]), summed in rank
order j = 0..k-1; an expert id E (one past the last) means "held elsewhere" and adds nothing
(expert parallelism: a shard's pairs for other shards' experts). No capacity factor: every (token, expert) pair is computed, so no token is
ever dropped (a dropped token would change the output against AR). A row's output depends on
its own routing alone, never on which other rows share the batch.

  reference  every expert on every row, then the routing weights pick (tests; E x the work)
  grouped    the (row, expert) pairs sorted by expert, two `lax.ragged_dot`s over the groups
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MoEParams:
  """One layer's experts. E experts, H hidden, I = moe_intermediate_size."""
  router: Array            # [H, E], float32 (HF computes routing in float32)
  w_gate_up: Array         # [E, H, 2, I]  (gate, up)
  w_down: Array            # [E, I, H]


def route(params: MoEParams, x, top_k: int, norm_topk_prob: bool):
  """Router of x [R, H]: softmax over experts in float32, the top_k by probability (ties to the
  lower expert id), renormalised over the chosen ones when norm_topk_prob. Returns (weights
  [R, k] in x's dtype, experts [R, k] int32)."""
  logits = jnp.dot(x.astype(jnp.float32), params.router.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  probs = jax.nn.softmax(logits, axis=-1)
  weights, experts = jax.lax.top_k(probs, top_k)
  if norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights.astype(x.dtype), experts.astype(jnp.int32)


def _swiglu(gu):
  """[..., 2, I] (gate, up) -> silu(gate) * up [..., I]."""
  return jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :]


def reference(params: MoEParams, x, weights, experts):
  """Every expert on every row (E x the work), then each row's k outputs in rank order."""
  gu = jnp.einsum("rh,ehsi->resi", x, params.w_gate_up)
  y = jnp.einsum("rei,eih->reh", _swiglu(gu), params.w_down)          # [R, E, H]
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


def grouped(params: MoEParams, x, weights, experts, matmul=jax.lax.ragged_dot):
  """The sorted pairs through `matmul` (lhs [M, K], rhs [E, K, N], group_sizes [E] -> [M, N]:
  `lax.ragged_dot` or a Pallas grouped GEMM; rows past sum(group_sizes) are left undefined),
  unsorted, then summed in rank order."""
  r, k = experts.shape
  e, h, _, i = params.w_gate_up.shape
  order, sizes = sort_pairs(experts, e)
  xs = x[order // k]                                                   # [R*k, H]
  gu = matmul(xs, params.w_gate_up.reshape(e, h, 2 * i), sizes).reshape(r * k, 2, i)
  y = matmul(_swiglu(gu).astype(x.dtype), params.w_down, sizes)        # [R*k, H]
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(r * k, dtype=order.dtype))
  y = y[inverse].reshape(r, k, h).astype(x.dtype)
  return _sum_ranks(jnp.where((experts < e)[:, :, None], y, 0), weights)


def distinct_experts(experts, num_experts: int):
  """How many different experts rows [R, k] route to (what a step's MoE layer must read)."""
  hit = jnp.zeros((num_experts,), bool).at[experts.reshape(-1)].set(True)
  return jnp.sum(hit.astype(jnp.int32))


def init_params(key, hidden: int, num_experts: int, intermediate: int, dtype,
                std: float = 0.02) -> MoEParams:
  """Random experts (benchmarks and tests); the router in float32."""
  k1, k2, k3 = jax.random.split(key, 3)
  w = lambda k, *shape: (std * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
  return MoEParams(router=std * jax.random.normal(k1, (hidden, num_experts), jnp.float32),
                   w_gate_up=w(k2, num_experts, hidden, 2, intermediate),
                   w_down=w(k3, num_experts, intermediate, hidden))
