"""Pallas (Triton GPU) kernel: Qwen3's q/k RMSNorm + RoPE and the v rows, in one launch, from
the q/k/v projections' output or its split-K partials.

`project_qk_norm_rope` has `attention.project_norm_rope`'s contract (`Kernels.project_qkv`),
`qk_norm_rope` that of `attention.norm_rope`. After the q and k/v projections XLA runs five small
kernels per layer (the split-K sum with v's slice, k's norm, k's RoPE, q's norm, q's RoPE:
RoPE's rotate-half concatenate keeps it out of the norm's fusion); this kernel does all of it. It reads
one operand [S, R, N + 2K, D] (q heads, k heads, v heads per token row): S split-K partials of
the projection (float32, summed here in split order) or S = 1, the projection itself. With a
fused weight (`decoder.fuse_qkv`), `project_qk_norm_rope` makes the split explicit (a batched dot
over S slices of the hidden dim), so the GEMM writes that operand; with separate wq and wkv, XLA
sums its GEMM's partials and copies q and kv into it (one kernel). The math and its roundings
to the activation dtype are those of `ops.rms_norm` then `ops.apply_rope`, op by op (bit for
bit in bf16 against `attention.norm_rope` run op by op, on CPU and on the H200; a fused XLA:GPU
program may keep excess precision between ops, so it can differ from the kernel in the last bf16
bit).

Grid (token rows, head blocks). Triton blocks are powers of two, so a q block holds the largest
power of two that divides the head count (all 32 q heads of Qwen3-8B, 8 of Qwen3-14B's 40); the
first programs of a row also do a block of k and v heads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ddtree_jax.models import attention
from ddtree_jax.models.ops import dense, einsum_f32, split_qkv
from ddtree_jax.pallas.tuning import KernelTuning


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
  """q_ref, k_ref, v_ref [S, heads, D]: views of one operand; outputs [heads, D]."""
  half = q_ref.shape[-1] // 2
  dt = qo_ref.dtype
  c = cos_ref[:half].astype(jnp.float32)[None]  # the tables are [f, f]: one half serves both
  s = sin_ref[:half].astype(jnp.float32)[None]
  j = pl.program_id(1)

  def load(x_ref, cols):
    """This block's heads [heads, cols]: the partials summed in split order, in the dtype."""
    x = x_ref[0, :, cols].astype(jnp.float32)
    for i in range(1, x_ref.shape[0]):
      x = x + x_ref[i, :, cols].astype(jnp.float32)
    return x.astype(dt)

  def head_block(x_ref, w_ref, o_ref):
    o1, o2 = _norm_rope(load(x_ref, slice(0, half)), load(x_ref, slice(half, 2 * half)),
                        w_ref[:half], w_ref[half:], c, s, eps, dt)
    o_ref[:, :half] = o1.astype(dt)
    o_ref[:, half:] = o2.astype(dt)

  @pl.when(j < q_blocks)
  def _():
    head_block(q_ref, qn_ref, qo_ref)

  @pl.when(j < kv_blocks)
  def _():
    head_block(k_ref, kn_ref, ko_ref)
    vo_ref[...] = load(v_ref, slice(None))


def _pow2_part(x: int) -> int:
  return x & -x


def supported(d: int, dtypes) -> bool:
  """Triton blocks the two halves of a head: D/2 must be a power of two; one dtype throughout."""
  return d % 2 == 0 and _pow2_part(d // 2) == d // 2 and len(set(dtypes)) == 1


@functools.partial(jax.jit, static_argnames=("n", "eps", "interpret"))
def qkv_norm_rope(parts, q_norm, k_norm, cos, sin, *, n, eps, interpret=None):
  """parts [S, B, T, N + 2K, D]: the q/k/v projection's S split-K partials (float32) or S = 1
  and the projection itself, n = N its q heads; norms [D], cos/sin [B, T, D]
  (`ops.rope_tables`: their two halves are equal, the kernel reads one) -> q [B, T, N, D],
  k, v [B, T, K, D], q and k normed and RoPE'd, in cos's dtype. Without q/k norms, with a D/2
  that is not a power of two or mixed dtypes: the sum and `attention.norm_rope` in XLA.

  interpret: None = interpret mode on a CPU default backend, compiled Triton otherwise."""
  s, b, t, heads, d = parts.shape
  kh, dtype = (heads - n) // 2, cos.dtype
  if q_norm is None or k_norm is None or not supported(d, (q_norm.dtype, k_norm.dtype, dtype)):
    q, kv = split_qkv((jnp.sum(parts, axis=0) if s > 1 else parts[0]).astype(dtype), n)
    return attention.norm_rope(q, kv, q_norm, k_norm, cos, sin, eps=eps)
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  # A k/v block of kb heads starts at a multiple of kb, so kb divides N as well as K.
  r, qb = b * t, _pow2_part(n)
  kb = min(qb, _pow2_part(kh))
  q_blocks, kv_blocks = n // qb, kh // kb
  clamp = lambda j, blocks: jnp.minimum(j, blocks - 1)  # programs past the last block skip it
  view = lambda size, first, blocks: pl.BlockSpec(
      (s, None, size, d), lambda i, j: (0, i, first + clamp(j, blocks), 0))
  out = lambda size, blocks: pl.BlockSpec((None, size, d), lambda i, j: (i, clamp(j, blocks), 0))
  whole = pl.BlockSpec((d,), lambda i, j: (0,))
  rows = pl.BlockSpec((None, d), lambda i, j: (i, 0))
  parts = parts.reshape(s, r, heads, d)
  qo, ko, vo = pl.pallas_call(
      functools.partial(_kernel, eps=eps, q_blocks=q_blocks, kv_blocks=kv_blocks),
      grid=(r, max(q_blocks, kv_blocks)),
      in_specs=[view(qb, 0, q_blocks), view(kb, n // kb, kv_blocks),
                view(kb, (n + kh) // kb, kv_blocks), whole, whole, rows, rows],
      out_specs=[out(qb, q_blocks), out(kb, kv_blocks), out(kb, kv_blocks)],
      out_shape=[jax.ShapeDtypeStruct((r, n, d), dtype),
                 jax.ShapeDtypeStruct((r, kh, d), dtype),
                 jax.ShapeDtypeStruct((r, kh, d), dtype)],
      interpret=interpret,
      name="qk_norm_rope",
  )(parts, parts, parts, q_norm, k_norm, cos.reshape(r, d), sin.reshape(r, d))
  return qo.reshape(b, t, n, d), ko.reshape(b, t, kh, d), vo.reshape(b, t, kh, d)


def qk_norm_rope(q, kv, q_norm, k_norm, cos, sin, *, eps, interpret=None):
  """`attention.norm_rope`'s contract: q [B, T, N, D], kv [B, T, 2, K, D] (two projections) -> q,
  k [B, T, N|K, D] normed and RoPE'd, v [B, T, K, D]. XLA writes q and kv into the kernel's one
  operand (with its GEMM's split-K sums, in one kernel), then `qkv_norm_rope`."""
  b, t, n, d = q.shape
  if len({q.dtype, kv.dtype, cos.dtype}) != 1:
    return attention.norm_rope(q, kv, q_norm, k_norm, cos, sin, eps=eps)
  parts = jnp.concatenate([q, kv.reshape(b, t, -1, d)], axis=2)[None]
  return qkv_norm_rope(parts, q_norm, k_norm, cos, sin, n=n, eps=eps, interpret=interpret)


def project_qk_norm_rope(layer, h, cos, sin, *, eps, splits=None,
                         tuning: KernelTuning = KernelTuning(), interpret=None):
  """`attention.project_norm_rope` (`Kernels.project_qkv`) with the norms and RoPE in the kernel:
  h [B, T, H]. A fused layer (`decoder.fuse_qkv`) with splits (None: the tuning's
  `qkv_split_count` for B x T rows) >= 2 dividing H runs its projection as a batched dot over
  slices of H into float32 partials, which the kernel sums; otherwise `ops.dense` feeds it.
  Where the kernel does not apply (no q/k norms, D/2 not a power of two, h, a fused weight,
  norms and cos of more than one dtype): `attention.project_norm_rope`, unsplit. interpret: as
  `qkv_norm_rope`'s (None: the tuning's)."""
  w = layer.wqkv
  dtypes = {h.dtype, cos.dtype} | ({w.dtype} if w is not None else set())
  if (layer.q_norm is None or layer.k_norm is None or
      not supported(cos.shape[-1], dtypes | {layer.q_norm.dtype, layer.k_norm.dtype})):
    return attention.project_norm_rope(layer, h, cos, sin, eps=eps)
  interpret = tuning.interpret if interpret is None else interpret
  if w is None:
    return qk_norm_rope(dense("bth,hnd->btnd", h, layer.wq),
                        dense("bth,hskd->btskd", h, layer.wkv), layer.q_norm, layer.k_norm,
                        cos, sin, eps=eps, interpret=interpret)
  b, t, hid = h.shape
  n = layer.wo.shape[0]
  s = tuning.qkv_split_count(b * t) if splits is None else splits
  if s >= 2 and hid % s == 0:
    parts = einsum_f32("rsc,scm->srm", h.reshape(b * t, s, hid // s),
                       w.reshape(s, hid // s, w.shape[1] * w.shape[2]))
    parts = parts.reshape((s, b, t) + w.shape[1:])
  else:
    parts = dense("bth,hnd->btnd", h, w)[None]
  return qkv_norm_rope(parts, layer.q_norm, layer.k_norm, cos, sin, n=n, eps=eps,
                       interpret=interpret)
