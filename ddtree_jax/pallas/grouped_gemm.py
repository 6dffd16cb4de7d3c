"""Pallas (Triton GPU) kernels of a mixture-of-experts layer over its (row, expert) pairs sorted
by expert (`moe.grouped`, whose `ExpertOps` they fill: `moe_ops.expert_ops`), or pair by pair
for a step of few pairs (`moe.pairs`, `moe_ops.pair_ops`: pair_matmul, one tile per pair, no
sort).

grouped_matmul: `lax.ragged_dot`'s contract, lhs [M, K] whose rows come in consecutive groups
(group_sizes [E], summing to M), rhs [E, K, N]; row r of group g gives lhs[r] @ rhs[g]. The rows
are cut into tiles of block_m rows that never straddle two groups; one program per (tile, block
of N columns) loops over K and multiplies its rows by its group's weight block. So a group's
weights are read once per tile (once at decode, where a group holds a few rows), and a group with
no rows (an expert no token chose) has no tile: its weights are never read. The tile list is
computed on device from group_sizes, so one compiled program serves every routing: there are at
most min(M, ceil(M / block_m) + E) tiles, and programs past the last one exit. Rows past
sum(group_sizes) are not written. With swiglu the gate and up projections are one launch and
the activation is applied to their float32 accumulators. Offsets into an operand past 2^32
bytes are 64-bit (Pallas's Triton lowering picks them by the operand's size), so a Kimi-K2
layer's 22 GB expert stack takes the same kernel. A quantized stack (`quant.Int4Experts`,
`quant.Fp8Experts`) runs the same tiles in `quant_gemm`, dequantized in registers.

combine: each token row's k pair outputs gathered from the sorted rows and summed with their
router weights in rank order, one launch (XLA's form is a gather and 2k elementwise kernels).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def tiles(group_sizes, m: int, block_m: int):
  """Per tile slot (static count min(M, ceil(M/block_m) + E)): (group, first row, rows), rows 0
  past the last tile."""
  sizes = group_sizes.astype(jnp.int32)
  e = sizes.shape[0]
  slots = min(m, -(-m // block_m) + e)
  per_group = (sizes + block_m - 1) // block_m
  tile_end = jnp.cumsum(per_group)
  row_start = jnp.cumsum(sizes) - sizes
  t = jnp.arange(slots, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(tile_end, t, side="right", method="compare_all"),
                      e - 1).astype(jnp.int32)  # (one fusion; the default "scan" is a loop)
  first_tile = tile_end[group] - per_group[group]
  row0 = row_start[group] + (t - first_tile) * block_m
  rows = jnp.clip(row_start[group] + sizes[group] - row0, 0, block_m)
  rows = jnp.where(t < tile_end[-1], rows, 0)
  return group, jnp.where(rows > 0, row0, 0), rows


def _kernel(*refs, block_m, block_n, span, block_k, k_dim, n_dim, swiglu, pair_div):
  """One tile: rows [r0, r0 + rows) of x times group g's weights, written from row out0. With
  pair_div the tile is pair t (its program id): x's row t // pair_div, output row t (no row
  arrays to load; XLA would launch a kernel per step to write them)."""
  if pair_div:
    group_ref, rows_ref, x_ref, w_ref, o_ref = refs
  else:
    group_ref, row0_ref, rows_ref, out0_ref, x_ref, w_ref, o_ref = refs
  t = pl.program_id(0)  # (program ids outside the `when`: interpret mode)
  rows, n0 = rows_ref[()], pl.program_id(1) * span

  @pl.when(rows > 0)
  def _():
    g = group_ref[()]
    r0, o0 = (t // pair_div, t) if pair_div else (row0_ref[()], out0_ref[()])
    row_ok = jnp.arange(block_m) < rows
    col_ok = (jnp.arange(block_n) < span) & ((n0 + jnp.arange(block_n)) < n_dim)
    dot = lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                       preferred_element_type=jnp.float32)

    def step(i, accs):
      k0 = i * block_k
      k_ok = (k0 + jnp.arange(block_k)) < k_dim
      x = plgpu.load(x_ref.at[pl.ds(r0, block_m), pl.ds(k0, block_k)],
                     mask=row_ok[:, None] & k_ok[None, :], other=0)
      w = lambda c0: plgpu.load(w_ref.at[g, pl.ds(k0, block_k), pl.ds(c0 + n0, block_n)],
                                mask=k_ok[:, None] & col_ok[None, :], other=0)
      # swiglu: columns [0, N) of w are the gate, [N, 2N) the up projection
      return tuple(acc + dot(x, w(half * n_dim)) for half, acc in enumerate(accs))

    zero = jnp.zeros((block_m, block_n), jnp.float32)
    accs = lax.fori_loop(0, pl.cdiv(k_dim, block_k), step, (zero, zero) if swiglu else (zero,))
    out = jax.nn.silu(accs[0]) * accs[1] if swiglu else accs[0]
    plgpu.store(o_ref.at[pl.ds(o0, block_m), pl.ds(n0, block_n)], out.astype(o_ref.dtype),
                mask=row_ok[:, None] & col_ok[None, :])


def _launch(group, rows, lhs, rhs, m_out, *, row0=None, out0=None, pair_div=0, block_m,
            block_n, block_k, num_warps, num_stages, swiglu, interpret, span=None):
  """The tiles' pallas_call: lhs [M, K], rhs [E, K, N] (swiglu: [E, K, 2, N]) -> [m_out, N];
  per tile its group and rows, and its first row and output row (row0, out0) or pair_div; span:
  columns per program (<= block_n, the load width; None: block_n)."""
  if swiglu:
    if rhs.ndim != 4 or rhs.shape[2] != 2:
      raise ValueError(f"grouped_matmul(swiglu=True): rhs must be [E, K, 2, N], got {rhs.shape}")
    rhs = rhs.reshape(rhs.shape[0], rhs.shape[1], -1)
  m, k_dim = lhs.shape
  _, k2, n_dim = rhs.shape
  n_dim //= 2 if swiglu else 1
  if k2 != k_dim:
    raise ValueError(f"grouped_matmul: lhs {lhs.shape}, rhs {rhs.shape} do not match")
  if lhs.dtype != rhs.dtype:
    raise ValueError(f"grouped_matmul: lhs is {lhs.dtype}, rhs {rhs.dtype}")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  span = check_span(span, block_n)
  per_tile = (group, rows) if pair_div else (group, row0, rows, out0)
  scalar = pl.BlockSpec((None,), lambda t, n: (t,))
  whole = lambda shape: pl.BlockSpec(shape, lambda t, n: (0,) * len(shape))
  return pl.pallas_call(
      functools.partial(_kernel, block_m=block_m, block_n=block_n, span=span, block_k=block_k,
                        k_dim=k_dim, n_dim=n_dim, swiglu=swiglu, pair_div=pair_div),
      grid=(group.shape[0], pl.cdiv(n_dim, span)),
      in_specs=[scalar] * len(per_tile) + [whole((m, k_dim)), whole(rhs.shape)],
      out_specs=whole((m_out, n_dim)),
      out_shape=jax.ShapeDtypeStruct((m_out, n_dim), lhs.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="grouped_matmul",
  )(*per_tile, lhs, rhs)


def check_span(span, block_n: int) -> int:
  """A program's columns: span (None: block_n), a positive multiple of 16 up to block_n."""
  span = span or block_n
  if span > block_n or (span < block_n and span % 16):
    raise ValueError(f"span {span}: columns per program must be a multiple of 16 up to the "
                     f"load width {block_n}")
  return span


_STATIC = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "swiglu", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def grouped_matmul(lhs, rhs, group_sizes, *, block_m: int = 16, block_n: int = 128,
                   block_k: int = 64, num_warps: int = 4, num_stages: int = 2,
                   swiglu: bool = False, interpret=None):
  """lhs [M, K], rhs [E, K, N], group_sizes [E] int (summing to M) -> [M, N] in lhs's dtype,
  accumulated in float32. swiglu: rhs [E, K, 2, N] (gate, up) -> silu(lhs @ gate) * (lhs @ up)
  [M, N], the activation applied to the float32 accumulators. interpret: None = interpret mode
  on a CPU backend."""
  if group_sizes.shape != (rhs.shape[0],):
    raise ValueError(f"grouped_matmul: lhs {lhs.shape}, rhs {rhs.shape}, group_sizes "
                     f"{group_sizes.shape} do not match")
  group, row0, rows = tiles(group_sizes, lhs.shape[0], block_m)
  return _launch(group, rows, lhs, rhs, lhs.shape[0], row0=row0, out0=row0, block_m=block_m,
                 block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                 swiglu=swiglu, interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATIC + ("rows_per_lhs", "span"))
def pair_matmul(lhs, rhs, groups, *, here=None, rows_per_lhs: int = 1, block_m: int = 16,
                block_n: int = 64, block_k: int = 128, num_warps: int = 4, num_stages: int = 2,
                swiglu: bool = False, span: int | None = None, interpret=None):
  """One tile per pair, no sort: lhs [M, K], rhs [E, K, N], groups [P] int -> [P, N], row p =
  lhs[p // rows_per_lhs] @ rhs[groups[p]] (swiglu as grouped_matmul); a pair whose group is E
  (held elsewhere) is not computed and its row is undefined. For steps of few pairs (a decode
  step), where every tile of grouped_matmul holds one row anyway. here [P] int32: given, groups
  are already clamped to [0, E) and here (0 / 1) says which pairs to compute (a kernel that
  wrote both spares XLA's launch that would). span: columns per program (a multiple of 16 up
  to block_n, the load width; None: block_n): `moe_decode.fill_span`."""
  if groups.ndim != 1 or rows_per_lhs < 1 or -(-groups.shape[0] // rows_per_lhs) > lhs.shape[0]:
    raise ValueError(f"pair_matmul: groups {groups.shape} with rows_per_lhs={rows_per_lhs} do "
                     f"not fit lhs {lhs.shape}")
  if here is None:
    here = (groups < rhs.shape[0]).astype(jnp.int32)
    groups = jnp.minimum(groups, rhs.shape[0] - 1)
  return _launch(groups.astype(jnp.int32), here.astype(jnp.int32), lhs, rhs,
                 groups.shape[0], pair_div=rows_per_lhs, block_m=block_m, block_n=block_n,
                 block_k=block_k, num_warps=num_warps, num_stages=num_stages, swiglu=swiglu,
                 interpret=interpret, span=span)


def _combine_kernel(*refs, k, block_h, h_dim):
  pos_refs, w_refs, (y_ref, o_ref) = refs[:k], refs[k:2 * k], refs[2 * k:]
  r, h0 = pl.program_id(0), pl.program_id(1) * block_h
  col_ok = (h0 + jnp.arange(block_h)) < h_dim
  acc = jnp.zeros((1, block_h), jnp.float32)
  for j in range(k):  # rank order, as moe.xla_combine
    p = pos_refs[j][()]
    row = plgpu.load(y_ref.at[pl.ds(jnp.maximum(p, 0), 1), pl.ds(h0, block_h)],
                     mask=col_ok[None, :], other=0).astype(jnp.float32)
    acc = jnp.where(p >= 0, acc + w_refs[j][()] * row, acc)
  plgpu.store(o_ref.at[pl.ds(r, 1), pl.ds(h0, block_h)], acc, mask=col_ok[None, :])


@functools.partial(jax.jit, static_argnames=("block_h", "interpret"))
def combine(y, position, weights, *, block_h: int = 256, interpret=None):
  """`moe.xla_combine` in one launch: y [M, H], position [R, k] (-1: elsewhere), weights [R, k]
  float32 -> [R, H] float32, each row's k pair outputs gathered and summed in rank order."""
  r, k = position.shape
  h_dim = y.shape[1]
  if weights.shape != (r, k):
    raise ValueError(f"combine: position {position.shape} and weights {weights.shape} differ")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  rank = lambda j: pl.BlockSpec((None, None), lambda i, h, j=j: (j, i))
  whole = lambda shape: pl.BlockSpec(shape, lambda i, h: (0,) * len(shape))
  return pl.pallas_call(
      functools.partial(_combine_kernel, k=k, block_h=block_h, h_dim=h_dim),
      grid=(r, pl.cdiv(h_dim, block_h)),
      in_specs=[rank(j) for j in range(k)] * 2 + [whole(y.shape)],
      out_specs=whole((r, h_dim)),
      out_shape=jax.ShapeDtypeStruct((r, h_dim), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="moe_combine",
  )(*[position.T.astype(jnp.int32)] * k, *[weights.T.astype(jnp.float32)] * k, y)
