"""The decoder every family shares (Qwen3 dense or MoE, Llama-3, DeepSeek-V3 / Kimi-K2, the
Qwen3.5 / Qwen3-Next hybrids, gpt-oss), as pure functions over a registered-dataclass params
pytree. A decoder layer is a mixer block and an MLP block, each of a layer kind chosen by its
params: the mixer GQA attention (`attention.py`), multi-head latent attention (`mla.py`) or Gated DeltaNet
(`gated_deltanet.py`), the MLP a dense SwiGLU or a mixture of experts (`moe.py`; shared experts
are the layer's dense MLP beside its experts).

Each mixer kind owns its part of the cache and implements the same three operations: prefill (a
prompt), verify (a draft tree: its positions and ancestor-or-self visibility) and commit (the
accepted rows). `forward` runs the first two and returns a `Pending` of the new rows; `commit`
keeps the accepted ones. Attention keeps K/V rows (`KVCache.k` / `v`), Gated DeltaNet a state and
a convolution window per sequence (`KVCache.state` / `window`).

Shapes: B batch, T new tokens, H hidden, N query heads, K kv heads, D head_dim, I MLP width,
V vocab, S cache capacity. Weights are stored [in, out] (x @ W), split by head for sharding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ddtree_jax import kernels as kernels_lib
from ddtree_jax.models import attention as attention_lib
from ddtree_jax.models import gated_deltanet as gdn_lib
from ddtree_jax.models import mla as mla_lib
from ddtree_jax.models import moe as moe_lib
from ddtree_jax.models.config import ModelConfig
from ddtree_jax.models.ops import (Int8Weight, dense, einsum_f32, random_weight, rms_norm,
                                   rope_tables, weight_spec)

Array = jax.Array


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
  gdn: gdn_lib.GDNParams | None = None  # a Gated DeltaNet mixer (then attention's are None)
  wq_gate: Array | None = None  # [H, N, D]: gated attention's output gate, sigmoid(h @ wq_gate)
  shared_gate: Array | None = None  # [H]: the shared expert's gate, sigmoid(h . shared_gate)
  # gpt-oss: the q, k/v and o projections' biases, and a sink logit per query head
  bq: Array | None = None     # [N, D]
  bkv: Array | None = None    # [2, K, D]  (k, v)
  bo: Array | None = None     # [H]
  sinks: Array | None = None  # [N]

  def partition_specs(self, axes) -> LayerParams:
    """Query and kv heads over tp (wq, wkv split on heads, wo row-parallel), the MLP width over
    tp, the experts' and latent attention's own layouts; norms replicated."""
    if self.wqkv is not None:
      raise ValueError("fused q/k/v weights (decoder.fuse_qkv) cannot be sharded: q and kv heads "
                       "split on their own axes; shard unfused params (load_target(..., "
                       "fuse_qkv=False), or give load_target the mesh)")
    opt = lambda x: None if x is None else P()
    mlp = dict(w_gate_up=None, w_down=None)
    if self.w_down is not None:  # the dense MLP, or DeepSeek's shared experts beside the experts
      ml = axes("mlp", self.w_down.shape[0], "intermediate_size")
      mlp = dict(w_gate_up=weight_spec(self.w_gate_up, None, None, ml),
                 w_down=weight_spec(self.w_down, ml, None))
    moe = None if self.moe is None else self.moe.partition_specs(axes)
    if self.shared_gate is not None:
      mlp["shared_gate"] = P()
    if self.gdn is not None:
      return LayerParams(input_norm=P(), wq=None, wkv=None, wo=None, q_norm=None, k_norm=None,
                         post_norm=P(), gdn=self.gdn.partition_specs(axes), moe=moe, **mlp)
    if self.mla is not None:
      return LayerParams(input_norm=P(), wq=None, wkv=None, wo=None, q_norm=None, k_norm=None,
                         post_norm=P(), mla=self.mla.partition_specs(axes), moe=moe, **mlp)
    hd = axes("heads", self.wq.shape[1], "query heads")
    kv = axes("kv_heads", self.wkv.shape[2], "kv heads")
    heads = lambda x, *spec: None if x is None else P(*spec)
    return LayerParams(input_norm=P(), wq=weight_spec(self.wq, None, hd, None),
                       wkv=weight_spec(self.wkv, None, None, kv, None),
                       wo=weight_spec(self.wo, hd, None, None), q_norm=opt(self.q_norm),
                       k_norm=opt(self.k_norm), post_norm=P(), moe=moe,
                       wq_gate=None if self.wq_gate is None else weight_spec(self.wq_gate, None,
                                                                             hd, None),
                       bq=heads(self.bq, hd, None), bkv=heads(self.bkv, None, kv, None),
                       bo=opt(self.bo), sinks=heads(self.sinks, hd), **mlp)


def fuse_qkv(params: Params) -> Params:
  """The target's wq [H, N, D] and wkv [H, 2, K, D] as one wqkv [H, N + 2K, D] per layer (the
  same values, concatenated over heads). One GEMM then writes q, k and v into one array, which
  the Pallas q/k kernel reads as it is (with two weights XLA copies the merged GEMM's output:
  docs/findings/fused-glue-kernels.md). One device only: on a mesh q and kv heads are
  sharded on their own axes (`sharding.py` refuses fused weights, and this refuses sharded
  ones). Fused layers are kept. `hf.load_target` builds the same layout on the host."""
  def fuse(layer):
    if layer.wqkv is not None or layer.mla is not None or layer.gdn is not None:  # no q/k/v
      return layer
    if layer.bq is not None:
      raise ValueError("fuse_qkv: layers with q/k/v biases (gpt-oss) keep wq and wkv")
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
  embed: Array             # [V, H]
  layers: list[LayerParams]
  final_norm: Array        # [H]
  lm_head: Array | None    # [H, V], None when tied to embed
  # The real V when embed's rows and lm_head's columns are zero-padded past it (`pad_vocab`),
  # else None. Static: `lm_head` slices the logits with it.
  vocab_size: int | None = dataclasses.field(default=None, metadata=dict(static=True))

  @property
  def vocab(self) -> int:
    """V, the real vocabulary size (padding excluded)."""
    return self.embed.shape[0] if self.vocab_size is None else self.vocab_size

  def partition_specs(self, axes) -> Params:
    """The vocabulary over tp (embed's rows, lm_head's columns), each layer's own layout."""
    voc = axes("vocab", self.embed.shape[0], "vocab_size")
    return Params(embed=P(voc, None), layers=[l.partition_specs(axes) for l in self.layers],
                  final_norm=P(), lm_head=None if self.lm_head is None else P(None, voc),
                  vocab_size=self.vocab_size)

  def pad_vocab(self, multiple: int, pad) -> Params:
    """embed [V, H]'s rows and lm_head [H, V]'s columns zero-padded to the next multiple of
    `multiple` (a vocab axis that does not divide V: padded vocabulary shards, as vLLM and SGLang
    have); vocab_size keeps V and `lm_head` slices the padding off. pad(x, axis, size): x
    zero-padded to `size` along `axis` (`sharding.pad_vocab`)."""
    n = self.embed.shape[0]
    if n % multiple == 0:
      return self
    size = -(-n // multiple) * multiple
    return dataclasses.replace(
        self, embed=pad(self.embed, 0, size), vocab_size=self.vocab,
        lm_head=None if self.lm_head is None else pad(self.lm_head, 1, size))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """The committed tokens of every layer: K/V rows of the La attention layers, rows [0, lens[b])
  of sequence b valid; and for the Lr Gated DeltaNet layers of a hybrid, each sequence's state
  after its last committed token and the last K - 1 convolution inputs.

  One array per K and V (not one per layer), so a step commits all layers in one scatter, not
  two per layer (docs/findings/fused-glue-kernels.md). Attention reads its layer straight
  from it (`layer=` its index among the attention layers)."""
  k: Array                 # [La, B, K, S, D]
  v: Array                 # [La, B, K, S, D]
  lens: Array              # [B] int32
  state: Array | None = None   # [Lr, B, Hv, dk, dv] float32
  window: Array | None = None  # [Lr, B, K-1, Hk, G]: per key-head group (`GDNParams.conv`)

  @property
  def capacity(self) -> int:
    return self.k.shape[3]

  def partition_specs(self, axes) -> KVCache:
    """[L, B, K, S, D]: B over dp, K over tp; a latent cache (MLA: one row per token for all
    heads, v empty) replicated over tp. Gated DeltaNet: B over dp, the state's value heads and
    the window's key-head groups over tp, as their layer's weights (`GDNParams`)."""
    bt = axes("batch", self.lens.shape[0], "batch")
    kv = None if self.v.shape[-1] == 0 else axes("kv_heads", self.k.shape[2], "kv heads")
    spec = P(None, bt, kv, None, None)
    state = window = None
    if self.state is not None:
      g = axes("linear_heads", self.window.shape[3], "Gated DeltaNet key heads")
      state, window = P(None, bt, g, None, None), P(None, bt, None, g, None)
    return KVCache(k=spec, v=spec, lens=P(bt), state=state, window=window)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pending:
  """A forward's new rows, not yet committed: k, v [B, T, K, D] per attention layer, and per
  Gated DeltaNet layer its `gated_deltanet.Pending` (a tree) or `Prefilled` (a prompt)."""
  k: list
  v: list
  recurrent: list = dataclasses.field(default_factory=list)


def init_cache(num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
               dtype, v_dim: int | None = None) -> KVCache:
  shape = (num_layers, batch, kv_heads, capacity, head_dim)
  v_shape = shape[:-1] + (head_dim if v_dim is None else v_dim,)
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(v_shape, dtype),
                 lens=jnp.zeros((batch,), jnp.int32))


def init_target_cache(cfg: ModelConfig, batch: int, capacity: int, dtype) -> KVCache:
  """The target's cache (`ModelConfig.cache_layout`): GQA k and v, or MLA's latent rows in k
  (v empty: the latent is the value too), for its attention layers; a hybrid's Gated DeltaNet
  layers start from a zero state and window."""
  heads, k_dim, v_dim = cfg.cache_layout
  cache = init_cache(len(cfg.attention_layers), batch, heads, capacity, k_dim, dtype, v_dim)
  if not cfg.recurrent_layers:
    return cache
  d, lr = cfg.gdn, len(cfg.recurrent_layers)
  return dataclasses.replace(
      cache, state=jnp.zeros((lr, batch, d.value_heads, d.key_dim, d.value_dim), jnp.float32),
      window=jnp.zeros((lr, batch, d.conv_kernel - 1, d.key_heads, d.group_dim), dtype))


def commit(cache: KVCache, pending: Pending, src, count) -> KVCache:
  """Keeps the accepted new rows of every layer, in place when donated.

  pending: a forward's new rows; src [B, R] int32 rows of the new block to keep, in path order;
  count [B] int32 <= R: how many of them are committed. Attention: row r goes to cache row
  lens + r; rows r >= count get an out-of-range index and are dropped (never clamped onto other
  rows). Gated DeltaNet: the state and window after the last kept row.
  """
  state, window = cache.state, cache.window
  if pending.recurrent:
    kept = [gdn_lib.commit_block(state[i], window[i], p, src, count)
            for i, p in enumerate(pending.recurrent)]
    state, window = (jnp.stack(x).astype(y.dtype) for x, y in zip(zip(*kept), (state, window)))
  if not pending.k:
    return dataclasses.replace(cache, lens=cache.lens + count, state=state, window=window)
  b, r = src.shape
  dst = cache.lens[:, None] + jnp.arange(r, dtype=jnp.int32)[None]
  dst = jnp.where(jnp.arange(r)[None] < count[:, None], dst, cache.capacity)
  bi = jnp.arange(b)[:, None]

  def put(buf, rows):
    rows = jnp.stack([jnp.take_along_axis(x, src[:, :, None, None], axis=1) for x in rows],
                     axis=2)  # [B, R, L, K, D]: the index dims (b, r) lead, as .at[] wants
    return buf.at[:, bi, :, dst].set(rows.astype(buf.dtype), mode="drop")

  return KVCache(k=put(cache.k, pending.k), v=put(cache.v, pending.v), lens=cache.lens + count,
                 state=state, window=window)


def attention_block(layer, cfg, x, h, cos, sin, k_cache, v_cache, prefix_len, new_mask,
                    kernels: kernels_lib.Kernels = kernels_lib.REFERENCE, cache_layer=None,
                    **window):
  """Residual attention sub-block over x with h = its input RMSNorm. Returns x', the MLP's input
  norm of x' and the new rows' k, v [B, T, K, D].

  k_cache/v_cache: [B, K, S, D], or a KVCache's [L, B, K, S, D] with cache_layer the layer.
  A latent-attention layer reads its latent rows from k_cache (`mla.attention_block`)."""
  kind = attention_lib if layer.mla is None else mla_lib
  return kind.attention_block(layer, cfg, x, h, cos, sin, k_cache, v_cache, prefix_len, new_mask,
                              kernels, cache_layer, **window)


def mlp_block(layer, cfg, x, h, next_norm, kernels: kernels_lib.Kernels = kernels_lib.REFERENCE):
  """Residual MLP sub-block over x with h = its RMSNorm -> (x', x' normed with next_norm): a
  dense SwiGLU, or the layer's mixture of experts (`Kernels.moe`) plus its shared experts."""
  if layer.moe is not None:
    b, t, hid = h.shape
    shared = None
    if layer.w_gate_up is not None:  # shared experts: one dense SwiGLU (Qwen's gated)
      gu = dense("bth,hsi->btsi", h, layer.w_gate_up)
      shared = dense("bti,ih->bth", jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1], layer.w_down)
      if layer.shared_gate is not None:
        shared = shared * jax.nn.sigmoid(dense("bth,h->bt", h, layer.shared_gate))[..., None]
      shared = shared.reshape(b * t, hid)
    rows = lambda a: a.reshape(b * t, hid)
    x, h = kernels.moe_residual(layer.moe, rows(x), rows(h), shared, next_norm,
                                routing=cfg.routing, eps=cfg.rms_norm_eps)
    return x.reshape(b, t, hid), h.reshape(b, t, hid)
  gu = dense("bth,hsi->btsi", h, layer.w_gate_up)
  return kernels.residual_norm(x, "bti,ih->bth", jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1],
                               layer.w_down, next_norm, eps=cfg.rms_norm_eps)


def recurrent_block(layer, cfg, x, h, positions, new_mask, state, window, chain: bool,
                    rule=gdn_lib.tree):
  """Residual Gated DeltaNet sub-block over x with h = its input RMSNorm (`gated_deltanet.block`;
  state [B, Hv, dk, dv], window [B, K-1, Hk, G] the committed ones; rule: the tree's delta rule,
  `Kernels.delta_tree`) -> x', the MLP's input norm of x' and the layer's pending rows."""
  y, pending = gdn_lib.block(layer.gdn, cfg.gdn, h, positions, new_mask, state, window, chain,
                             rule=rule)
  x = x + y.astype(x.dtype)
  return x, rms_norm(x, layer.post_norm, cfg.rms_norm_eps), pending


def decoder_stack(layers, cfg, x, final_norm, cos, sin, k_cache, v_cache, prefix_len, new_mask,
                  kernels: kernels_lib.Kernels = kernels_lib.REFERENCE, tap_layers=(), *,
                  positions=None, state=None, window=None, chain: bool = False):
  """The decoder layers over x [B, T, H], each RMSNorm computed with the add before it.

  k_cache/v_cache: the attention layers' stacked [La, B, K, S, D] (a KVCache's, read with
  `layer=`) or lists of per-layer caches [B, K, S, D]. Gated DeltaNet layers (hybrids) read
  state / window (a KVCache's) and positions [B, T]; chain: the new tokens are a prompt (causal,
  right-padded: chunked), else a tree of any shape. Sliding-window layers (drafters) read
  positions too: prefix row r is at position r.
  Returns hidden [B, T, H] after final_norm, the `Pending` new rows, and {layer id: residual
  output [B, T, H]} for tap_layers: HF's hidden_states[id + 1], so the last layer's tap is the
  state after final_norm (what DFlash drafters are trained on)."""
  stacked = not isinstance(k_cache, (list, tuple))
  h = rms_norm(x, layers[0].input_norm, cfg.rms_norm_eps)
  pending, taps = Pending([], [], []), {}
  for i, layer in enumerate(layers):
    if layer.gdn is not None:
      r = len(pending.recurrent)
      x, h, rows = recurrent_block(layer, cfg, x, h, positions, new_mask, state[r], window[r],
                                   chain, kernels.delta_tree)
      pending.recurrent.append(rows)
    else:
      a = len(pending.k)
      kc, vc = (k_cache, v_cache) if stacked else (k_cache[a], v_cache[a])
      mask, sliding = new_mask, {}
      if cfg.window(i):  # prefix rows are at their positions (a drafter's context)
        w = cfg.window(i)
        mask = new_mask & (jnp.abs(positions[:, :, None] - positions[:, None, :]) < w)
        sliding = dict(prefix_from=positions - (w - 1))
      x, h, k, v = attention_block(layer, cfg, x, h, cos, sin, kc, vc, prefix_len, mask,
                                   kernels, cache_layer=a if stacked else None, **sliding)
      pending.k.append(k)
      pending.v.append(v)
    nxt = layers[i + 1].input_norm if i + 1 < len(layers) else final_norm
    x, h = mlp_block(layer, cfg, x, h, nxt, kernels)
    if i in tap_layers:
      taps[i] = h if i + 1 == len(layers) else x
  return h, pending, taps


def forward(params: Params, cfg: ModelConfig, tokens, positions, cache: KVCache, new_mask,
            tap_layers: tuple[int, ...] = (),
            kernels: kernels_lib.Kernels = kernels_lib.REFERENCE, chain: bool = False):
  """Target forward of new tokens over the committed ones (the cache is not modified).

  Args:
    tokens, positions: [B, T] int32. new_mask: [B, T, T] bool visibility among the new tokens
      (causal with padding for a prompt, ancestor-or-self for a tree).
    tap_layers: layer ids whose residual outputs are returned (HF hidden_states[id + 1]: after
      final_norm for the last layer).
    kernels: the implementations of attention, q/k/v projection + norm + RoPE, residual + norm
      and the embedding lookup (`kernels.Kernels`; plain XLA on one device by default).
    chain: the new tokens are a right-padded prompt (new_mask causal): Gated DeltaNet layers
      run their chunked form. Without it they treat the block as a tree, also correct.
  Returns:
    hidden [B, T, H] after the final norm; the `Pending` new rows (for `commit`);
    taps [B, T, len(tap_layers) * H] (concatenated in tap_layers order) or None.
  """
  x = kernels.embed(params.embed, tokens)
  cos, sin = rope_tables(cfg, positions, x.dtype)
  hidden, pending, taps = decoder_stack(
      params.layers, cfg, x, params.final_norm, cos, sin, cache.k, cache.v, cache.lens, new_mask,
      kernels, tap_layers, positions=positions, state=cache.state, window=cache.window,
      chain=chain)
  tapped = jnp.concatenate([taps[i] for i in tap_layers], axis=-1) if tap_layers else None
  return hidden, pending, tapped


def lm_head(params: Params, hidden):
  """hidden [..., H] -> float32 logits [..., V] (tied embeddings use embed.T); the columns of a
  padded vocabulary (`Params.pad_vocab`) past V are sliced off."""
  if params.lm_head is None:
    logits = einsum_f32("...h,vh->...v", hidden, params.embed)
  else:
    logits = einsum_f32("...h,hv->...v", hidden, params.lm_head)
  # Sliced, not masked to -inf: every consumer (argmax, sampling, the tree's top-k and logsumexp)
  # then sees exactly V and needs no mask of its own. On a mesh the slice moves no data: the
  # padded width is the next multiple of the vocab axis, so GSPMD's uneven split of the V
  # columns has the padded split's shard boundaries (only the last shard is shorter).
  return logits[..., :params.vocab]


def causal_mask(lens, t: int):
  """[B, T, T] causal mask among T new tokens, key j visible only if j < lens[b] (padding)."""
  i = jnp.arange(t)
  return (i[None, :, None] >= i[None, None, :]) & (i[None, None, :] < lens[:, None, None])


def init_params(cfg: ModelConfig, key, dtype=jnp.bfloat16, std: float = 0.02,
                experts: str = "float", held_experts: int | None = None) -> Params:
  """Random weights (benchmarks and tests); norms near 1; routed experts in `experts` format
  ("float", "int4" or "fp8"), the first `held_experts` of them only when given
  (`moe.init_params`)."""
  h, n, k, d, i = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
  keys = iter(jax.random.split(key, 9 * cfg.num_layers + 3))
  w = lambda *shape: random_weight(next(keys), shape, dtype, std)
  ones = lambda m: jnp.ones((m,), dtype)

  def mlp(layer):
    if not cfg.is_moe(layer):
      return dict(w_gate_up=w(h, 2, i), w_down=w(i, h))
    shared = cfg.shared_width
    gate = dict(shared_gate=w(h)) if cfg.shared_expert_size else {}
    return dict(w_gate_up=w(h, 2, shared) if shared else None,
                w_down=w(shared, h) if shared else None, **gate, moe=moe_lib.init_params(
        jax.random.fold_in(key, 1 << 20 | layer), h, cfg.num_experts, cfg.moe_intermediate_size,
        dtype, std, bias=cfg.scoring_func == "sigmoid", experts=experts, held=held_experts,
        biases=cfg.moe_bias, swiglu_clamp=cfg.swiglu_clamp))

  def extras(layer):  # gpt-oss's biases and sinks (drawn apart: other streams unchanged)
    kb = iter(jax.random.split(jax.random.fold_in(key, 1 << 23 | layer), 4))
    b = lambda *shape: random_weight(next(kb), shape, dtype, std)
    out = dict(bq=b(n, d), bkv=b(2, k, d), bo=b(h)) if cfg.attention_bias else {}
    return dict(out, sinks=b(n)) if cfg.attention_sinks else out

  def attention(layer):
    if cfg.is_recurrent(layer):
      return dict(wq=None, wkv=None, wo=None, q_norm=None, k_norm=None, gdn=gdn_lib.init_params(
          cfg.gdn, h, jax.random.fold_in(key, 1 << 22 | layer), dtype, std))
    gate = dict(wq_gate=w(h, n, d)) if cfg.attn_output_gate else {}
    if cfg.is_mla:
      return dict(wq=None, wkv=None, wo=None, q_norm=None, k_norm=None, mla=mla_lib.init_params(
          cfg, jax.random.fold_in(key, 1 << 21 | layer), dtype, std))
    return dict(wq=w(h, n, d), wkv=w(h, 2, k, d), wo=w(n, d, h),
                q_norm=ones(d) if cfg.qk_norm else None, k_norm=ones(d) if cfg.qk_norm else None,
                **gate, **extras(layer))
  layers = [LayerParams(input_norm=ones(h), post_norm=ones(h), **attention(layer), **mlp(layer))
            for layer in range(cfg.num_layers)]
  return Params(embed=w(cfg.vocab_size, h), layers=layers, final_norm=ones(h),
                lm_head=None if cfg.tie_word_embeddings else w(h, cfg.vocab_size))


def param_bytes(params) -> int:
  return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params)))
