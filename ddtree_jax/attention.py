"""Attention of new tokens over a cached prefix plus a masked block of themselves.

One signature serves every attention in the engine:

  * prefill:      new = the prompt, ``new_mask`` causal (and padding), prefix empty;
  * AR decode:    new = one token, ``new_mask`` = [[True]];
  * chain/tree:   new = the budget+1 tree nodes, ``new_mask`` = ancestor-or-self visibility;
  * drafter:      prefix = fused context rows, new = the block, ``new_mask`` all True.

Every query sees prefix rows ``[0, prefix_len[b])`` of its own sequence plus the new rows its mask
allows. The Pallas kernel (``ddtree_jax.pallas.tree_attention``) implements the same contract.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1e30  # finite, so fully masked rows never produce NaN


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
# the dot stays one GEMM (WORKSPACE.md, Findings: Latent attention and DeepSeekMoE).
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


def cache_layer(k_cache, v_cache, layer):
  """[B, Hkv, S, D] caches of one layer: as given (layer None) or layer `layer` of [L, B, ...]."""
  if layer is None:
    return k_cache, v_cache
  if k_cache.ndim != 5:
    raise ValueError(f"layer={layer} needs [L, B, Hkv, S, D] caches, got {k_cache.shape}")
  return k_cache[layer], v_cache[layer]


def attend_xla(q, k_cache, v_cache, prefix_len, k_new, v_new, new_mask, *, scale, layer=None):
  """Plain-XLA masked attention, the reference for the Pallas kernel.

  Args:
    q: [B, T, Hq, D] queries (RoPE applied).
    k_cache, v_cache: [B, Hkv, S, D] cached prefix keys/values (S = static capacity), or every
      layer's [L, B, Hkv, S, D] with `layer` (static int) the one to read.
    prefix_len: [B] int32, number of valid prefix rows per sequence.
    k_new, v_new: [B, T, Hkv, D] keys/values of the new tokens.
    new_mask: [B, T, T] bool, new_mask[b, i, j]: query i may see new key j.
    scale: softmax scale (head_dim ** -0.5).
  Returns:
    [B, T, Hq, D] in q's dtype. Softmax statistics are float32.
  """
  k_cache, v_cache = cache_layer(k_cache, v_cache, layer)
  b, t, hq, d = q.shape
  hkv, s = k_cache.shape[1], k_cache.shape[2]
  g = hq // hkv
  qg = q.reshape(b, t, hkv, g, d)
  s_pre = einsum_f32("btkgd,bksd->bkgts", qg, k_cache)
  s_new = einsum_f32("btkgd,bskd->bkgts", qg, k_new)
  pre_ok = jnp.arange(s)[None, :] < prefix_len[:, None]  # [B, S]
  s_pre = jnp.where(pre_ok[:, None, None, None, :], s_pre * scale, NEG_INF)
  s_new = jnp.where(new_mask[:, None, None, :, :], s_new * scale, NEG_INF)
  scores = jnp.concatenate([s_pre, s_new], axis=-1)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  out = (einsum_f32("bkgts,bksd->btkgd", probs[..., :s], v_cache)
         + einsum_f32("bkgts,bskd->btkgd", probs[..., s:], v_new))
  return out.reshape(b, t, hq, d).astype(q.dtype)
