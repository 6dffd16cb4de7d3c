"""Pallas (Triton GPU) grouped GEMM for mixture-of-experts layers, `lax.ragged_dot`'s contract:
lhs [M, K] whose rows come in consecutive groups (group_sizes [E], summing to M), rhs [E, K, N];
row r of group g gives lhs[r] @ rhs[g].

The rows are cut into tiles of block_m rows that never straddle two groups; one program per
(tile, block of N columns) loops over K and multiplies its rows by its group's weight block. So a
group's weights are read once per tile (once at decode, where a group holds a few rows), and a
group with no rows (an expert no token chose) has no tile: its weights are never read. The tile
list is computed on device from group_sizes, so one compiled program serves every routing:
there are at most min(M, ceil(M / block_m) + E) tiles, and programs past the last one exit.
Rows past sum(group_sizes) are not written. Offsets are 32-bit: rhs must hold < 2^31 elements
(`expert_matmul` falls back to `lax.ragged_dot` above that).
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
  group = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), e - 1).astype(jnp.int32)
  first_tile = tile_end[group] - per_group[group]
  row0 = row_start[group] + (t - first_tile) * block_m
  rows = jnp.clip(row_start[group] + sizes[group] - row0, 0, block_m)
  rows = jnp.where(t < tile_end[-1], rows, 0)
  return group, jnp.where(rows > 0, row0, 0), rows


def _kernel(group_ref, row0_ref, rows_ref, x_ref, w_ref, o_ref, *, block_m, block_n, block_k,
            k_dim, n_dim):
  rows, n0 = rows_ref[()], pl.program_id(1) * block_n  # (program_id outside the when: interpret)

  @pl.when(rows > 0)
  def _():
    g, r0 = group_ref[()], row0_ref[()]
    row_ok = jnp.arange(block_m) < rows
    col_ok = (n0 + jnp.arange(block_n)) < n_dim

    def step(i, acc):
      k0 = i * block_k
      k_ok = (k0 + jnp.arange(block_k)) < k_dim
      x = plgpu.load(x_ref.at[pl.ds(r0, block_m), pl.ds(k0, block_k)],
                     mask=row_ok[:, None] & k_ok[None, :], other=0)
      w = plgpu.load(w_ref.at[g, pl.ds(k0, block_k), pl.ds(n0, block_n)],
                     mask=k_ok[:, None] & col_ok[None, :], other=0)
      return acc + lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, pl.cdiv(k_dim, block_k), step,
                        jnp.zeros((block_m, block_n), jnp.float32))
    plgpu.store(o_ref.at[pl.ds(r0, block_m), pl.ds(n0, block_n)], acc.astype(o_ref.dtype),
                mask=row_ok[:, None] & col_ok[None, :])


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def grouped_matmul(lhs, rhs, group_sizes, *, block_m: int = 16, block_n: int = 128,
                   block_k: int = 64, num_warps: int = 4, num_stages: int = 2, interpret=None):
  """lhs [M, K], rhs [E, K, N], group_sizes [E] int (summing to M) -> [M, N] in lhs's dtype,
  accumulated in float32. interpret: None = interpret mode on a CPU backend."""
  m, k_dim = lhs.shape
  e, k2, n_dim = rhs.shape
  if k2 != k_dim or group_sizes.shape != (e,):
    raise ValueError(f"grouped_matmul: lhs {lhs.shape}, rhs {rhs.shape}, group_sizes "
                     f"{group_sizes.shape} do not match")
  if lhs.dtype != rhs.dtype:
    raise ValueError(f"grouped_matmul: lhs is {lhs.dtype}, rhs {rhs.dtype}")
  if rhs.size >= 1 << 31 or lhs.size >= 1 << 31:
    raise ValueError(f"grouped_matmul: lhs {lhs.shape} / rhs {rhs.shape} too large for 32-bit "
                     "offsets (use lax.ragged_dot)")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  group, row0, rows = tiles(group_sizes, m, block_m)
  scalar = pl.BlockSpec((None,), lambda t, n: (t,))
  whole = lambda shape: pl.BlockSpec(shape, lambda t, n: (0,) * len(shape))
  return pl.pallas_call(
      functools.partial(_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                        k_dim=k_dim, n_dim=n_dim),
      grid=(group.shape[0], pl.cdiv(n_dim, block_n)),
      in_specs=[scalar, scalar, scalar, whole((m, k_dim)), whole((e, k_dim, n_dim))],
      out_specs=whole((m, n_dim)),
      out_shape=jax.ShapeDtypeStruct((m, n_dim), lhs.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="grouped_matmul",
  )(group, row0, rows, lhs, rhs)


def expert_matmul(lhs, rhs, group_sizes, *, tuning):
  """`grouped_matmul` with the launch `tuning.moe_blocks` picks for lhs's rows
  (`kernels.KernelTuning`), or `lax.ragged_dot` where it picks none or where rhs is too large
  for the kernel's 32-bit offsets."""
  blocks = tuning.moe_blocks(lhs.shape[0])
  if blocks is None or rhs.size >= 1 << 31:
    return lax.ragged_dot(lhs, rhs, group_sizes)
  bm, bn, bk = blocks
  return grouped_matmul(lhs, rhs, group_sizes, block_m=bm, block_n=bn, block_k=bk,
                        interpret=tuning.interpret)
