"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a latent cache, as pure functions.

Per token and layer the cache holds one row of C + R values for all heads: the compressed
latent c = RMSNorm(h W_DKV) (C = kv_lora_rank) and the shared RoPE key k_R (R = qk_rope_head_dim):
576 values at DeepSeek-V3's shape. Head n's key is [c W_UK[n], k_R] and its value c W_UV[n];
absorbing W_UK into the query and W_UV into the output,

  score_n(j) = (q_nope[n] W_UK[n]^T) . c_j + q_rope[n] . k_R,j       o_n = (sum_j p_j c_j) W_UV[n]

so attention is multi-query attention over the latent rows with queries of C + R values and
values the first C of the same rows: a tree of T nodes reads the latent cache once per
sequence, never the per-head keys. `attend_naive` decompresses per head (the check).

Shapes: B batch, T new tokens, H hidden, N heads, Dn qk_nope_head_dim, R qk_rope_head_dim,
Dv v_head_dim, C kv_lora_rank, Q q_lora_rank, S cache capacity. Weights [in, out].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.models.attention import NEG_INF
from jax.sharding import PartitionSpec as P

from ddtree_jax.models.ops import (apply_rope, einsum_f32, einsum_weight, merge_heads,
                                   random_weight, rms_norm)

Array = jax.Array
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: HF's default eps, not rms_norm_eps


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLAParams:
  """One layer's latent attention. wq, or wq_a + q_a_norm + wq_b (q_lora_rank set)."""
  wq: Array | None         # [H, N, Dn + R] (no q bottleneck)
  wq_a: Array | None       # [H, Q]
  q_a_norm: Array | None   # [Q]
  wq_b: Array | None       # [Q, N, Dn + R]
  wkv_a: Array             # [H, C + R]: the latent (pre-norm), then the RoPE key
  kv_a_norm: Array         # [C]
  w_uk: Array              # [C, N, Dn]: the latent's key up-projection (absorbed into q)
  w_uv: Array              # [C, N, Dv]: its value up-projection (absorbed into the output)
  wo: Array                # [N, Dv, H]

  def partition_specs(self, axes) -> MLAParams:
    """Heads over tp (q, W_UK, W_UV, o); the latent path replicated (the cache holds one latent
    row per token for all heads). axes: `sharding.Axes`."""
    hd = axes("heads", self.w_uk.shape[1], "attention heads")
    opt = lambda x, *spec: None if x is None else P(*spec)
    return MLAParams(wq=opt(self.wq, None, hd, None), wq_a=opt(self.wq_a),
                     q_a_norm=opt(self.q_a_norm), wq_b=opt(self.wq_b, None, hd, None), wkv_a=P(),
                     kv_a_norm=P(), w_uk=P(None, hd, None), w_uv=P(None, hd, None),
                     wo=P(hd, None, None))


def rope_pairs_to_halves(n: int) -> np.ndarray:
  """Index permutation [n] taking interleaved RoPE dims (x0, x1), (x2, x3), ... to halves
  (x0, x2, ..., x1, x3, ...): applied to a checkpoint's RoPE output columns at load time it
  turns HF's interleaved rotation into the rotate-half RoPE, with the same outputs."""
  return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])


def project(p: MLAParams, h, cos, sin, *, eps=LATENT_NORM_EPS):
  """h [B, T, H] -> (q_nope [B, T, N, Dn], q_rope [B, T, N, R] RoPE'd, the new latent rows
  [B, T, 1, C + R]: c normed, k_R RoPE'd)."""
  if p.wq is not None:
    q = einsum_weight("bth,hnd->btnd", h, p.wq)
  else:
    qa = rms_norm(einsum_weight("bth,hq->btq", h, p.wq_a), p.q_a_norm, eps)
    q = einsum_weight("btq,qnd->btnd", qa, p.wq_b)
  dn = p.w_uk.shape[-1]
  c_dim = p.kv_a_norm.shape[0]
  kv = einsum_weight("bth,hc->btc", h, p.wkv_a)
  row = jnp.concatenate([rms_norm(kv[..., :c_dim], p.kv_a_norm, eps),
                         apply_rope(kv[:, :, None, c_dim:], cos, sin)[:, :, 0]], axis=-1)
  return q[..., :dn], apply_rope(q[..., dn:], cos, sin), row[:, :, None]


def absorb_query(p: MLAParams, q_nope, q_rope):
  """q_nope [B, T, N, Dn], q_rope [B, T, N, R] -> the latent query [B, T, N, C + R]."""
  q_lat = einsum_weight("btnd,cnd->btnc", q_nope, p.w_uk)
  return jnp.concatenate([q_lat, q_rope.astype(q_lat.dtype)], axis=-1)


def attend_latent(q, cache, prefix_len, new, new_mask, *, scale, value_dim, layer=None):
  """Attention over latent rows (the XLA form; `Kernels.attend_latent`'s contract).

  q [B, T, N, C + R]; cache [B, 1, S, C + R] (or [L, B, 1, S, C + R] with `layer`); prefix_len
  [B]; new [B, T, 1, C + R] the new tokens' rows; new_mask [B, T, T] -> [B, T, N, value_dim]:
  each head's softmax-weighted sum of the first value_dim (= C) values of the visible rows."""
  if layer is not None:
    cache = cache[layer]
  s = cache.shape[2]
  s_pre = einsum_f32("btnc,bsc->bnts", q, cache[:, 0])
  s_new = einsum_f32("btnc,bsc->bnts", q, new[:, :, 0])
  pre_ok = jnp.arange(s)[None, :] < prefix_len[:, None]
  s_pre = jnp.where(pre_ok[:, None, None, :], s_pre * scale, NEG_INF)
  s_new = jnp.where(new_mask[:, None], s_new * scale, NEG_INF)
  # the softmax over [prefix, new] in two pieces: one concatenated score array made XLA fuse
  # the new rows' scores into a slow concatenation
  m = jnp.maximum(s_pre.max(-1, keepdims=True, initial=NEG_INF), s_new.max(-1, keepdims=True))
  e_pre, e_new = jnp.exp(s_pre - m), jnp.exp(s_new - m)
  total = e_pre.sum(-1, keepdims=True) + e_new.sum(-1, keepdims=True)
  p_pre, p_new = (e_pre / total).astype(q.dtype), (e_new / total).astype(q.dtype)
  out = (einsum_f32("bnts,bsc->btnc", p_pre, cache[:, 0, :, :value_dim])
         + einsum_f32("bnts,bsc->btnc", p_new, new[:, :, 0, :value_dim]))
  return out.astype(q.dtype)


def attend_naive(p: MLAParams, q_nope, q_rope, cache, prefix_len, new, new_mask, *, scale):
  """The same attention with every head's keys and values decompressed from the latent rows
  (HF's form; tests): -> [B, T, N, Dv] before the output projection."""
  c_dim = p.kv_a_norm.shape[0]
  rows = jnp.concatenate([cache[:, 0], new[:, :, 0]], axis=1)             # [B, S + T, C + R]
  k = jnp.einsum("bsc,cnd->bsnd", rows[..., :c_dim], p.w_uk)
  v = jnp.einsum("bsc,cnd->bsnd", rows[..., :c_dim], p.w_uv)
  scores = (einsum_f32("btnd,bsnd->bnts", q_nope, k)
            + einsum_f32("btnr,bsr->bnts", q_rope, rows[..., c_dim:])) * scale
  s = cache.shape[2]
  ok = jnp.concatenate([jnp.broadcast_to(jnp.arange(s)[None, None] < prefix_len[:, None, None],
                                         (q_nope.shape[0], q_nope.shape[1], s)), new_mask], -1)
  probs = jax.nn.softmax(jnp.where(ok[:, None], scores, NEG_INF), axis=-1).astype(v.dtype)
  return einsum_f32("bnts,bsnd->btnd", probs, v).astype(q_nope.dtype)


def attention_block(layer, cfg, x, h, cos, sin, cache, _, prefix_len, new_mask, kernels,
                    cache_layer=None):
  """Residual latent-attention sub-block (`decoder.attention_block`'s contract; the cache's v is
  empty: the latent rows are keys and values): -> x', the MLP's input norm of x', the new latent
  rows [B, T, 1, C + R] and empty values [B, T, 1, 0]."""
  p = layer.mla
  q_nope, q_rope, row = project(p, h, cos, sin)
  kw = {} if cache_layer is None else {"layer": cache_layer}
  o_lat = kernels.attend_latent(absorb_query(p, q_nope, q_rope), cache, prefix_len, row,
                                new_mask, scale=cfg.attention_scale,
                                value_dim=cfg.kv_lora_rank, **kw)
  o = einsum_weight("btnc,cnv->btnv", o_lat, p.w_uv)
  x, h = kernels.residual_norm(x, *merge_heads(o, p.wo), layer.post_norm,
                               eps=cfg.rms_norm_eps)
  return x, h, row, row[..., :0]


def init_params(cfg, key, dtype, std: float = 0.02) -> MLAParams:
  """Random latent attention for one layer (benchmarks and tests); norms near 1."""
  h, n = cfg.hidden_size, cfg.num_heads
  dn, r, dv, c, q = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                     cfg.kv_lora_rank, cfg.q_lora_rank)
  keys = iter(jax.random.split(key, 8))
  w = lambda *shape: random_weight(next(keys), shape, dtype, std)
  return MLAParams(wq=None if q else w(h, n, dn + r), wq_a=w(h, q) if q else None,
                   q_a_norm=jnp.ones((q,), dtype) if q else None,
                   wq_b=w(q, n, dn + r) if q else None, wkv_a=w(h, c + r),
                   kv_a_norm=jnp.ones((c,), dtype), w_uk=w(c, n, dn), w_uv=w(c, n, dv),
                   wo=w(n, dv, h))
