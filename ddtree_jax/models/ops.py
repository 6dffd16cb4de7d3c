"""Operations every layer kind and kernel shares: GEMMs over [in, out] weights (float, or int8
W8A8), float32-accumulating einsums, RMSNorm, RoPE, the residual add + norm, the embedding
lookup, and random weights. A leaf: it imports nothing from the package.

Shapes: B batch, T new tokens, H hidden, N query heads, D head_dim, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

Array = jax.Array


def _f32_operands(a, b):
  """XLA:CPU lacks bf16 x bf16 -> f32 dots, so there the inputs are upcast; on GPU the
  low-precision operands go straight to the matmul."""
  if a.dtype != jnp.float32 and jax.default_backend() == "cpu":
    return a.astype(jnp.float32), b.astype(jnp.float32)
  return a, b


def einsum_f32(spec, a, b):
  """einsum accumulating and returning float32 (operands as `_f32_operands`)."""
  return jnp.einsum(spec, *_f32_operands(a, b), preferred_element_type=jnp.float32)


# XLA:GPU rewrites a dot whose rows are one vector, against a weight matrix of under 10M
# elements (per device, after partitioning), into a multiply that writes every product and then
# a reduce (its algebraic simplifier's dot strength reduction; jax 0.11.2 has no flag to turn it
# off): the weight's bytes three times and two launches per projection. With the row given twice
# the dot stays one GEMM (docs/findings/latent-attention-and-deepseekmoe.md).
STRENGTH_REDUCED_DOT_ELEMENTS = 10_000_000


def tp_shards(a) -> int:
  """The size of the `tp` axis of the mesh array a lives on (1 off a mesh): what a weight's
  matrix is split into under the sharding rules."""
  mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
  return dict(getattr(mesh, "shape", {}) or {}).get("tp", 1)


def einsum_weight(spec, x, w, f32: bool = False, precision=None):
  """einsum(spec, x, w, precision=precision) for activations x and a weight w (float32
  accumulation and output with f32, as einsum_f32). When x's own output dims (its rows: the dims
  w lacks) hold one row and each of w's matrices, split over the mesh's tp axis, has fewer than
  STRENGTH_REDUCED_DOT_ELEMENTS elements, x is broadcast to two rows and the first is kept."""
  if f32:
    x, w = _f32_operands(x, w)
  einsum = lambda x: jnp.einsum(spec, x, w, precision=precision,
                                preferred_element_type=jnp.float32 if f32 else None)
  if "..." in spec:
    return einsum(x)
  (xs, ws), out = spec.split("->")[0].split(","), spec.split("->")[1]
  rows = [c for c in xs if c in out and c not in ws]
  batch = [c for c in ws if c in xs and c in out]
  matrix = w.size // max(1, int(np.prod([w.shape[ws.index(c)] for c in batch]))) // tp_shards(w)
  if (not rows or any(x.shape[xs.index(c)] != 1 for c in rows)
      or matrix >= STRENGTH_REDUCED_DOT_ELEMENTS):
    return einsum(x)
  axis = xs.index(rows[0])
  y = einsum(jnp.broadcast_to(x, x.shape[:axis] + (2,) + x.shape[axis + 1:]))
  return jax.lax.slice_in_dim(y, 0, 1, axis=out.index(rows[0]))


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "std"))
def random_weight(key, shape, dtype, std):
  """std * N(0, 1) of `shape` in `dtype` (random benchmark and test weights), drawn in float32 in
  one fused program: no float32 copy of a large weight (an expert stack) is ever materialised."""
  return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8Weight:
  """An int8 matrix (drafters only): w ~= q * scale, used as W8A8 by `dense`.

  The float weight is [in..., out...]; q holds it K-major, [out..., in...] (the layout int8
  tensor-core GEMMs read without a transpose); scale [out...] has one float32 per output channel,
  so it multiplies the matmul's output, not the weight."""
  q: Array                 # int8 [out..., in...]
  scale: Array             # float32 [out...]

  @property
  def shape(self):
    """The float weight's shape [in..., out...]."""
    k = self.scale.ndim
    return self.q.shape[k:] + self.q.shape[:k]


def quantize_int8(w, num_in: int = 1) -> Int8Weight:
  """Symmetric per-output-channel int8 of w [in... (num_in dims), out...] (round to nearest)."""
  wf = jnp.asarray(w, jnp.float32)
  amax = jnp.max(jnp.abs(wf), axis=tuple(range(num_in)))
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  q = jnp.clip(jnp.round(wf / scale), -127, 127).astype(jnp.int8)
  return Int8Weight(q=jnp.moveaxis(q, tuple(range(num_in)), tuple(range(-num_in, 0))), scale=scale)


def dense(spec, x, w, out_dtype=None):
  """einsum(spec, x, w) in x's dtype (or out_dtype); spec's output is x's kept dims, then w's.

  For an Int8Weight, W8A8: each row of x (its contracted dims) is quantized to int8 with its own
  scale max|row| / 127, the GEMM is int8 x int8 -> int32, and both scales multiply the output
  (int8 weights with bf16 activations were no faster:
  docs/findings/gemms-and-the-int8-drafter.md)."""
  if not isinstance(w, Int8Weight):
    if out_dtype is None:
      return einsum_weight(spec, x, w)
    return einsum_weight(spec, x, w, f32=True).astype(out_dtype)
  (xs, ws), out = spec.split("->")[0].split(","), spec.split("->")[1]
  kept = "".join(c for c in xs if c in out)
  if out != kept + "".join(c for c in ws if c in out):
    raise ValueError(f"dense: output of {spec!r} must be x's kept dims, then w's")
  if w.scale.ndim != len(out) - len(kept):
    raise ValueError(f"dense: {spec!r} has {len(out) - len(kept)} output dims of w, its int8 "
                     f"scale {w.scale.ndim} (quantize_int8's num_in does not match)")
  contracted = tuple(i for i, c in enumerate(xs) if c not in out)
  xf = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(xf), axis=contracted, keepdims=True)
  sx = jnp.where(amax > 0, amax / 127.0, 1.0)
  xq = jnp.round(xf / sx).astype(jnp.int8)
  qs = "".join(c for c in ws if c in out) + "".join(c for c in ws if c not in out)  # K-major q
  y = jnp.einsum(f"{xs},{qs}->{out}", xq, w.q, preferred_element_type=jnp.int32)
  y = y.astype(jnp.float32)
  sx = jnp.squeeze(sx, axis=contracted)                     # x's kept dims, as out starts
  y = y * sx.reshape(sx.shape + (1,) * (y.ndim - sx.ndim)) * w.scale
  return y.astype(out_dtype or x.dtype)


def split_qkv(y, n: int):
  """The fused projection's output [..., N + 2K, D] -> q [..., N, D], kv [..., 2, K, D]."""
  return y[..., :n, :], y[..., n:, :].reshape(y.shape[:-2] + (2, -1, y.shape[-1]))


def rms_norm(x, weight, eps):
  """Qwen3/Llama RMSNorm: normalise in float32, cast back, then scale."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return weight * xf.astype(x.dtype)


def rope_tables(cfg, positions, dtype):
  """cos/sin [B, T, D] for absolute positions [B, T] (rotate-half layout, as HF); cfg a
  `ModelConfig` (its inv_freq and rope_attention_factor)."""
  inv = jnp.asarray(cfg.inv_freq(), jnp.float32)
  freqs = positions.astype(jnp.float32)[..., None] * inv
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  f = cfg.rope_attention_factor  # YaRN's (1 otherwise)
  return (f * jnp.cos(emb)).astype(dtype), (f * jnp.sin(emb)).astype(dtype)


def apply_rope(x, cos, sin):
  """x [B, T, heads, D] rotated by cos/sin [B, T, R]: its first R <= D dims (partial rotary:
  the others pass as they are)."""
  r = cos.shape[-1]
  if r < x.shape[-1]:
    return jnp.concatenate([apply_rope(x[..., :r], cos, sin), x[..., r:]], axis=-1)
  half = x.shape[-1] // 2
  rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos[:, :, None] + rot * sin[:, :, None]


def residual_norm(x, spec, a, w, norm, *, eps):
  """The residual add after the o / down projection, then the next RMSNorm: x [B, T, H] +
  dense(spec, a, w) -> (x', rms_norm(x', norm)) (`Kernels.residual_norm`'s contract)."""
  x = x + dense(spec, a, w)
  return x, rms_norm(x, norm, eps)


def merge_heads(o, wo):
  """The o projection's (spec, a, w) for residual_norm: o [B, T, N, D] and wo [N, D, H] as one
  contracted dim [B, T, N*D] x [N*D, H], a plain GEMM (at one row `dense` keeps it one:
  `attention.einsum_weight`); an Int8Weight keeps its layout."""
  if isinstance(wo, Int8Weight):
    return "btnd,ndh->bth", o, wo
  return "btc,ch->bth", o.reshape(*o.shape[:2], -1), wo.reshape(-1, wo.shape[-1])


def embed_lookup(table, tokens):
  """Rows of the embedding table [V, H] for token ids [...] -> [..., H] (`Kernels.embed`)."""
  return table[tokens]


def weight_spec(w, *spec):
  """The PartitionSpec of a weight [in..., out...] split as `spec`; for an Int8Weight an
  Int8Weight of specs: q [out..., in...] and scale [out...] take the same axes."""
  if isinstance(w, Int8Weight):
    n_in = len(spec) - w.scale.ndim
    return Int8Weight(q=P(*spec[n_in:], *spec[:n_in]), scale=P(*spec[n_in:]))
  return P(*spec)
