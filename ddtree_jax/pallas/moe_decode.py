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
from ddtree_jax.pallas import grouped_gemm, moe_glue, quant_gemm

F32 = jnp.float32


def supported(params: moe.MoEParams, dtype) -> bool:
  """Whether these kernels take the layer's stacks with activations of `dtype` (float stacks,
  or quantized ones that `quant_gemm.supported` takes)."""
  return all(not quant.is_quantized(w) or quant_gemm.supported(w, dtype)
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
  """Row r's (experts, weights), top_k scalars each: chosen from the router's partial logits
  (route_refs = (partials [S, R, E], bias [E] or absent), summed over S in order) or read
  (route_refs = (experts [R, k], weights [R, k]))."""
  if len(route_refs) == 2 and route_refs[0].dtype == jnp.int32:
    experts_ref, weights_ref = route_refs
    return ([experts_ref[r, j] for j in range(routing.top_k)],
            [weights_ref[r, j] for j in range(routing.top_k)])
  lane = jnp.arange(lanes)
  ids = jnp.minimum(lane, num_experts - 1)
  valid = lane < num_experts
  partials = route_refs[0]
  at = lambda s: partials.at[jnp.full((lanes,), s), jnp.full((lanes,), r), ids]
  logits = plgpu.load(at(0))
  for s in range(1, partials.shape[0]):
    logits = logits + plgpu.load(at(s))
  logits = jnp.where(valid, logits, -jnp.inf)
  bias = None
  if len(route_refs) == 2:
    bias = jnp.where(valid, plgpu.load(route_refs[1].at[ids]).astype(F32), 0.0)
  return choose(logits, bias, routing, dtype)


def _gate_up_kernel(*refs, n_route, step_fn, routing, num_experts, lanes, block_m, block_n,
                    span, k_steps, n_dim, swap, dtype, meta):
  route_refs, (x_ref, *w_refs, o_ref, group_ref, here_ref, weights_ref) = (refs[:n_route],
                                                                           refs[n_route:])
  p, c = pl.program_id(0), pl.program_id(1)  # (outside the `when`: interpret mode)
  r, j = p // routing.top_k, p % routing.top_k
  experts, weights = _row_routing(route_refs, r, routing=routing, num_experts=num_experts,
                                  lanes=lanes, dtype=dtype)
  e, w = experts[0], weights[0]
  for rank in range(1, routing.top_k):
    e = jnp.where(j == rank, experts[rank], e)
    w = jnp.where(j == rank, weights[rank], w)
  row_ok = jnp.arange(block_m) < 1
  n0 = c * span
  cols = n0 + jnp.arange(block_n)
  col_ok = (jnp.arange(block_n) < span) & (cols < n_dim)
  tile = quant_gemm.Tile(swap, r + jnp.arange(block_m), row_ok, n0, cols, col_ok)

  @pl.when(c == 0)
  def _():
    pair = p + jnp.arange(block_m)
    here = e < num_experts
    plgpu.store(group_ref.at[pair], jnp.full((block_m,), jnp.minimum(e, num_experts - 1),
                                             jnp.int32), mask=row_ok)
    plgpu.store(here_ref.at[pair], jnp.full((block_m,), here.astype(jnp.int32)), mask=row_ok)
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


def fill_span(n_dim: int, pairs: int, sm_count: int, block_n: int) -> tuple[int, int]:
  """(columns per program, their power-of-two load width) that spread `pairs` x n_dim columns
  over about sm_count programs: a grid of pairs x 12 programs leaves a third of 132 SMs idle,
  and each SM streams only so fast. Spans are multiples of 16 columns (32-byte rows in bf16),
  loads at most block_n wide."""
  per_pair = max(1, sm_count // pairs)
  span = -(-n_dim // per_pair)
  span = min(block_n, -(-span // 16) * 16)
  return span, min(block_n, pl.next_power_of_2(span))


def launch(tuning, params: moe.MoEParams, pairs: int, hidden: int) -> dict:
  """`moe_decode`'s launch keywords for `pairs` (row, expert) pairs of a layer of width hidden
  from a `KernelTuning`: its gate/up and down launches, their spans filling the device's SMs
  where the tuning asks (`fill_span`), the router launch."""
  quantized = quant.is_quantized(params.w_gate_up)
  gate_up, block_k, warps = (tuning.moe_decode_quant_launch if quantized
                             else tuning.moe_decode_launch)
  span = down_span = None
  down = tuning.moe_pair_blocks
  sms = tuning.device_sm_count()
  if tuning.moe_decode_fill:
    span, gate_up = fill_span(params.w_gate_up.shape[-1], pairs, sms, gate_up)
  if tuning.moe_down_fill_width:
    down_span, width = fill_span(hidden, pairs, sms, tuning.moe_down_fill_width)
    down = (down[0], width, down[2])
  return dict(gate_up_block=gate_up, span=span, block_k=block_k, num_warps=warps,
              down_blocks=down, down_span=down_span, router=tuning.moe_router_launch,
              swap=tuning.moe_quant_swap, interpret=tuning.interpret)


def _gate_up(route, x, w, pairs: int, *, block_n, span, block_k, routing, num_warps,
             num_stages, swap, interpret):
  """The routed gate/up kernel: (a [P, I] in x's dtype, the pairs' experts clamped to [0, E)
  [P] int32, whether each is held here [P] int32, their weights [P] f32)."""
  stacks, k_steps, n_dim, step_fn, meta = _operands(x, w, True, block_k, not interpret,
                                                    "moe_decode")
  if num_stages is None:
    num_stages = quant_gemm.DEFAULT_STAGES.get(type(w), 3)
  span = grouped_gemm.check_span(span, block_n)
  whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))
  vec = lambda dt: jax.ShapeDtypeStruct((pairs,), dt)
  return pl.pallas_call(
      functools.partial(_gate_up_kernel, n_route=len(route), step_fn=step_fn, routing=routing,
                        num_experts=w.shape[0], lanes=max(16, pl.next_power_of_2(
                            route[0].shape[-1])), block_m=16, block_n=block_n, span=span,
                        k_steps=k_steps, n_dim=n_dim, swap=swap, dtype=x.dtype, meta=meta),
      grid=(pairs, pl.cdiv(n_dim, span)),
      in_specs=[whole(a.shape) for a in (*route, x, *stacks)],
      out_specs=[whole((pairs, n_dim))] + [whole((pairs,))] * 3,
      out_shape=[jax.ShapeDtypeStruct((pairs, n_dim), x.dtype), vec(jnp.int32), vec(jnp.int32),
                 vec(F32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="moe_decode_gate_up",
  )(*route, x, *stacks)


_STATIC = ("routing", "gate_up_block", "span", "block_k", "num_warps", "num_stages",
           "down_blocks", "down_span", "router", "swap", "eps", "interpret")


def _partial_logits(params: moe.MoEParams, x, router: tuple[int, int, int, int], interpret):
  """The router's logits of x as [S, R, E] float32 partials: `moe_glue.router_partials` at
  router = (splits, block_e, block_h, warps) where it takes H, else XLA's [1, R, E]."""
  splits, block_e, block_h, warps = router
  if splits and moe_glue.router_supported(x.shape[1], splits, block_h):
    return moe_glue.router_partials(x, params.router.astype(F32), splits=splits,
                                    block_e=block_e, block_h=block_h, num_warps=warps,
                                    interpret=interpret)
  return moe.router_logits(params, x)[None]


@functools.partial(jax.jit, static_argnames=_STATIC)
def moe_decode(params: moe.MoEParams, x, routing: moe.Routing, weights=None, experts=None,
               residual=None, norm=None, shared=None, *, gate_up_block: int = 32,
               span: int | None = None, block_k: int = 256, num_warps: int = 4,
               num_stages: int | None = None, down_blocks: tuple[int, int, int] = (16, 64, 256),
               down_span: int | None = None, router: tuple[int, int, int, int] = (8, 32, 64, 4),
               swap: bool = False,
               eps: float = 1e-6, interpret=None):
  """The layer's mixture of experts for x [R, H] -> [R, H] in x's dtype: routed from the
  router's logits inside the gate/up kernel (weights, experts None; one expert group, else
  routed by `moe.select`) or over given weights [R, k] and experts [R, k] (E: elsewhere), as
  `moe.pairs`. With residual [R, H] (and norm [H], shared [R, H] or None: the shared experts'
  output) it returns `moe_glue.combine_norm`'s (x', rms_norm(x', norm)) instead, x' = residual +
  (mixture + shared), in one launch after the down kernel.

  gate_up_block: the gate/up kernel's load width in I columns (a power of two), span: columns
  per program (<= gate_up_block; None: gate_up_block; `fill_span`); block_k: inputs per K step
  (int4: a power of two >= 128); num_stages None: `quant_gemm.DEFAULT_STAGES`, 3 for float
  stacks; down_blocks: the down pair kernel's (block_m, block_n, block_k), down_span its H
  columns per program (None: block_n); router: the router
  kernel's (splits, block_e, block_h, warps), splits 0 = XLA's router; swap: quantized tiles
  computed transposed (`quant_gemm`); interpret None: on a CPU backend."""
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  if (weights is None) != (experts is None):
    raise ValueError("moe_decode: give both weights and experts, or neither")
  if (residual is None) != (norm is None) or (shared is not None and residual is None):
    raise ValueError("moe_decode: residual and norm come together (shared only with them)")
  if weights is None:
    partials = _partial_logits(params, x, router, interpret)
    if routing.n_group > 1:
      weights, experts = moe.select(jnp.sum(partials, axis=0), params.bias, routing, x.dtype)
  if weights is None:
    route = (partials,) if params.bias is None else (partials, params.bias.astype(F32))
  else:
    if experts.shape != (x.shape[0], routing.top_k) or weights.shape != experts.shape:
      raise ValueError(f"moe_decode: weights {weights.shape} and experts {experts.shape} must "
                       f"be [rows, top_k] = [{x.shape[0]}, {routing.top_k}]")
    route = (experts.astype(jnp.int32), weights.astype(x.dtype).astype(F32))
  r, k = x.shape[0], routing.top_k
  a, group, here, w = _gate_up(route, x, params.w_gate_up, r * k, block_n=gate_up_block,
                               span=span, block_k=block_k, routing=routing,
                               num_warps=num_warps, num_stages=num_stages,
                               swap=swap and quant.is_quantized(params.w_gate_up),
                               interpret=interpret)
  bm, bn, bk = down_blocks
  kw = dict(here=here, block_m=bm, block_n=bn, block_k=bk, span=down_span, interpret=interpret)
  if quant.is_quantized(params.w_down):
    y = quant_gemm.pair_matmul(a, params.w_down, group, swap=swap, **kw)
  else:
    y = grouped_gemm.pair_matmul(a, params.w_down, group, **kw)
  if residual is not None:
    return moe_glue.combine_norm(y, w.reshape(r, k), here, residual, norm, shared, eps=eps,
                                 interpret=interpret)
  held = jnp.where(here > 0, 0, 1).reshape(r, k)   # (1: the one "elsewhere" id)
  return moe.sum_pairs(y, w.reshape(r, k), held, 1).astype(x.dtype)
