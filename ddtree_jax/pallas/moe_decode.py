"""A Pallas (Triton GPU) kernel that routes a mixture-of-experts layer at decode inside its first
expert GEMM: `Kernels.moe` runs a step of few (row, expert) pairs here
(`KernelTuning.moe_decode_max`), with the contract of `moe.pairs`.

  gate_up  grid (pairs, blocks of I): program (p, c) takes row r = p // k's rank-j expert
           (j = p % k) and writes silu(gate) * up for its block of I columns, [P, I] in the
           compute dtype; the programs of the first block also write each pair's expert and
           weight [P].
  down     the pair kernels' down projection (`grouped_gemm.pair_matmul`, `quant_gemm`'s for a
           quantized stack), then each row's pairs summed in rank order (`moe.sum_pairs`).

Routing: the kernel chooses the experts from the router's float32 logits [R, E] (`choose`:
softmax, or sigmoid + selection bias; top-k, ties to the lower id; renormalised, scaled:
`moe.select` with one expert group), each program for its own row: a few reductions over E
lanes, where XLA's form launches the softmax, the top-k and their glue as kernels of their own.
Or the experts and weights are given ([R, k]: group-limited routing, expert parallelism's local
ids). An expert id E means held elsewhere: its pair reads no weights and adds nothing. The
kernel's softmax and XLA's may differ in the last bit, so a weight may round to the neighbouring
value of the compute dtype: a near-tie, as between any two GEMM orders.

Every expert format runs the same kernel: a float stack through `float_step`, a quantized one
through `quant_gemm`'s K steps (int4 nibble planes, fp8 block tiles, dequantized in registers),
each with the (load, compute) step interface of `quant_gemm.Tile`'s kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_jax.models import moe, quant
from ddtree_jax.pallas import grouped_gemm, quant_gemm

F32 = jnp.float32


def supported(params: moe.MoEParams) -> bool:
  """Whether these kernels take the layer's stacks (float ones, or quantized ones that
  `quant_gemm.supported` takes)."""
  return all(not quant.is_quantized(w) or quant_gemm.supported(w)
             for w in (params.w_gate_up, params.w_down))


def choose(logits, bias, routing: moe.Routing, dtype):
  """One row's routing from its logits [L] float32 (lanes past the experts -inf; bias [L] or
  None), in jnp ops a Triton kernel takes (single-axis reductions, no sort): (experts, weights),
  top_k int32 and float32 scalars in rank order, the weights rounded to dtype as `moe.select`
  rounds them (one expert group)."""
  lanes = jnp.arange(logits.shape[0])
  valid = logits > -jnp.inf
  if routing.scoring == "softmax":
    z = jnp.exp(logits - jnp.max(logits, axis=0))
    scores = choice = z / jnp.sum(z, axis=0)
  else:
    scores = jnp.where(valid, jax.nn.sigmoid(logits), 0.0)
    choice = scores if bias is None else scores + bias
  choice = jnp.where(valid, choice, -jnp.inf)
  experts, weights = [], []
  for _ in range(routing.top_k):
    best = jnp.max(choice, axis=0)
    e = jnp.min(jnp.where(choice == best, lanes, lanes.shape[0]), axis=0)
    hit = lanes == e
    experts.append(e.astype(jnp.int32))
    weights.append(jnp.sum(jnp.where(hit, scores, 0.0), axis=0))
    choice = jnp.where(hit, -jnp.inf, choice)
  if routing.norm_topk_prob:
    total = weights[0]
    for w in weights[1:]:
      total = total + w
    if routing.scoring == "sigmoid":
      total = total + 1e-20
    weights = [w / total for w in weights]
  if routing.scaling != 1.0:
    weights = [w * routing.scaling for w in weights]
  return experts, [w.astype(dtype).astype(F32) for w in weights]


def float_step(refs, g, tile, halves, *, block_k, k_dim, **_):
  """A float stack's K step as (load, compute), `quant_gemm.int4_step`'s interface: the weight
  tiles of block_k inputs per output half, then a dot each."""
  x_ref, w_ref = refs

  def inputs(i):
    k = i * block_k + jnp.arange(block_k)
    return k, k < k_dim

  def load(i):
    return [tile.w(w_ref, g, i * block_k, inputs(i)[1], c0) for c0 in halves]

  def compute(i, tiles, accs):
    x = tile.x(x_ref, *inputs(i))
    return tuple(acc + tile.dot(x, w) for acc, w in zip(accs, tiles))
  return load, compute


def _operands(lhs, w, swiglu: bool, block_k: int, asm: bool, name: str):
  """(stack arrays, K steps, N, step_fn, its static meta) of a float or quantized stack."""
  if not quant.is_quantized(w):
    if w.dtype != lhs.dtype:
      raise ValueError(f"{name}: activations are {lhs.dtype}, the expert stack {w.dtype}")
    flat = w.reshape(w.shape[0], w.shape[1], -1)
    k_dim = w.shape[1]
    return ((flat,), -(-k_dim // block_k), w.shape[-1], float_step,
            dict(block_k=block_k, k_dim=k_dim))
  stack, scale, k_steps, n_dim, step_fn, meta = quant_gemm.operands(lhs, w, swiglu, block_k,
                                                                    asm, name)
  return (stack, scale), k_steps, n_dim, step_fn, meta


def _row_routing(route_refs, r, *, routing, num_experts, lanes, dtype):
  """Row r's (experts, weights), top_k scalars each: chosen from the logits (route_refs =
  (logits [R, E], bias [E] or absent)) or read (route_refs = (experts [R, k], weights [R, k]))."""
  if len(route_refs) == 2 and route_refs[0].dtype == jnp.int32:
    experts_ref, weights_ref = route_refs
    return ([experts_ref[r, j] for j in range(routing.top_k)],
            [weights_ref[r, j] for j in range(routing.top_k)])
  lane = jnp.arange(lanes)
  ids = jnp.minimum(lane, num_experts - 1)
  valid = lane < num_experts
  logits = jnp.where(valid, plgpu.load(route_refs[0].at[jnp.full((lanes,), r), ids]), -jnp.inf)
  bias = None
  if len(route_refs) == 2:
    bias = jnp.where(valid, plgpu.load(route_refs[1].at[ids]).astype(F32), 0.0)
  return choose(logits, bias, routing, dtype)


def _gate_up_kernel(*refs, n_route, step_fn, routing, num_experts, lanes, block_m, block_n,
                    k_steps, n_dim, swap, dtype, meta):
  route_refs, (x_ref, *w_refs, o_ref, experts_ref, weights_ref) = refs[:n_route], refs[n_route:]
  p, c = pl.program_id(0), pl.program_id(1)  # (outside the `when`: interpret mode)
  r, j = p // routing.top_k, p % routing.top_k
  experts, weights = _row_routing(route_refs, r, routing=routing, num_experts=num_experts,
                                  lanes=lanes, dtype=dtype)
  e, w = experts[0], weights[0]
  for rank in range(1, routing.top_k):
    e = jnp.where(j == rank, experts[rank], e)
    w = jnp.where(j == rank, weights[rank], w)
  row_ok = jnp.arange(block_m) < 1
  cols = c * block_n + jnp.arange(block_n)
  tile = quant_gemm.Tile(swap, r + jnp.arange(block_m), row_ok, c * block_n, cols, cols < n_dim)

  @pl.when(c == 0)
  def _():
    pair = p + jnp.arange(block_m)
    plgpu.store(experts_ref.at[pair], jnp.full((block_m,), e, jnp.int32), mask=row_ok)
    plgpu.store(weights_ref.at[pair], jnp.full((block_m,), w, F32), mask=row_ok)

  @pl.when(e < num_experts)
  def _():
    halves = (0, n_dim)  # columns [0, N) of the stack are the gate, [N, 2N) the up projection
    load, compute = step_fn((x_ref, *w_refs), e, tile, halves, n_dim=n_dim, **meta)
    zero = jnp.zeros((block_n, block_m) if swap else (block_m, block_n), F32)
    gate, up = lax.fori_loop(0, k_steps, lambda i, accs: compute(i, load(i), accs),
                             (zero, zero))
    rows, cs = tile.pair(p + jnp.arange(block_m), cols)
    mr, mc = tile.pair(row_ok, tile.col_ok)
    plgpu.store(o_ref.at[rows, cs], (jax.nn.silu(gate) * up).astype(o_ref.dtype),
                mask=mr & mc)


def _gate_up(route, x, w, pairs: int, *, block_n, block_k, routing, num_warps, num_stages, swap,
             interpret):
  """The routed gate/up kernel: (a [P, I] in x's dtype, experts [P] int32, weights [P] f32)."""
  stacks, k_steps, n_dim, step_fn, meta = _operands(x, w, True, block_k, not interpret,
                                                    "moe_decode")
  if num_stages is None:
    num_stages = quant_gemm.DEFAULT_STAGES.get(type(w), 3)
  whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))
  return pl.pallas_call(
      functools.partial(_gate_up_kernel, n_route=len(route), step_fn=step_fn, routing=routing,
                        num_experts=w.shape[0], lanes=max(16, pl.next_power_of_2(
                            route[0].shape[1])), block_m=16, block_n=block_n, k_steps=k_steps,
                        n_dim=n_dim, swap=swap, dtype=x.dtype, meta=meta),
      grid=(pairs, pl.cdiv(n_dim, block_n)),
      in_specs=[whole(a.shape) for a in (*route, x, *stacks)],
      out_specs=[whole((pairs, n_dim)), whole((pairs,)), whole((pairs,))],
      out_shape=[jax.ShapeDtypeStruct((pairs, n_dim), x.dtype),
                 jax.ShapeDtypeStruct((pairs,), jnp.int32),
                 jax.ShapeDtypeStruct((pairs,), F32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="moe_decode_gate_up",
  )(*route, x, *stacks)


_STATIC = ("routing", "gate_up_block", "block_k", "num_warps", "num_stages", "down_blocks",
           "swap", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def moe_decode(params: moe.MoEParams, x, routing: moe.Routing, weights=None, experts=None, *,
               gate_up_block: int = 32, block_k: int = 256, num_warps: int = 4,
               num_stages: int | None = None, down_blocks: tuple[int, int, int] = (16, 64, 256),
               swap: bool = False, interpret=None):
  """The layer's mixture of experts for x [R, H] -> [R, H] in x's dtype: routed from the
  router's logits inside the gate/up kernel (weights, experts None; one expert group, else
  routed by `moe.select`) or over given weights [R, k] and experts [R, k] (E: elsewhere), as
  `moe.pairs`. gate_up_block: columns of I per program; block_k: inputs per K step (int4: a
  power of two >= 128); num_stages None: `quant_gemm.DEFAULT_STAGES`, 3 for float stacks;
  down_blocks: the down pair kernel's (block_m, block_n, block_k); swap: quantized tiles
  computed transposed (`quant_gemm`); interpret None: on a CPU backend."""
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  if (weights is None) != (experts is None):
    raise ValueError("moe_decode: give both weights and experts, or neither")
  if weights is None:
    logits = moe.router_logits(params, x)
    if routing.n_group > 1:
      weights, experts = moe.select(logits, params.bias, routing, x.dtype)
  if weights is None:
    route = (logits,) if params.bias is None else (logits, params.bias.astype(F32))
  else:
    if experts.shape != (x.shape[0], routing.top_k) or weights.shape != experts.shape:
      raise ValueError(f"moe_decode: weights {weights.shape} and experts {experts.shape} must "
                       f"be [rows, top_k] = [{x.shape[0]}, {routing.top_k}]")
    route = (experts.astype(jnp.int32), weights.astype(x.dtype).astype(F32))
  r, k = x.shape[0], routing.top_k
  a, chosen, w = _gate_up(route, x, params.w_gate_up, r * k, block_n=gate_up_block,
                          block_k=block_k, routing=routing, num_warps=num_warps,
                          num_stages=num_stages,
                          swap=swap and quant.is_quantized(params.w_gate_up), interpret=interpret)
  bm, bn, bk = down_blocks
  kw = dict(block_m=bm, block_n=bn, block_k=bk, interpret=interpret)
  if quant.is_quantized(params.w_down):
    y = quant_gemm.pair_matmul(a, params.w_down, chosen, swap=swap, **kw)
  else:
    y = grouped_gemm.pair_matmul(a, params.w_down, chosen, **kw)
  e = params.w_gate_up.shape[0]
  return moe.sum_pairs(y, w.reshape(r, k), chosen.reshape(r, k), e).astype(x.dtype)
