"""Grouped-query attention (Qwen3, Llama-3, gpt-oss, the drafter): q/k/v projections with their
norms (or biases) and RoPE, and attention of new tokens over a cached prefix plus a masked block
of themselves (optionally a per-query sliding window and attention sinks).

One signature serves every attention in the engine:

  * prefill:      new = the prompt, ``new_mask`` causal (and padding), prefix empty;
  * AR decode:    new = one token, ``new_mask`` = [[True]];
  * chain/tree:   new = the budget+1 tree nodes, ``new_mask`` = ancestor-or-self visibility;
  * drafter:      prefix = fused context rows, new = the block, ``new_mask`` all True.

Every query sees prefix rows ``[0, prefix_len[b])`` of its own sequence plus the new rows its mask
allows. The Pallas kernel (``ddtree_jax.pallas.tree_attention``) implements the same contract.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax.models.ops import apply_rope, dense, einsum_f32, merge_heads, rms_norm, split_qkv

NEG_INF = -1e30  # finite, so fully masked rows never produce NaN


def cache_layer(k_cache, v_cache, layer):
  """[B, Hkv, S, D] caches of one layer: as given (layer None) or layer `layer` of [L, B, ...]."""
  if layer is None:
    return k_cache, v_cache
  if k_cache.ndim != 5:
    raise ValueError(f"layer={layer} needs [L, B, Hkv, S, D] caches, got {k_cache.shape}")
  return k_cache[layer], v_cache[layer]


def attend_xla(q, k_cache, v_cache, prefix_len, k_new, v_new, new_mask, *, scale, layer=None,
               prefix_from=None, sinks=None):
  """Plain-XLA masked attention, the reference for the Pallas kernel.

  Args:
    q: [B, T, Hq, D] queries (RoPE applied).
    k_cache, v_cache: [B, Hkv, S, D] cached prefix keys/values (S = static capacity), or every
      layer's [L, B, Hkv, S, D] with `layer` (static int) the one to read.
    prefix_len: [B] int32, number of valid prefix rows per sequence.
    k_new, v_new: [B, T, Hkv, D] keys/values of the new tokens.
    new_mask: [B, T, T] bool, new_mask[b, i, j]: query i may see new key j.
    scale: softmax scale (head_dim ** -0.5).
    prefix_from: [B, T] int32 or None: query t sees prefix rows from prefix_from[b, t] on only
      (a sliding window).
    sinks: [Hq] or None: per query head a logit that joins every query's softmax denominator
      and contributes no value (gpt-oss's attention sinks; not scaled).
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
  pre_ok = (jnp.arange(s)[None, :] < prefix_len[:, None])[:, None]  # [B, 1 or T, S]
  if prefix_from is not None:
    pre_ok = pre_ok & (jnp.arange(s)[None, None, :] >= prefix_from[:, :, None])
  s_pre = jnp.where(pre_ok[:, None, None], s_pre * scale, NEG_INF)
  s_new = jnp.where(new_mask[:, None, None, :, :], s_new * scale, NEG_INF)
  parts = [s_pre, s_new]
  if sinks is not None:
    parts.append(jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, hkv, g, 1, 1),
                                  (b, hkv, g, t, 1)))
  scores = jnp.concatenate(parts, axis=-1)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  out = (einsum_f32("bkgts,bksd->btkgd", probs[..., :s], v_cache)
         + einsum_f32("bkgts,bskd->btkgd", probs[..., s:s + t], v_new))
  return out.reshape(b, t, hq, d).astype(q.dtype)


# k/v and gate/up are one einsum each over their stacked weight, the stacked axis after the tokens
# ("btskd", "btsi"): with it first XLA chose slower transposed GEMM outputs, and slicing the
# stacked weight copies it every step (docs/findings/gemms-and-the-int8-drafter.md).
def project_norm_rope(layer, h, cos, sin, *, eps):
  """The q and k/v projections of h [B, T, H] (wq and wkv, or the fused wqkv; plus their biases
  bq, bkv when the layer has them), then `norm_rope`."""
  if layer.wqkv is not None:
    q, kv = split_qkv(dense("bth,hnd->btnd", h, layer.wqkv), layer.wo.shape[0])
  else:
    q, kv = dense("bth,hnd->btnd", h, layer.wq), dense("bth,hskd->btskd", h, layer.wkv)
  if layer.bq is not None:
    q, kv = q + layer.bq.astype(q.dtype), kv + layer.bkv.astype(kv.dtype)
  return norm_rope(q, kv, layer.q_norm, layer.k_norm, cos, sin, eps=eps)


def norm_rope(q, kv, q_norm, k_norm, cos, sin, *, eps):
  """The projections q [B, T, N, D], kv [B, T, 2, K, D] -> q, k (each RMSNormed over D when its
  norm [D] is not None (Qwen3), then RoPE'd), v [B, T, K, D]."""
  norm = lambda x, w: x if w is None else rms_norm(x, w, eps)
  return (apply_rope(norm(q, q_norm), cos, sin), apply_rope(norm(kv[:, :, 0], k_norm), cos, sin),
          kv[:, :, 1])


def project_kv(layer, cfg, h, cos, sin):
  """h [B, T, H] -> k, v [B, T, K, D]; k normed (Qwen3) and RoPE'd (drafter layers: unfused)."""
  if layer.wkv is None:
    raise ValueError("project_kv needs a layer's own wkv (fuse_qkv is for the target only)")
  return kv_rows(layer, cfg, dense("bth,hskd->btskd", h, layer.wkv), cos, sin)


def kv_rows(layer, cfg, kv, cos, sin):
  """The k/v projection's output kv [B, T, 2, K, D] -> k (normed, RoPE'd), v [B, T, K, D]."""
  k, v = kv[:, :, 0], kv[:, :, 1]
  if layer.k_norm is not None:
    k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
  return apply_rope(k, cos, sin), v


def attention_block(layer, cfg, x, h, cos, sin, k_cache, v_cache, prefix_len, new_mask, kernels,
                    cache_layer=None, prefix_from=None):
  """Residual GQA sub-block over x with h = its input RMSNorm (`decoder.attention_block`'s
  contract): -> x', the MLP's input norm of x' and the new rows' k, v [B, T, K, D]. Gated
  attention (Qwen3.5, Qwen3-Next) scales each head's output by sigmoid(h @ wq_gate) before o.
  prefix_from [B, T]: each query's first visible prefix row (a sliding window). gpt-oss's
  layers add biases to q/k/v and o (bq, bkv, bo) and attention sinks (`attend_xla`'s sinks)."""
  # The Pallas q/k kernel rotates whole heads and adds no bias: partial rotary and biased
  # projections take XLA's form.
  plain_qk = cfg.rope_dim == cfg.head_dim and layer.bq is None
  project = kernels.project_qkv if plain_qk else project_norm_rope
  q, k, v = project(layer, h, cos, sin, eps=cfg.rms_norm_eps)
  kw = {} if cache_layer is None else {"layer": cache_layer}
  if prefix_from is not None:
    kw["prefix_from"] = prefix_from
  if layer.sinks is not None:
    kw["sinks"] = layer.sinks
  # The Pallas tree attention has neither sliding windows nor sinks: those layers take XLA's
  # form (on a mesh GSPMD splits it over the heads).
  attend = kernels.attend if prefix_from is None and layer.sinks is None else attend_xla
  o = attend(q, k_cache, v_cache, prefix_len, k, v, new_mask, scale=cfg.attention_scale, **kw)
  if layer.wq_gate is not None:
    o = o * jax.nn.sigmoid(dense("bth,hnd->btnd", h, layer.wq_gate)).astype(o.dtype)
  if layer.bo is not None:  # o's bias joins the residual first (the same sum, one add earlier)
    x = x + layer.bo.astype(x.dtype)
  x, h = kernels.residual_norm(x, *merge_heads(o, layer.wo), layer.post_norm,
                               eps=cfg.rms_norm_eps)
  return x, h, k, v
