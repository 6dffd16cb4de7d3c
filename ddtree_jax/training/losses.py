"""The losses of the bundled default pair: the target LM loss and the DFlash drafter loss (the
loop that trains with them is `loop.train`).

Both losses run the engine's own pure functions (`decoder.forward`, `decoder.decoder_stack`,
`drafter.context_kv`), so what is trained is the math that decodes. The only training-specific
piece is `block_attention`: every anchor's block attends to the context rows before its anchor and
to its own block rows, which lets one forward train hundreds of blocks per sequence (the DFlash
recipe, docs/design.md §2).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from ddtree_jax.models import drafter as drafter_lib
from ddtree_jax.models import ops
from ddtree_jax import kernels as kernels_lib
from ddtree_jax.models import decoder
from ddtree_jax.models.attention import NEG_INF
from ddtree_jax.models.ops import einsum_f32
from ddtree_jax.models.config import ModelConfig

Array = jax.Array


def cast(tree, dtype):
  """Floating leaves to `dtype` (mixed precision: float32 master weights, low-precision math)."""
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      tree)


# ------------------------------------------------------------------------------------- target


def cross_entropy(logits, labels):
  """Per-position cross-entropy (float32) of logits [..., V] against int labels [...]."""
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)


def target_hidden(params: decoder.Params, cfg: ModelConfig, tokens, tap_layers=()):
  """Causal forward of [B, T] tokens at positions 0..T-1 through `decoder.forward` (empty cache)."""
  b, t = tokens.shape
  cache = decoder.init_target_cache(cfg, b, 0, params.embed.dtype)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  hidden, _, taps = decoder.forward(params, cfg, tokens, positions, cache,
                                    decoder.causal_mask(jnp.full((b,), t, jnp.int32), t),
                                    tuple(tap_layers), chain=True)
  return hidden, taps


def target_loss(params, frozen, batch, *, cfg: ModelConfig, compute_dtype):
  """Next-token loss of windows batch["tokens"] [B, T+1]. Returns (mean loss, metrics)."""
  del frozen
  tokens = batch["tokens"]
  hidden, _ = target_hidden(cast(params, compute_dtype), cfg, tokens[:, :-1])
  logits = decoder.lm_head(cast(params, compute_dtype), hidden)
  ce = cross_entropy(logits, tokens[:, 1:])
  acc = jnp.mean((jnp.argmax(logits, -1) == tokens[:, 1:]).astype(jnp.float32))
  return jnp.mean(ce), {"accuracy": acc}


# ------------------------------------------------------------------------------------ drafter


def init_drafter_params(dcfg: drafter_lib.DrafterConfig, key, std: float = 0.02,
                        final_norm=None):
  """Random float32 drafter weights (layers as `decoder.init_params`, norms at 1). `final_norm`
  (e.g. the target's final norm weight) starts the output on the target lm_head's scale."""
  lc = dcfg.layers
  k_fc, k_layers = jax.random.split(key)
  layers = decoder.init_params(lc, k_layers, jnp.float32, std).layers
  h = lc.hidden_size
  fc = std * jax.random.normal(k_fc, (len(dcfg.target_layer_ids) * h, h), jnp.float32)
  final = (jnp.ones((h,), jnp.float32) if final_norm is None
           else jnp.array(final_norm, jnp.float32).reshape(h))  # a copy: the state is donated
  return drafter_lib.DrafterParams(fc=fc, hidden_norm=jnp.ones((h,), jnp.float32), layers=layers,
                                   final_norm=final)


def block_attention(q, k_ctx, v_ctx, anchors, k_blk, v_blk, new_mask, *, scale, block_size):
  """Attention of many DFlash blocks at once (same math as `attend_xla` for one block).

  q: [B, A*bs, N, D] block queries, block r//bs anchored at anchors[:, r//bs];
  k_ctx, v_ctx: [B, S, K, D] context K/V of every position 0..S-1 of the sequence;
  anchors: [B, A] int32; k_blk, v_blk: [B, A*bs, K, D]; new_mask: unused (blocks are
  bidirectional). A block sees context rows p < anchor and all rows of its own block, nothing else.
  """
  del new_mask
  b, t, hq, d = q.shape
  s, hkv = k_ctx.shape[1], k_ctx.shape[2]
  g, a, bs = hq // hkv, t // block_size, block_size
  qg = q.reshape(b, a, bs, hkv, g, d)
  kb = k_blk.reshape(b, a, bs, hkv, d)
  vb = v_blk.reshape(b, a, bs, hkv, d)
  s_ctx = einsum_f32("bajkgd,bskd->bkgajs", qg, k_ctx)
  s_blk = einsum_f32("bajkgd,baikd->bkgaji", qg, kb)
  ok = jnp.arange(s)[None, None, :] < anchors[:, :, None]                 # [B, A, S]
  s_ctx = jnp.where(ok[:, None, None, :, None, :], s_ctx * scale, NEG_INF)
  probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk * scale], axis=-1), axis=-1).astype(q.dtype)
  out = (einsum_f32("bkgajs,bskd->bajkgd", probs[..., :s], v_ctx)
         + einsum_f32("bkgaji,baikd->bajkgd", probs[..., s:], vb))
  return out.reshape(b, t, hq, d).astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class BlockKernels(kernels_lib.Kernels):
  """The reference kernels with `block_attention` for the attention (many blocks at once)."""
  block_size: int = 16

  @functools.cached_property
  def attend(self):
    return functools.partial(block_attention, block_size=self.block_size)


def drafter_block_logits(dparams: drafter_lib.DrafterParams, dcfg: drafter_lib.DrafterConfig,
                         tparams: decoder.Params, taps, tokens, anchors):
  """Drafter logits of every block: float32 [B, A, bs-1, V]; slot k predicts x_{anchor+k}.

  taps [B, S, k*H]: the target's tap features of tokens [B, S]; anchors [B, A] int32 (each block
  is [x_a, MASK x (bs-1)] at positions a..a+bs-1 and sees the context rows p < a).
  """
  if dparams.lm_head is not None:
    raise ValueError("a drafter with its own lm_head (int8, or a restricted draft vocabulary) is "
                     "for inference: train the float drafter, then derive it")
  lc, bs = dcfg.layers, dcfg.block_size
  if any(lc.window(i) for i in range(lc.num_layers)):
    raise ValueError("training drafters with sliding-window layers is not implemented here")
  b, s = tokens.shape
  a = anchors.shape[1]
  ck, cv = drafter_lib.context_kv(dparams, dcfg, taps,
                                  jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)))
  first = jnp.take_along_axis(tokens, anchors, axis=1)                       # [B, A]
  block = jnp.concatenate([first[..., None], jnp.full((b, a, bs - 1), dcfg.mask_token_id,
                                                      tokens.dtype)], axis=-1)
  x = tparams.embed[block.reshape(b, a * bs)].astype(dparams.hidden_norm.dtype)
  positions = (anchors[..., None] + jnp.arange(bs, dtype=jnp.int32)).reshape(b, a * bs)
  cos, sin = ops.rope_tables(lc, positions, x.dtype)
  hidden, _, _ = decoder.decoder_stack(dparams.layers, lc, x, dparams.final_norm, cos, sin, ck, cv,
                                       anchors, None, BlockKernels(block_size=bs))
  hidden = hidden.reshape(b, a, bs, -1)[:, :, 1:]
  return decoder.lm_head(tparams, hidden.astype(tparams.embed.dtype))


def tap_features(tparams, tcfg: ModelConfig, batch, tap_layers):
  """The target's features [B, S, k*H] at `tap_layers` for batch["tokens"]: captured at
  regeneration (batch["features"], `training/capture.py`), or by a forward of the target."""
  if "features" in batch:
    return batch["features"]
  return target_hidden(tparams, tcfg, batch["tokens"], tap_layers)[1]


def slot_weights(block_size: int, gamma: float):
  """w_k = exp(-(k-1)/gamma), k = 1..bs-1."""
  return jnp.exp(-jnp.arange(block_size - 1, dtype=jnp.float32) / gamma)


def drafter_runs(dparams, tparams, batch, *, dcfg, tcfg: ModelConfig, compute_dtype):
  """Leading correct greedy drafts of every block: int32 [B, A] (0..bs-1)."""
  tokens, lens, anchors = batch["tokens"], batch["lens"], batch["anchors"]
  tp = cast(tparams, compute_dtype)
  taps = tap_features(tp, tcfg, batch, dcfg.target_layer_ids)
  logits = drafter_block_logits(cast(dparams, compute_dtype), dcfg, tp, taps, tokens, anchors)
  pos = anchors[..., None] + jnp.arange(1, dcfg.block_size, dtype=jnp.int32)
  labels = jnp.take_along_axis(tokens, jnp.minimum(pos, tokens.shape[1] - 1).reshape(
      tokens.shape[0], -1), axis=1).reshape(pos.shape)
  correct = (jnp.argmax(logits, -1) == labels) & (pos < lens[:, None, None])
  return jnp.sum(jnp.cumprod(correct.astype(jnp.int32), axis=-1), axis=-1)


def simulate_chain(runs, anchors, anchor_ok, lens) -> tuple[int, int]:
  """Replays chain decoding (T=0) over target-generated sequences from per-anchor runs: the
  first block starts at the first anchor (the first generated token), a step at block start a
  commits run(a) + 1 tokens and the next block starts after them. Exact for the chain method
  when every anchor is evaluated (drafts at a depend only on tokens <= a), up to blocks cut by
  the sequence end. Returns (committed tokens, steps); a walk stops at an anchor not evaluated."""
  tokens = steps = 0
  for r, a, ok, n in zip(runs, anchors, anchor_ok, lens):
    table = {int(x): int(y) for x, y, v in zip(a, r, ok) if v}
    if not table:
      continue
    pos = min(table)
    while pos <= int(n) - 2 and pos in table:
      steps += 1
      tokens += table[pos] + 1
      pos += table[pos] + 1
  return tokens, steps


def drafter_loss(dparams, tparams, batch, *, dcfg, tcfg: ModelConfig, gamma: float,
                 compute_dtype):
  """Weighted block cross-entropy through the frozen target (docs/design.md §2).

  batch: tokens [B, S] (prompt + target continuation, right-padded), lens [B] true lengths,
  anchors [B, A], anchor_ok [B, A], optionally features [B, S, k*H] (`tap_features`). Returns (loss, metrics) with the per-slot accuracy and
  `tau_est`, 1 + the mean number of leading correct greedy drafts per block (a chain-tau estimate).
  """
  tokens, lens = batch["tokens"], batch["lens"]
  anchors, anchor_ok = batch["anchors"], batch["anchor_ok"]
  bs = dcfg.block_size
  tp = cast(tparams, compute_dtype)
  taps = jax.lax.stop_gradient(tap_features(tp, tcfg, batch, dcfg.target_layer_ids))
  logits = drafter_block_logits(cast(dparams, compute_dtype), dcfg, jax.lax.stop_gradient(tp),
                                taps, tokens, anchors)
  pos = anchors[..., None] + jnp.arange(1, bs, dtype=jnp.int32)              # [B, A, bs-1]
  s = tokens.shape[1]
  labels = jnp.take_along_axis(tokens, jnp.minimum(pos, s - 1).reshape(tokens.shape[0], -1),
                               axis=1).reshape(pos.shape)
  ok = anchor_ok[..., None] & (pos < lens[:, None, None])
  w = slot_weights(bs, gamma)[None, None] * ok
  ce = cross_entropy(logits, labels)
  loss = jnp.sum(w * ce) / jnp.maximum(jnp.sum(w), 1e-9)
  correct = (jnp.argmax(logits, -1) == labels) & ok
  run = jnp.sum(jnp.cumprod(correct.astype(jnp.int32), axis=-1), axis=-1)   # [B, A]
  nblocks = jnp.maximum(jnp.sum(anchor_ok), 1)
  metrics = {
      "tau_est": 1.0 + jnp.sum(run * anchor_ok) / nblocks,
      "acc_slot1": jnp.sum(correct[..., 0]) / jnp.maximum(jnp.sum(ok[..., 0]), 1),
      "acc": jnp.sum(correct) / jnp.maximum(jnp.sum(ok), 1),
  }
  return loss, metrics
