"""Pallas (Triton GPU) kernel: the o / down projection's split-K sum, the residual add and the
next RMSNorm, in one launch.

At verify row counts XLA splits the o and down GEMMs over K into float32 partials and then runs
two more kernels per site: the partials' sum with the residual add, and the next block's RMSNorm
(it does not fuse a reduction over the splits with one over the hidden dim). `residual_norm`
makes the split explicit (a batched dot over S slices of the contracted dim, float32 out) and
this kernel does the rest, one program per token row: 2 kernels per site instead of 3. The
roundings are those of `ops.residual_norm`'s XLA form: the projection rounded to x's dtype,
the add rounded, then `ops.rms_norm`. Where it pays: `KernelTuning.residual_*`
(docs/findings/fused-glue-kernels.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_jax.models.ops import Int8Weight, einsum_f32, residual_norm as residual_norm_xla
from ddtree_jax.pallas.tuning import KernelTuning


def _kernel(p_ref, x_ref, w_ref, xo_ref, ho_ref, *, eps):
  f32, dt = jnp.float32, xo_ref.dtype
  rnd = lambda v: v.astype(dt).astype(f32)
  # One [S, H] load of every slice summed by a reduce beat S row loads added in order.
  y = jnp.sum(p_ref[:, 0, :], axis=0)
  x = rnd(x_ref[0].astype(f32) + rnd(y))
  r = jax.lax.rsqrt(jnp.mean(x * x) + eps)
  xo_ref[0] = x.astype(dt)
  ho_ref[0] = (w_ref[...].astype(f32) * rnd(x * r)).astype(dt)


def supported(hidden: int, splits: int, dtypes) -> bool:
  """Triton blocks are powers of two: the hidden size and the split count must be."""
  pow2 = lambda n: n > 0 and n & (n - 1) == 0
  return pow2(hidden) and pow2(splits) and len(set(dtypes)) == 1


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "interpret"))
def add_rms_norm(partials, x, weight, *, eps, num_warps: int = 8, interpret=None):
  """partials [S, R, H] float32 (the projection's split-K terms), x [R, H], weight [H] (x's dtype)
  -> (x + sum(partials), its RMSNorm with weight), both [R, H] in x's dtype. Needs `supported`.
  num_warps: per program (one token row).

  interpret: None = interpret mode on a CPU default backend, compiled Triton otherwise."""
  s, r, h = partials.shape
  if not supported(h, s, (x.dtype, weight.dtype)):
    raise ValueError(f"add_rms_norm: hidden {h} and splits {s} must be powers of two and x, "
                     f"weight one dtype (got {x.dtype}, {weight.dtype})")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  row = pl.BlockSpec((1, h), lambda i: (i, 0))
  return pl.pallas_call(
      functools.partial(_kernel, eps=eps),
      grid=(r,),
      in_specs=[pl.BlockSpec((s, 1, h), lambda i: (0, i, 0)), row,
                pl.BlockSpec((h,), lambda i: (0,))],
      out_specs=[row, row],
      out_shape=[jax.ShapeDtypeStruct((r, h), x.dtype)] * 2,
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps),
      name="add_rms_norm",
  )(partials.astype(jnp.float32), x, weight)


def residual_norm(x, spec, a, w, norm, *, eps, splits=None, tuning: KernelTuning = KernelTuning(),
                  interpret=None):
  """`ops.residual_norm` with the projection's split-K made explicit and its sum, the residual
  add and the RMSNorm in one kernel: x [B, T, H], spec "bt<c>,<c>h->bth" contracting a's trailing
  dims <c> with w's leading ones, norm [H]. Int8 weights, mixed dtypes and sizes Triton cannot
  block take `ops.residual_norm`. splits: None = the tuning's `residual_split_count` (0: XLA's
  form); the tuning also gives the warps and, when interpret is None, interpret mode."""
  (xs, ws), out = spec.split("->")[0].split(","), spec.split("->")[1]
  if len(xs) < 3 or xs[2:] != ws[:-1] or out != xs[:2] + ws[-1]:
    raise ValueError(f"residual_norm: spec {spec!r} must be 'bt<c>,<c>h->bth'")
  b, t, h = x.shape
  if a.shape[:2] != (b, t) or tuple(w.shape) != tuple(a.shape[2:]) + (h,):
    raise ValueError(f"residual_norm: a {a.shape} and w {tuple(w.shape)} do not match x {x.shape} "
                     f"under {spec!r}")
  c = math.prod(a.shape[2:])
  s = tuning.residual_split_count(b * t, c) if splits is None else splits
  if (isinstance(w, Int8Weight) or not s or c % s
      or not supported(h, s, (x.dtype, a.dtype, w.dtype, norm.dtype))):
    return residual_norm_xla(x, spec, a, w, norm, eps=eps)
  r = b * t
  partials = einsum_f32("rsc,sch->srh", a.reshape(r, s, c // s), w.reshape(s, c // s, h))
  x, hn = add_rms_norm(partials, x.reshape(r, h), norm, eps=eps,
                       num_warps=tuning.residual_warps,
                       interpret=tuning.interpret if interpret is None else interpret)
  return x.reshape(b, t, h), hn.reshape(b, t, h)
