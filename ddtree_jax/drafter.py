"""DFlash block-diffusion drafter (arXiv 2602.06036), as pure functions.

Context: taps of the target's `target_layer_ids` (residual outputs), concatenated -> fc ->
hidden_norm, then in EVERY layer the layer's own k_proj/v_proj (+ k_norm, RoPE at the token's
position) give context K/V rows, kept in a per-layer cache that grows by the accepted tokens.
Block: target embeddings of [bonus, MASK x (bs-1)] at positions start..start+bs-1, queries from the
block only, non-causal over [context; block]. Output slot j (1..bs-1) is the distribution of the
token AT position start+j: the drafter's final norm, then the target's lm_head.

`quantize_int8` makes an int8 drafter (its matrices, its own int8 copy of the lm_head and its
layers' k/v weights stacked for the context rows, run as int8 x int8 GEMMs by `model.dense`):
half the bytes a draft reads. Only the drafts change; the output is still the target's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ddtree_jax import model
from ddtree_jax.attention import attend_xla
from ddtree_jax.config import ModelConfig

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
  layers: ModelConfig             # shapes of the drafter's decoder layers (num_layers = depth)
  block_size: int
  mask_token_id: int
  target_layer_ids: tuple[int, ...]

  @property
  def num_drafts(self) -> int:
    """L = bs - 1 draft positions per block."""
    return self.block_size - 1

  # The decode loop talks to a drafter only through these two methods (tests plug in oracles).
  def draft(self, params, target_params, cache, bonus, attn_fn=attend_xla,
            embed_fn=model.embed_lookup):
    return draft_logits(params, self, target_params, cache, bonus, attn_fn, embed_fn)

  def context(self, params, taps, positions):
    return context_kv(params, self, taps, positions)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DrafterParams:
  fc: Array                       # [k*H, H]
  hidden_norm: Array              # [H]
  layers: list[model.LayerParams]
  final_norm: Array               # [H]
  lm_head: model.Int8Weight | None = None  # [H, V] own int8 copy of the target's (None: share it)
  # int8 drafters: every layer's wkv stacked, [H, L, 2, K, D], for the context rows' one k/v GEMM.
  # XLA merges the per-layer context GEMMs (one shared input) into one anyway, and for int8
  # weights it first concatenated them: a 42 MB copy per step at Qwen3-8B (51 us on the H200).
  context_wkv: model.Int8Weight | None = None


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
  """The published default: n ids spread evenly over [1, L - 3]."""
  if num_draft_layers == 1:
    return (num_target_layers // 2,)
  span = num_target_layers - 4
  return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


def context_kv(params: DrafterParams, cfg: DrafterConfig, taps, positions):
  """Fused context rows -> per-layer K/V. taps [B, R, k*H], positions [B, R] -> lists [B, R, K, D]."""
  lc = cfg.layers
  x = taps.astype(params.hidden_norm.dtype)
  ctx = model.rms_norm(model.dense("bri,ih->brh", x, params.fc), params.hidden_norm, lc.rms_norm_eps)
  cos, sin = model.rope_tables(lc, positions, ctx.dtype)
  if params.context_wkv is None:
    kv = [model.project_kv(layer, lc, ctx, cos, sin) for layer in params.layers]
  else:
    stacked = model.dense("brh,hlskd->brlskd", ctx, params.context_wkv)
    kv = [model.kv_rows(layer, lc, stacked[:, :, i], cos, sin)
          for i, layer in enumerate(params.layers)]
  return [k for k, _ in kv], [v for _, v in kv]


def draft_logits(params: DrafterParams, cfg: DrafterConfig, target_params: model.Params,
                 cache: model.KVCache, bonus, attn_fn=attend_xla, embed_fn=model.embed_lookup):
  """One block of drafts. cache: drafter context K/V with lens = committed length (= block start);
  bonus [B] int32. Returns float32 logits [B, bs-1, V] for positions start+1..start+bs-1."""
  lc, bs = cfg.layers, cfg.block_size
  b = bonus.shape[0]
  block = jnp.concatenate([bonus[:, None].astype(jnp.int32),
                           jnp.full((b, bs - 1), cfg.mask_token_id, jnp.int32)], axis=1)
  x = embed_fn(target_params.embed, block).astype(params.hidden_norm.dtype)
  positions = cache.lens[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
  cos, sin = model.rope_tables(lc, positions, x.dtype)
  full = jnp.ones((b, bs, bs), bool)
  for i, layer in enumerate(params.layers):
    x, _, _ = model.attention_block(layer, lc, x, cos, sin, cache.k, cache.v, cache.lens,
                                    full, attn_fn, cache_layer=i)
    x = model.mlp_block(layer, lc, x)
  hidden = model.rms_norm(x[:, 1:], params.final_norm, lc.rms_norm_eps)
  if params.lm_head is not None:
    return model.dense("bjh,hv->bjv", hidden, params.lm_head, jnp.float32)
  return model.lm_head(target_params, hidden.astype(target_params.embed.dtype))


def quantize_int8(params: DrafterParams, target_params: model.Params) -> DrafterParams:
  """Int8 drafter: fc and every layer's matrices, per output channel, plus an int8 copy of the
  target's lm_head ([H, V], from the tied embedding when there is no lm_head) that only the
  drafter reads, and its layers' k/v weights stacked for the context rows (`context_wkv`).
  Norms stay in their dtype; `model.dense` quantizes each GEMM's input rows on the fly (W8A8),
  everything between the GEMMs stays in the params' dtype."""
  q = model.quantize_int8
  layers = [dataclasses.replace(l, wq=q(l.wq), wkv=q(l.wkv), wo=q(l.wo, 2), w_gate_up=q(l.w_gate_up),
                                w_down=q(l.w_down)) for l in params.layers]
  head = target_params.embed.T if target_params.lm_head is None else target_params.lm_head
  ctx = model.Int8Weight(q=jnp.stack([l.wkv.q for l in layers]),      # [L, 2, K, D, H]
                         scale=jnp.stack([l.wkv.scale for l in layers]))
  return dataclasses.replace(params, fc=q(params.fc), layers=layers, lm_head=q(head),
                             context_wkv=ctx)
