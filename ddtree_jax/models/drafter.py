"""DFlash block-diffusion drafter (arXiv 2602.06036), as pure functions.

Context: taps of the target's `target_layer_ids` (residual outputs), concatenated -> fc ->
hidden_norm, then in EVERY layer the layer's own k_proj/v_proj (+ k_norm, RoPE at the token's
position) give context K/V rows, kept in a per-layer cache that grows by the accepted tokens.
Block: target embeddings of [bonus, MASK x (bs-1)] at positions start..start+bs-1, queries from the
block only, non-causal over [context; block]. Output slot j (1..bs-1) is the distribution of the
token AT position start+j: the drafter's final norm, then the target's lm_head. RoPE, for the
context rows and the block rows alike, is the drafter's own (`DrafterConfig.layers`: its rope_type,
inv_freq and YaRN attention factor on cos / sin), never the target's: a Kimi drafter's Qwen3
layers use YaRN of their own beside the target's MLA rope.

`quantize_int8` makes an int8 drafter (its matrices but o, its own int8 copy of the lm_head and its
layers' k/v weights stacked for the context rows, run as int8 x int8 GEMMs by `dense`):
half the bytes a draft reads. `restrict_vocab` gives the drafter its own lm_head over a subset
of the vocabulary (e.g. the most frequent tokens, as FR-Spec and EAGLE-3 draft): its logits and
the tree's top-k cover the subset only, and the step maps the tree's tokens back to vocabulary
ids (`DrafterParams.draft_vocab`). Only the drafts change; the output is still the target's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import PartitionSpec as P

from ddtree_jax import kernels as kernels_lib
from ddtree_jax.models import attention
from ddtree_jax.models import decoder
from ddtree_jax.models.config import ModelConfig
from ddtree_jax.models.ops import (Int8Weight, apply_rope, dense, quantize_int8 as quantize_weight,
                                   rms_norm, rope_tables, weight_spec)

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
  layers: ModelConfig             # the drafter's decoder layers (num_layers = depth) and RoPE
  block_size: int
  mask_token_id: int
  target_layer_ids: tuple[int, ...]

  @property
  def num_drafts(self) -> int:
    """L = bs - 1 draft positions per block."""
    return self.block_size - 1

  # The decode loop talks to a drafter only through these methods (tests plug in oracles).
  def draft(self, params, target_params, cache, bonus,
            kernels: kernels_lib.Kernels = kernels_lib.REFERENCE):
    return draft_logits(params, self, target_params, cache, bonus, kernels)

  def context(self, params, taps, positions):
    return context_kv(params, self, taps, positions)

  def vocab(self, params):
    """The vocabulary id of each of `draft`'s logits (int32 [Vd]), or None: all ids, in order."""
    return params.draft_vocab


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DrafterParams:
  fc: Array                       # [k*H, H]
  hidden_norm: Array              # [H]
  layers: list[decoder.LayerParams]
  final_norm: Array               # [H]
  # [H, V] own copy of the target's (None: share it), int8 after quantize_int8; [H, Vd] over the
  # draft_vocab ids when that is set
  lm_head: Array | Int8Weight | None = None
  # int8 drafters: every layer's wkv stacked, [H, L, 2, K, D], for the context rows' one k/v GEMM
  # (XLA merges the per-layer GEMMs anyway, but for int8 weights it copied them together first).
  context_wkv: Int8Weight | None = None
  draft_vocab: Array | None = None  # int32 [Vd]: the id of each lm_head column (restrict_vocab)

  def partition_specs(self, axes) -> DrafterParams:
    """As the target's layers, and fc split on its output columns only when the layers' kv
    heads split: its output feeds their k/v projections, and with those replicated a split fc
    output made GSPMD split the drafter's residual stream over H (many more collectives per
    drafter layer: experiments/perf/collectives.py). A draft vocabulary that the vocab axis does
    not divide leaves the drafter's own lm_head replicated."""
    fc = axes("fc", self.fc.shape[1], "drafter fc output (hidden_size)")
    if axes("kv_heads", self.layers[0].wkv.shape[2], "drafter kv heads") is None:
      fc = None
    head = self.lm_head
    if head is not None:
      vd = head.shape[1]
      split = self.draft_vocab is None or axes.divides("vocab", vd)
      head = weight_spec(head, None, axes("vocab", vd, "drafter lm_head vocab") if split else None)
    ctx = self.context_wkv
    if ctx is not None:
      ctx = weight_spec(ctx, None, None, None, axes("kv_heads", ctx.shape[3], "drafter kv heads"),
                        None)
    return DrafterParams(fc=weight_spec(self.fc, None, fc), hidden_norm=P(),
                         layers=[l.partition_specs(axes) for l in self.layers], final_norm=P(),
                         lm_head=head, context_wkv=ctx,
                         draft_vocab=None if self.draft_vocab is None else P())

  def pad_vocab(self, multiple: int, pad) -> DrafterParams:
    """An own lm_head over the whole vocabulary [H, V] zero-padded to the next multiple of
    `multiple`, as the target's (`decoder.Params.pad_vocab`; `draft_logits` slices the padding
    off); a draft vocabulary's head [H, Vd] is left as it is (replicated where Vd does not
    divide). pad(x, axis, size): x zero-padded to `size` along `axis`."""
    head = self.lm_head
    if head is None or self.draft_vocab is not None or head.shape[1] % multiple == 0:
      return self
    size = -(-head.shape[1] // multiple) * multiple
    if isinstance(head, Int8Weight):  # q [V, H], scale [V]
      head = Int8Weight(q=pad(head.q, 0, size), scale=pad(head.scale, 0, size))
    else:
      head = pad(head, 1, size)
    return dataclasses.replace(self, lm_head=head)


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
  ctx = rms_norm(dense("bri,ih->brh", x, params.fc), params.hidden_norm, lc.rms_norm_eps)
  cos, sin = rope_tables(lc, positions, ctx.dtype)
  if params.context_wkv is None:
    kv = [attention.project_kv(layer, lc, ctx, cos, sin) for layer in params.layers]
  else:
    stacked = dense("brh,hlskd->brlskd", ctx, params.context_wkv)
    b, r, n_layers, _, kh, d = stacked.shape
    k, v = stacked[:, :, :, 0], stacked[:, :, :, 1]  # [B, R, L, K, D]
    if params.layers[0].k_norm is not None:  # every layer's k norm at once: one kernel
      k = rms_norm(k, jnp.stack([l.k_norm for l in params.layers])[:, None], lc.rms_norm_eps)
    k = apply_rope(k.reshape(b, r, n_layers * kh, d), cos, sin).reshape(k.shape)
    return [k[:, :, i] for i in range(n_layers)], [v[:, :, i] for i in range(n_layers)]
  return [k for k, _ in kv], [v for _, v in kv]


def draft_logits(params: DrafterParams, cfg: DrafterConfig, target_params: decoder.Params,
                 cache: decoder.KVCache, bonus,
                 kernels: kernels_lib.Kernels = kernels_lib.REFERENCE):
  """One block of drafts. cache: drafter context K/V with lens = committed length (= block start);
  bonus [B] int32. Returns float32 logits [B, bs-1, V] for positions start+1..start+bs-1 (over
  params.draft_vocab's Vd ids instead when that is set); the columns of a padded vocabulary
  past V are sliced off, as `decoder.lm_head` does."""
  lc, bs = cfg.layers, cfg.block_size
  b = bonus.shape[0]
  block = jnp.concatenate([bonus[:, None].astype(jnp.int32),
                           jnp.full((b, bs - 1), cfg.mask_token_id, jnp.int32)], axis=1)
  x = kernels.embed(target_params.embed, block).astype(params.hidden_norm.dtype)
  positions = cache.lens[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
  cos, sin = rope_tables(lc, positions, x.dtype)
  full = jnp.ones((b, bs, bs), bool)
  hidden, _, _ = decoder.decoder_stack(params.layers, lc, x, params.final_norm, cos, sin,
                                       cache.k, cache.v, cache.lens, full, kernels,
                                       positions=positions)
  hidden = hidden[:, 1:]
  if params.lm_head is not None:
    logits = dense("bjh,hv->bjv", hidden, params.lm_head, jnp.float32)
    return logits if params.draft_vocab is not None else logits[..., :target_params.vocab]
  return decoder.lm_head(target_params, hidden.astype(target_params.embed.dtype))


def quantize_int8(params: DrafterParams, target_params: decoder.Params) -> DrafterParams:
  """Int8 drafter: fc and every layer's q, k/v, gate/up and down, per output channel, plus an
  int8 lm_head that only the drafter reads (its own head if it has one, e.g. [H, Vd] after
  restrict_vocab, else a copy of the target's [H, V], padding included, from the tied embedding
  when there is no lm_head), and its layers' k/v weights stacked for the context rows
  (`context_wkv`). Norms stay in their dtype; `dense` quantizes each GEMM's input rows on the
  fly (W8A8), everything between the GEMMs stays in the params' dtype. o stays in the params'
  dtype too: its bf16 GEMM is as fast at draft rows, and its input then needs no row max and
  int8 rounding of its own (docs/findings/gemms-and-the-int8-drafter.md)."""
  q = quantize_weight
  layers = [dataclasses.replace(l, wq=q(l.wq), wkv=q(l.wkv), w_gate_up=q(l.w_gate_up),
                                w_down=q(l.w_down)) for l in params.layers]
  head = params.lm_head if params.lm_head is not None else _target_head(target_params)
  if not isinstance(head, Int8Weight):
    head = q(head)
  ctx = Int8Weight(q=jnp.stack([l.wkv.q for l in layers]),      # [L, 2, K, D, H]
                         scale=jnp.stack([l.wkv.scale for l in layers]))
  return dataclasses.replace(params, fc=q(params.fc), layers=layers, lm_head=head,
                             context_wkv=ctx)


def _target_head(target_params: decoder.Params):
  """The target's lm_head as [H, V] (the tied embedding transposed when it has none)."""
  return target_params.embed.T if target_params.lm_head is None else target_params.lm_head


def frequent_tokens(tokens, size: int, vocab_size: int) -> np.ndarray:
  """The `size` most frequent ids of a token stream (any int array), most frequent first, ties
  to the lower id: a draft vocabulary for `restrict_vocab` counted on the user's own text."""
  if not 1 <= size <= vocab_size:
    raise ValueError(f"frequent_tokens: size {size} must be in [1, vocab_size={vocab_size}]")
  ids = np.asarray(tokens).reshape(-1)
  if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
    raise ValueError(f"frequent_tokens: token ids must be in [0, {vocab_size})")
  counts = np.bincount(ids, minlength=vocab_size)
  return np.argsort(-counts, kind="stable")[:size].astype(np.int32)


def restrict_vocab(params: DrafterParams, target_params: decoder.Params, vocab) -> DrafterParams:
  """Drafts over the vocabulary ids `vocab` [Vd] only: the drafter gets its own lm_head [H, Vd]
  (those columns of its current head: its int8 copy, or the target's), so a draft's head GEMM and
  the tree's top-k read Vd / V of the bytes. Tokens outside `vocab` are never drafted; the target
  still verifies every node, so the output is unchanged (lossless) and only acceptance changes
  (usually down; the freed budget goes to the kept ids). Apply before or after quantize_int8
  (the int8 copy is quantized per column, so both orders give the same weights). On a tp mesh a
  Vd that the vocab axis does not divide leaves the drafter's head replicated."""
  v = target_params.vocab
  ids = np.asarray(vocab)
  if ids.ndim != 1:
    raise ValueError(f"restrict_vocab: vocab must be 1-D, got shape {ids.shape}")
  if not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"restrict_vocab: vocab must hold int ids, got {ids.dtype}")
  if ids.size == 0:
    raise ValueError("restrict_vocab: vocab is empty")
  if ids.min() < 0 or ids.max() >= v:
    raise ValueError(f"restrict_vocab: vocab ids must be in [0, {v}), got {ids.min()}..{ids.max()}")
  if len(np.unique(ids)) != len(ids):
    raise ValueError("restrict_vocab: vocab ids must be distinct")
  if params.draft_vocab is not None:
    raise ValueError("restrict_vocab: this drafter's vocabulary is already restricted")
  vocab = jnp.asarray(ids, jnp.int32)
  head = params.lm_head if params.lm_head is not None else _target_head(target_params)
  if isinstance(head, Int8Weight):  # q [V, H], scale [V]
    head = Int8Weight(q=head.q[vocab], scale=head.scale[vocab])
  else:
    head = head[:, vocab]
  return dataclasses.replace(params, lm_head=head, draft_vocab=vocab)
