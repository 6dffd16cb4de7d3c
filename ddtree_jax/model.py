"""Qwen3 (dense or MoE) / Llama-3 / DeepSeek-V3 decoder as pure functions over a registered-
dataclass params pytree. A decoder layer is an attention block and an MLP block: the attention
is GQA or multi-head latent attention (`mla.py`), the MLP dense or a mixture of experts
(`moe.py`; DeepSeek's shared experts are the layer's dense MLP beside its experts).

Shapes: B batch, T new tokens, H hidden, N query heads, K kv heads, D head_dim, I MLP width,
V vocab, S cache capacity. Weights are stored [in, out] (x @ W), split by head for sharding.
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import kernels as kernels_lib
from ddtree_jax import mla as mla_lib
from ddtree_jax import moe as moe_lib
from ddtree_jax.attention import einsum_f32, einsum_weight, random_weight
from ddtree_jax.config import ModelConfig

Array = jax.Array


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
  (int8 weights with bf16 activations were no faster: WORKSPACE.md, Findings: GEMMs and the
  int8 drafter)."""
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerParams:
  """One decoder layer; a drafter's matrices may be Int8Weights (`drafter.quantize_int8`)."""
  input_norm: Array        # [H]
  wq: Array | None         # [H, N, D]; None once fused into wqkv
  wkv: Array | None        # [H, 2, K, D]  (k, v); None once fused into wqkv
  wo: Array | None         # [N, D, H]; None in a latent-attention layer
  q_norm: Array | None     # [D] (Qwen3) or None (Llama)
  k_norm: Array | None     # [D]
  post_norm: Array         # [H]
  w_gate_up: Array | None  # [H, 2, I]  (gate, up); None in a MoE layer without shared experts
  w_down: Array | None     # [I, H]; (with moe set: DeepSeek's shared experts, I = n x width)
  # `fuse_qkv`: [H, N + 2K, D], wq's heads then wkv's k and v heads: the q and k/v projections
  # as one GEMM with one output (one device only; see fuse_qkv)
  wqkv: Array | None = None
  moe: moe_lib.MoEParams | None = None  # the experts of a MoE layer (its MLP block)
  mla: mla_lib.MLAParams | None = None  # latent attention (then wq, wkv, wo, norms are None)


def fuse_qkv(params: Params) -> Params:
  """The target's wq [H, N, D] and wkv [H, 2, K, D] as one wqkv [H, N + 2K, D] per layer (the
  same values, concatenated over heads). One GEMM then writes q, k and v into one array, which
  the Pallas q/k kernel reads as it is (with two weights XLA copies the merged GEMM's output:
  WORKSPACE.md, Findings: Fused glue kernels). One device only: on a mesh q and kv heads are
  sharded on their own axes (`sharding.py` refuses fused weights, and this refuses sharded
  ones). Fused layers are kept. `checkpoint.load_target` builds the same layout on the host."""
  def fuse(layer):
    if layer.wqkv is not None or layer.mla is not None:  # (latent attention has no q/k/v)
      return layer
    if layer.wq is None or layer.wkv is None:
      raise ValueError("fuse_qkv: a layer has neither wqkv nor both wq and wkv")
    if isinstance(layer.wq, Int8Weight) or isinstance(layer.wkv, Int8Weight):
      raise ValueError("fuse_qkv: int8 q/k/v weights are not supported (drafters keep wq, wkv)")
    if layer.wq.dtype != layer.wkv.dtype:
      raise ValueError(f"fuse_qkv: wq is {layer.wq.dtype} but wkv {layer.wkv.dtype}")
    if any(len(w.sharding.device_set) > 1 for w in (layer.wq, layer.wkv)
           if isinstance(w, jax.Array) and not isinstance(w, jax.core.Tracer)):
      raise ValueError("fuse_qkv: params placed on several devices cannot be fused (q and kv "
                       "heads shard on their own axes); fuse on one device")
    h, _, d = layer.wq.shape
    wqkv = jnp.concatenate([layer.wq, layer.wkv.reshape(h, -1, d)], axis=1)
    return dataclasses.replace(layer, wq=None, wkv=None, wqkv=wqkv)
  return dataclasses.replace(params, layers=[fuse(l) for l in params.layers])


def split_qkv(y, n: int):
  """The fused projection's output [..., N + 2K, D] -> q [..., N, D], kv [..., 2, K, D]."""
  return y[..., :n, :], y[..., n:, :].reshape(y.shape[:-2] + (2, -1, y.shape[-1]))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
  embed: Array             # [V, H]
  layers: list[LayerParams]
  final_norm: Array        # [H]
  lm_head: Array | None    # [H, V], None when tied to embed


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """K/V of committed tokens, every layer in one array; rows [0, lens[b]) of sequence b are valid.

  One array per K and V (not one per layer), so a step commits all layers in one scatter, not
  two per layer (WORKSPACE.md, Findings: Fused glue kernels). Attention reads layer i straight
  from it (`layer=i`)."""
  k: Array                 # [L, B, K, S, D]
  v: Array                 # [L, B, K, S, D]
  lens: Array              # [B] int32

  @property
  def capacity(self) -> int:
    return self.k.shape[3]


def init_cache(num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
               dtype, v_dim: int | None = None) -> KVCache:
  shape = (num_layers, batch, kv_heads, capacity, head_dim)
  v_shape = shape[:-1] + (head_dim if v_dim is None else v_dim,)
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(v_shape, dtype),
                 lens=jnp.zeros((batch,), jnp.int32))


def init_target_cache(cfg: ModelConfig, batch: int, capacity: int, dtype) -> KVCache:
  """The target's cache (`ModelConfig.cache_layout`): GQA k and v, or MLA's latent rows in k
  (v empty: the latent is the value too)."""
  heads, k_dim, v_dim = cfg.cache_layout
  return init_cache(cfg.num_layers, batch, heads, capacity, k_dim, dtype, v_dim)


def commit(cache: KVCache, new_k, new_v, src, count) -> KVCache:
  """Appends selected new rows to every layer's cache, in place when donated.

  new_k/new_v: per layer [B, T, K, D]; src [B, R] int32 rows of the new block to keep, in order;
  count [B] int32 <= R: how many of them are committed. Row r goes to cache row lens + r; rows
  r >= count get an out-of-range index and are dropped (never clamped onto other rows).
  """
  b, r = src.shape
  dst = cache.lens[:, None] + jnp.arange(r, dtype=jnp.int32)[None]
  dst = jnp.where(jnp.arange(r)[None] < count[:, None], dst, cache.capacity)
  bi = jnp.arange(b)[:, None]

  def put(buf, rows):
    rows = jnp.stack([jnp.take_along_axis(x, src[:, :, None, None], axis=1) for x in rows],
                     axis=2)  # [B, R, L, K, D]: the index dims (b, r) lead, as .at[] wants
    return buf.at[:, bi, :, dst].set(rows.astype(buf.dtype), mode="drop")

  return KVCache(k=put(cache.k, new_k), v=put(cache.v, new_v), lens=cache.lens + count)


def rms_norm(x, weight, eps):
  """Qwen3/Llama RMSNorm: normalise in float32, cast back, then scale."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return weight * xf.astype(x.dtype)


def rope_tables(cfg: ModelConfig, positions, dtype):
  """cos/sin [B, T, D] for absolute positions [B, T] (rotate-half layout, as HF)."""
  inv = jnp.asarray(cfg.inv_freq(), jnp.float32)
  freqs = positions.astype(jnp.float32)[..., None] * inv
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  f = cfg.rope_attention_factor  # YaRN's (1 otherwise)
  return (f * jnp.cos(emb)).astype(dtype), (f * jnp.sin(emb)).astype(dtype)


def apply_rope(x, cos, sin):
  """x [B, T, heads, D] rotated by cos/sin [B, T, D]."""
  half = x.shape[-1] // 2
  rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos[:, :, None] + rot * sin[:, :, None]


# k/v and gate/up are one einsum each over their stacked weight, the stacked axis after the tokens
# ("btskd", "btsi"): with it first XLA chose slower transposed GEMM outputs, and slicing the
# stacked weight copies it every step (WORKSPACE.md, Findings: GEMMs and the int8 drafter).
def project_norm_rope(layer: LayerParams, h, cos, sin, *, eps):
  """The q and k/v projections of h [B, T, H] (wq and wkv, or the fused wqkv), then `norm_rope`."""
  if layer.wqkv is not None:
    q, kv = split_qkv(dense("bth,hnd->btnd", h, layer.wqkv), layer.wo.shape[0])
  else:
    q, kv = dense("bth,hnd->btnd", h, layer.wq), dense("bth,hskd->btskd", h, layer.wkv)
  return norm_rope(q, kv, layer.q_norm, layer.k_norm, cos, sin, eps=eps)


def norm_rope(q, kv, q_norm, k_norm, cos, sin, *, eps):
  """The projections q [B, T, N, D], kv [B, T, 2, K, D] -> q, k (each RMSNormed over D when its
  norm [D] is not None (Qwen3), then RoPE'd), v [B, T, K, D]."""
  norm = lambda x, w: x if w is None else rms_norm(x, w, eps)
  return (apply_rope(norm(q, q_norm), cos, sin), apply_rope(norm(kv[:, :, 0], k_norm), cos, sin),
          kv[:, :, 1])


def project_kv(layer: LayerParams, cfg: ModelConfig, h, cos, sin):
  """h [B, T, H] -> k, v [B, T, K, D]; k normed (Qwen3) and RoPE'd (drafter layers: unfused)."""
  if layer.wkv is None:
    raise ValueError("project_kv needs a layer's own wkv (fuse_qkv is for the target only)")
  return kv_rows(layer, cfg, dense("bth,hskd->btskd", h, layer.wkv), cos, sin)


def kv_rows(layer: LayerParams, cfg: ModelConfig, kv, cos, sin):
  """The k/v projection's output kv [B, T, 2, K, D] -> k (normed, RoPE'd), v [B, T, K, D]."""
  k, v = kv[:, :, 0], kv[:, :, 1]
  if layer.k_norm is not None:
    k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
  return apply_rope(k, cos, sin), v


def residual_norm(x, spec, a, w, norm, *, eps):
  """The residual add after the o / down projection, then the next RMSNorm: x [B, T, H] +
  dense(spec, a, w) -> (x', rms_norm(x', norm)) (`Kernels.residual_norm`'s contract)."""
  x = x + dense(spec, a, w)
  return x, rms_norm(x, norm, eps)


def attention_block(layer, cfg, x, h, cos, sin, k_cache, v_cache, prefix_len, new_mask,
                    kernels: kernels_lib.Kernels = kernels_lib.REFERENCE, cache_layer=None):
  """Residual attention sub-block over x with h = its input RMSNorm. Returns x', the MLP's input
  norm of x' and the new rows' k, v [B, T, K, D].

  k_cache/v_cache: [B, K, S, D], or a KVCache's [L, B, K, S, D] with cache_layer the layer.
  A latent-attention layer reads its latent rows from k_cache (`mla.attention_block`)."""
  if layer.mla is not None:
    return mla_lib.attention_block(layer, cfg, x, h, cos, sin, k_cache, prefix_len, new_mask,
                                   kernels, cache_layer)
  q, k, v = kernels.project_qkv(layer, h, cos, sin, eps=cfg.rms_norm_eps)
  kw = {} if cache_layer is None else {"layer": cache_layer}
  o = kernels.attend(q, k_cache, v_cache, prefix_len, k, v, new_mask,
                     scale=cfg.attention_scale, **kw)
  x, h = kernels.residual_norm(x, *merge_heads(o, layer.wo), layer.post_norm,
                               eps=cfg.rms_norm_eps)
  return x, h, k, v


def merge_heads(o, wo):
  """The o projection's (spec, a, w) for residual_norm: o [B, T, N, D] and wo [N, D, H] as one
  contracted dim [B, T, N*D] x [N*D, H], a plain GEMM (at one row `dense` keeps it one:
  `attention.einsum_weight`); an Int8Weight keeps its layout."""
  if isinstance(wo, Int8Weight):
    return "btnd,ndh->bth", o, wo
  return "btc,ch->bth", o.reshape(*o.shape[:2], -1), wo.reshape(-1, wo.shape[-1])


def mlp_block(layer, cfg, x, h, next_norm, kernels: kernels_lib.Kernels = kernels_lib.REFERENCE):
  """Residual MLP sub-block over x with h = its RMSNorm -> (x', x' normed with next_norm): a
  dense SwiGLU, or the layer's mixture of experts (`Kernels.moe`) plus its shared experts."""
  if layer.moe is not None:
    b, t, hid = h.shape
    y = kernels.moe(layer.moe, h.reshape(b * t, hid), routing=cfg.routing).reshape(b, t, hid)
    if layer.w_gate_up is not None:  # DeepSeek's shared experts: one dense SwiGLU
      gu = dense("bth,hsi->btsi", h, layer.w_gate_up)
      y = y + dense("bti,ih->bth", jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1], layer.w_down)
    x = x + y.astype(x.dtype)
    return x, rms_norm(x, next_norm, cfg.rms_norm_eps)
  gu = dense("bth,hsi->btsi", h, layer.w_gate_up)
  return kernels.residual_norm(x, "bti,ih->bth", jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1],
                               layer.w_down, next_norm, eps=cfg.rms_norm_eps)


def decoder_stack(layers, cfg, x, final_norm, cos, sin, k_cache, v_cache, prefix_len, new_mask,
                  kernels: kernels_lib.Kernels = kernels_lib.REFERENCE, tap_layers=()):
  """The decoder layers over x [B, T, H], each RMSNorm computed with the add before it.

  k_cache/v_cache: stacked [L, B, K, S, D] (a KVCache's, read with `layer=i`) or lists of
  per-layer caches [B, K, S, D].
  Returns hidden [B, T, H] after final_norm, new_k/new_v per layer [B, T, K, D], and
  {layer id: residual output [B, T, H]} for tap_layers: HF's hidden_states[id + 1], so the last
  layer's tap is the state after final_norm (what DFlash drafters are trained on)."""
  stacked = not isinstance(k_cache, (list, tuple))
  h = rms_norm(x, layers[0].input_norm, cfg.rms_norm_eps)
  new_k, new_v, taps = [], [], {}
  for i, layer in enumerate(layers):
    kc, vc = (k_cache, v_cache) if stacked else (k_cache[i], v_cache[i])
    x, h, k, v = attention_block(layer, cfg, x, h, cos, sin, kc, vc, prefix_len, new_mask,
                                 kernels, cache_layer=i if stacked else None)
    nxt = layers[i + 1].input_norm if i + 1 < len(layers) else final_norm
    x, h = mlp_block(layer, cfg, x, h, nxt, kernels)
    new_k.append(k)
    new_v.append(v)
    if i in tap_layers:
      taps[i] = h if i + 1 == len(layers) else x
  return h, new_k, new_v, taps


def embed_lookup(table, tokens):
  """Rows of the embedding table [V, H] for token ids [...] -> [..., H] (`Kernels.embed`)."""
  return table[tokens]


def forward(params: Params, cfg: ModelConfig, tokens, positions, cache: KVCache, new_mask,
            tap_layers: tuple[int, ...] = (),
            kernels: kernels_lib.Kernels = kernels_lib.REFERENCE):
  """Target forward of new tokens over the cached prefix (the cache is not modified).

  Args:
    tokens, positions: [B, T] int32. new_mask: [B, T, T] bool visibility among the new tokens.
    tap_layers: layer ids whose residual outputs are returned (HF hidden_states[id + 1]: after
      final_norm for the last layer).
    kernels: the implementations of attention, q/k/v projection + norm + RoPE, residual + norm
      and the embedding lookup (`kernels.Kernels`; plain XLA on one device by default).
  Returns:
    hidden [B, T, H] after the final norm; new_k, new_v: per layer [B, T, K, D];
    taps [B, T, len(tap_layers) * H] (concatenated in tap_layers order) or None.
  """
  x = kernels.embed(params.embed, tokens)
  cos, sin = rope_tables(cfg, positions, x.dtype)
  hidden, new_k, new_v, taps = decoder_stack(params.layers, cfg, x, params.final_norm, cos, sin,
                                             cache.k, cache.v, cache.lens, new_mask, kernels,
                                             tap_layers)
  tapped = jnp.concatenate([taps[i] for i in tap_layers], axis=-1) if tap_layers else None
  return hidden, new_k, new_v, tapped


def lm_head(params: Params, hidden):
  """hidden [..., H] -> float32 logits [..., V] (tied embeddings use embed.T)."""
  if params.lm_head is None:
    return einsum_f32("...h,vh->...v", hidden, params.embed)
  return einsum_f32("...h,hv->...v", hidden, params.lm_head)


def causal_mask(lens, t: int):
  """[B, T, T] causal mask among T new tokens, key j visible only if j < lens[b] (padding)."""
  i = jnp.arange(t)
  return (i[None, :, None] >= i[None, None, :]) & (i[None, None, :] < lens[:, None, None])


def init_params(cfg: ModelConfig, key, dtype=jnp.bfloat16, std: float = 0.02) -> Params:
  """Random weights (benchmarks and tests); norms near 1."""
  h, n, k, d, i = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
  keys = iter(jax.random.split(key, 8 * cfg.num_layers + 3))
  w = lambda *shape: random_weight(next(keys), shape, dtype, std)
  ones = lambda m: jnp.ones((m,), dtype)

  def mlp(layer):
    if not cfg.is_moe(layer):
      return dict(w_gate_up=w(h, 2, i), w_down=w(i, h))
    shared = cfg.n_shared_experts * cfg.moe_intermediate_size
    return dict(w_gate_up=w(h, 2, shared) if shared else None,
                w_down=w(shared, h) if shared else None, moe=moe_lib.init_params(
        jax.random.fold_in(key, 1 << 20 | layer), h, cfg.num_experts, cfg.moe_intermediate_size,
        dtype, std, bias=cfg.scoring_func == "sigmoid"))

  def attention(layer):
    if cfg.is_mla:
      return dict(wq=None, wkv=None, wo=None, q_norm=None, k_norm=None, mla=mla_lib.init_params(
          cfg, jax.random.fold_in(key, 1 << 21 | layer), dtype, std))
    return dict(wq=w(h, n, d), wkv=w(h, 2, k, d), wo=w(n, d, h),
                q_norm=ones(d) if cfg.qk_norm else None, k_norm=ones(d) if cfg.qk_norm else None)
  layers = [LayerParams(input_norm=ones(h), post_norm=ones(h), **attention(layer), **mlp(layer))
            for layer in range(cfg.num_layers)]
  return Params(embed=w(cfg.vocab_size, h), layers=layers, final_norm=ones(h),
                lm_head=None if cfg.tie_word_embeddings else w(h, cfg.vocab_size))


def param_bytes(params) -> int:
  return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params)))
