"""Pallas (Triton GPU) attention over a latent cache (multi-head latent attention with the
projections absorbed), `mla.attend_latent`'s contract and its reference.

Every head of a sequence reads the same latent rows (C latent + R RoPE values per token), so the
query rows of all tokens and heads, [T x N, C + R], form one multi-query block: a program takes
block_q of them and streams its split's slice of the sequence's valid prefix in block_k rows,
scores = q_c . c + q_r . k_R, values = the rows' first C values, an online softmax in float32;
split 0 also takes the T new rows under the tree mask (expanded to query rows outside). The
splits' partial outputs and softmax statistics are merged in XLA. The splits cut each sequence's
valid prefix (not the capacity) into equal ranges rounded up to block_k rows (the last splits
of a short prefix may be empty); the layer's slice of a stacked cache is read in place. C and R
must be powers of two (Triton's block shapes; `Kernels.attend_latent` uses XLA's form
otherwise).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_jax.models.attention import NEG_INF


def pow2(n: int) -> int:
  """The least power of two >= n."""
  return 1 << max(0, (n - 1).bit_length())


# shared memory a program may ask (227 KB on an H100 / H200, less Triton's own)
SMEM_BYTES = 200 * 1024


def fit_block_k(block_k: int, width: int, stages: int, itemsize: int = 2) -> int:
  """block_k halved (down to 16) until `stages` buffered key blocks of `width` values fit
  SMEM_BYTES."""
  while block_k > 16 and stages * block_k * width * itemsize > SMEM_BYTES:
    block_k //= 2
  return block_k


def _kernel(len_ref, q_ref, cache_ref, new_ref, mask_ref, acc_ref, m_ref, l_ref, *, block_q,
            block_k, block_t, c_dim, r_dim, rows, t_len, num_splits, scale, layer):
  b, qb, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  r0 = qb * block_q
  row_ok = (r0 + jnp.arange(block_q)) < rows
  lb = b if layer is None else layer * len_ref.shape[0] + b  # row of the [L*B, S, C+R] cache
  q_at = lambda lo, n: plgpu.load(q_ref.at[b, pl.ds(r0, block_q), pl.ds(lo, n)],
                                  mask=row_ok[:, None], other=0)
  qc, qr = q_at(0, c_dim), q_at(c_dim, r_dim)
  dot = lambda a, w: lax.dot_general(a, w, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)
  pv = lambda p, v: lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32)

  def update(carry, kc, kr, visible):
    acc, m, l = carry
    s = jnp.where(visible, (dot(qc, kc) + dot(qr, kr)) * scale, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp(s - m_new[:, None])
    alpha = jnp.exp(m - m_new)
    return acc * alpha[:, None] + pv(p, kc), m_new, l * alpha + jnp.sum(p, axis=1)

  prefix = len_ref[b]
  chunk = pl.cdiv(pl.cdiv(prefix, num_splits), block_k) * block_k  # this split's key range
  lo, hi = split * chunk, jnp.minimum((split + 1) * chunk, prefix)

  def prefix_step(i, carry):
    k0 = lo + i * block_k
    ok = (k0 + jnp.arange(block_k)) < hi
    at = lambda c0, n: plgpu.load(cache_ref.at[lb, pl.ds(k0, block_k), pl.ds(c0, n)],
                                  mask=ok[:, None], other=0)
    return update(carry, at(0, c_dim), at(c_dim, r_dim), ok[None, :])

  carry = (jnp.zeros((block_q, c_dim), jnp.float32), jnp.full((block_q,), NEG_INF, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  carry = lax.fori_loop(0, pl.cdiv(jnp.maximum(hi - lo, 0), block_k), prefix_step, carry)

  def with_new(carry):
    t_ok = jnp.arange(block_t) < t_len
    at = lambda c0, n: plgpu.load(new_ref.at[b, pl.ds(0, block_t), pl.ds(c0, n)],
                                  mask=t_ok[:, None], other=0)
    vis = plgpu.load(mask_ref.at[b, pl.ds(r0, block_q), pl.ds(0, block_t)],
                     mask=row_ok[:, None] & t_ok[None, :], other=False)
    return update(carry, at(0, c_dim), at(c_dim, r_dim), vis)

  first = split == 0  # (a select, not a branch: every split computes the new block)
  acc, m, l = (jnp.where(first, x, y) for x, y in zip(with_new(carry), carry))
  plgpu.store(acc_ref.at[b, split, pl.ds(r0, block_q), pl.ds(0, c_dim)], acc,
              mask=row_ok[:, None])
  plgpu.store(m_ref.at[b, split, pl.ds(r0, block_q)], m, mask=row_ok)
  plgpu.store(l_ref.at[b, split, pl.ds(r0, block_q)], l, mask=row_ok)


@functools.partial(jax.jit, static_argnames=("scale", "value_dim", "layer", "block_q", "block_k",
                                             "num_splits", "num_warps", "num_stages",
                                             "interpret"))
def latent_attention(q, cache, prefix_len, new, new_mask, *, scale, value_dim, layer=None,
                     block_q: int = 16, block_k: int = 64, num_splits: int = 1,
                     num_warps: int = 4, num_stages: int = 2, interpret=None):
  """q [B, T, N, C + R], cache [B, 1, S, C + R] (or [L, B, 1, S, C + R] with `layer`),
  prefix_len [B], new [B, T, 1, C + R], new_mask [B, T, T] -> [B, T, N, C] in q's dtype, C =
  value_dim. num_splits: each valid prefix cut into this many key ranges, one program each;
  block_k cut to fit shared memory (fit_block_k)."""
  b, t, n, width = q.shape
  c_dim, r_dim = value_dim, width - value_dim
  if c_dim != pow2(c_dim) or r_dim != pow2(r_dim):
    raise ValueError(f"latent_attention: latent {c_dim} and RoPE {r_dim} widths must be powers "
                     "of two (use mla.attend_latent)")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  s_cap = cache.shape[-2]
  rows = t * n
  block_q = max(16, min(block_q, pow2(rows)))  # (masked rows past `rows`: no dot under 16)
  block_k = fit_block_k(block_k, width, num_stages, cache.dtype.itemsize)
  mask_rows = jnp.repeat(new_mask, n, axis=1)                     # [B, T*N, T]: row = (t, head)
  whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
  grid = (b, pl.cdiv(rows, block_q), num_splits)
  # (leading dims merged, the single latent "head" dropped: reshapes of contiguous arrays)
  args = (prefix_len.astype(jnp.int32), q.reshape(b, rows, width),
          cache.reshape(-1, s_cap, width), new.reshape(b, t, width), mask_rows)
  acc, m, l = pl.pallas_call(
      # (the new rows' block at least 16 rows, masked: with one new row the kernel asked 288 KB
      # of shared memory at 64 heads and did not launch; a one-row dot is no tensor-core MMA)
      functools.partial(_kernel, block_q=block_q, block_k=block_k, block_t=max(16, pow2(t)),
                        c_dim=c_dim, r_dim=r_dim, rows=rows, t_len=t, num_splits=num_splits,
                        scale=scale, layer=layer),
      grid=grid, in_specs=[whole(a) for a in args],
      out_specs=[pl.BlockSpec((b, num_splits, rows) + tail, lambda *_, k=3 + len(tail): (0,) * k)
                 for tail in ((c_dim,), (), ())],
      out_shape=[jax.ShapeDtypeStruct((b, num_splits, rows) + tail, jnp.float32)
                 for tail in ((c_dim,), (), ())],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="latent_attention",
  )(*args)
  best = jnp.max(m, axis=1, keepdims=True)                        # merge the splits
  w = jnp.exp(m - best)
  out = jnp.sum(acc * w[..., None], axis=1) / jnp.sum(l * w, axis=1)[..., None]
  return out.reshape(b, t, n, c_dim).astype(q.dtype)
