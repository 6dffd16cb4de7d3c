"""Pallas (Triton GPU) kernel: Qwen3's q/k RMSNorm + RoPE and the v rows, in one launch.

Same contract as `model.norm_rope`. After the q and k/v projections XLA runs five small kernels
per layer (the split-K sum with v's slice, k's norm, k's RoPE, q's norm, q's RoPE: RoPE's
rotate-half concatenate keeps it out of the norm's fusion); with this kernel XLA sums the split-K
partials (two kernels) and the rest is one program per token row. The math and its roundings to
the activation dtype are those of `model.rms_norm` then `model.apply_rope`.
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


def _kernel(q_ref, kv_ref, qn_ref, kn_ref, cos_ref, sin_ref, qo_ref, ko_ref, vo_ref, *, eps):
  half = q_ref.shape[-1] // 2
  dt = qo_ref.dtype
  c = cos_ref[0, :half].astype(jnp.float32)[None]  # the tables are [f, f]: one half serves both
  s = sin_ref[0, :half].astype(jnp.float32)[None]
  for x1, x2, w_ref, o_ref in ((q_ref[0, :, :half], q_ref[0, :, half:], qn_ref, qo_ref),
                               (kv_ref[0, 0, :, :half], kv_ref[0, 0, :, half:], kn_ref, ko_ref)):
    o1, o2 = _norm_rope(x1, x2, w_ref[:half], w_ref[half:], c, s, eps, dt)
    o_ref[0, :, :half] = o1.astype(dt)
    o_ref[0, :, half:] = o2.astype(dt)
  vo_ref[0] = kv_ref[0, 1]


def _pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def qk_norm_rope(q, kv, q_norm, k_norm, cos, sin, *, eps, interpret=None):
  """q [B, T, N, D], kv [B, T, 2, K, D], norms [D], cos/sin [B, T, D] -> q, k [B, T, N|K, D]
  normed and RoPE'd, v [B, T, K, D]. Models without q/k norms, or with head counts or D/2 that
  are not powers of two (Triton's block shapes), take `model.norm_rope` (XLA).

  interpret: None = interpret mode on a CPU default backend, compiled Triton otherwise."""
  b, t, n, d = q.shape
  kh = kv.shape[3]
  if q_norm is None or k_norm is None or not all(map(_pow2, (n, kh, d // 2))) or d % 2:
    return model.norm_rope(q, kv, q_norm, k_norm, cos, sin, eps=eps)
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  r = b * t
  row = lambda *shape: pl.BlockSpec((1, *shape), lambda i: (i,) + (0,) * len(shape))
  whole = pl.BlockSpec((d,), lambda i: (0,))
  qo, ko, vo = pl.pallas_call(
      functools.partial(_kernel, eps=eps),
      grid=(r,),
      in_specs=[row(n, d), row(2, kh, d), whole, whole, row(d), row(d)],
      out_specs=[row(n, d), row(kh, d), row(kh, d)],
      out_shape=[jax.ShapeDtypeStruct((r, n, d), q.dtype),
                 jax.ShapeDtypeStruct((r, kh, d), q.dtype),
                 jax.ShapeDtypeStruct((r, kh, d), q.dtype)],
      interpret=interpret,
      name="qk_norm_rope",
  )(q.reshape(r, n, d), kv.reshape(r, 2, kh, d), q_norm, k_norm, cos.reshape(r, d),
    sin.reshape(r, d))
  return qo.reshape(b, t, n, d), ko.reshape(b, t, kh, d), vo.reshape(b, t, kh, d)
