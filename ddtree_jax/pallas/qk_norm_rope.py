"""Pallas (Triton GPU) kernel: Qwen3's q/k RMSNorm + RoPE and the v rows, in one launch.

Same contract as `model.norm_rope`. After the q and k/v projections XLA runs five small kernels
per layer (the split-K sum with v's slice, k's norm, k's RoPE, q's norm, q's RoPE: RoPE's
rotate-half concatenate keeps it out of the norm's fusion); with this kernel XLA sums the split-K
partials into one [N + 2K] head array (one kernel) and the rest is one launch. The math and its
roundings to the activation dtype are those of `model.rms_norm` then `model.apply_rope`, op by op
(bit for bit in bf16 against `model.norm_rope` run op by op, on CPU and on the H200; a fused
XLA:GPU program may keep excess precision between ops, so it can differ from the kernel in the
last bf16 bit).

Grid (token rows, head blocks). Triton blocks are powers of two, so a q block holds the largest
power of two that divides the head count (all 32 q heads of Qwen3-8B, 8 of Qwen3-14B's 40); the
first programs of a row also do a block of k and v heads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ddtree_jax import model


def _norm_rope(x1, x2, w1, w2, c, s, eps, dt):
  """The halves x1, x2 [heads, D/2] of every head: w * x / rms(x), then rotate-half RoPE."""
  f32 = jnp.float32
  rnd = lambda v: v.astype(dt).astype(f32)  # every op of the XLA path rounds to the dtype
  x1, x2 = x1.astype(f32), x2.astype(f32)
  ms = (jnp.sum(x1 * x1, axis=-1) + jnp.sum(x2 * x2, axis=-1)) / (2 * x1.shape[-1])
  r = jax.lax.rsqrt(ms + eps)[:, None]
  y1 = rnd(w1.astype(f32)[None] * rnd(x1 * r))
  y2 = rnd(w2.astype(f32)[None] * rnd(x2 * r))
  return rnd(y1 * c) - rnd(y2 * s), rnd(y2 * c) + rnd(y1 * s)


def _kernel(q_ref, k_ref, v_ref, qn_ref, kn_ref, cos_ref, sin_ref, qo_ref, ko_ref, vo_ref, *, eps,
            q_blocks, kv_blocks):
  half = q_ref.shape[-1] // 2
  dt = qo_ref.dtype
  c = cos_ref[0, :half].astype(jnp.float32)[None]  # the tables are [f, f]: one half serves both
  s = sin_ref[0, :half].astype(jnp.float32)[None]
  j = pl.program_id(1)

  def head_block(x_ref, w_ref, o_ref):
    o1, o2 = _norm_rope(x_ref[0, :, :half], x_ref[0, :, half:], w_ref[:half], w_ref[half:], c, s,
                        eps, dt)
    o_ref[0, :, :half] = o1.astype(dt)
    o_ref[0, :, half:] = o2.astype(dt)

  @pl.when(j < q_blocks)
  def _():
    head_block(q_ref, qn_ref, qo_ref)

  @pl.when(j < kv_blocks)
  def _():
    head_block(k_ref, kn_ref, ko_ref)
    vo_ref[0] = v_ref[0]


def _pow2_part(x: int) -> int:
  return x & -x


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def qk_norm_rope(q, kv, q_norm, k_norm, cos, sin, *, eps, interpret=None):
  """q [B, T, N, D], kv [B, T, 2, K, D], norms [D], cos/sin [B, T, D] (`model.rope_tables`: their
  two halves are equal, the kernel reads one), all of one dtype -> q, k
  [B, T, N|K, D] normed and RoPE'd, v [B, T, K, D]. `model.norm_rope` (XLA) takes the rest:
  models without q/k norms, a D/2 that is not a power of two and mixed dtypes.

  interpret: None = interpret mode on a CPU default backend, compiled Triton otherwise."""
  b, t, n, d = q.shape
  kh = kv.shape[3]
  one_dtype = q_norm is not None and k_norm is not None and len(
      {x.dtype for x in (q, kv, q_norm, k_norm, cos, sin)}) == 1
  if not one_dtype or d % 2 or _pow2_part(d // 2) != d // 2:
    return model.norm_rope(q, kv, q_norm, k_norm, cos, sin, eps=eps)
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  # q, k and v are three views of one [R, N + 2K, D] operand: XLA sums the split-K partials of
  # the q and k/v projections (one GEMM after its dot merger) in one kernel, not two. A k/v block
  # of kb heads starts at a multiple of kb, so kb divides N as well as K.
  r, qb = b * t, _pow2_part(n)
  kb = min(qb, _pow2_part(kh))
  q_blocks, kv_blocks = n // qb, kh // kb
  qkv = jnp.concatenate([q.reshape(r, n, d), kv.reshape(r, 2 * kh, d)], axis=1)
  clamp = lambda j, blocks: jnp.minimum(j, blocks - 1)  # programs past the last block skip it
  q_spec = pl.BlockSpec((1, qb, d), lambda i, j: (i, clamp(j, q_blocks), 0))
  kv_view = lambda first: pl.BlockSpec((1, kb, d), lambda i, j: (i, first + clamp(j, kv_blocks), 0))
  whole = pl.BlockSpec((d,), lambda i, j: (0,))
  rows = pl.BlockSpec((1, d), lambda i, j: (i, 0))
  qo, ko, vo = pl.pallas_call(
      functools.partial(_kernel, eps=eps, q_blocks=q_blocks, kv_blocks=kv_blocks),
      grid=(r, max(q_blocks, kv_blocks)),
      in_specs=[q_spec, kv_view(n // kb), kv_view((n + kh) // kb), whole, whole, rows, rows],
      out_specs=[q_spec, kv_view(0), kv_view(0)],
      out_shape=[jax.ShapeDtypeStruct((r, n, d), q.dtype),
                 jax.ShapeDtypeStruct((r, kh, d), q.dtype),
                 jax.ShapeDtypeStruct((r, kh, d), q.dtype)],
      interpret=interpret,
      name="qk_norm_rope",
  )(qkv, qkv, qkv, q_norm, k_norm, cos.reshape(r, d), sin.reshape(r, d))
  return qo.reshape(b, t, n, d), ko.reshape(b, t, kh, d), vo.reshape(b, t, kh, d)
