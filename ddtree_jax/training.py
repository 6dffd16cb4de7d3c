"""Training of the bundled default pair: the target LM loss, the DFlash drafter loss, and one
generic loop (AdamW + warmup/cosine, clipping, orbax checkpoints with exact resume).

Both losses run the engine's own pure functions (`model.forward`, `model.attention_block`,
`model.mlp_block`, `drafter.context_kv`), so what is trained is the math that decodes. The only
training-specific piece is `block_attention`: every anchor's block attends to the context rows
before its anchor and to its own block rows, which lets one forward train hundreds of blocks per
sequence (the DFlash recipe, DESIGN.md section 2).
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddtree_jax import drafter as drafter_lib
from ddtree_jax import model
from ddtree_jax.attention import NEG_INF, einsum_f32
from ddtree_jax.config import ModelConfig

Array = jax.Array


def cast(tree, dtype):
  """Floating leaves to `dtype` (mixed precision: float32 master weights, low-precision math)."""
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      tree)


# ------------------------------------------------------------------------------------- target


def cross_entropy(logits, labels):
  """Per-position cross-entropy (float32) of logits [..., V] against int labels [...]."""
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)


def target_hidden(params: model.Params, cfg: ModelConfig, tokens, tap_layers=()):
  """Causal forward of [B, T] tokens at positions 0..T-1 through `model.forward` (empty cache)."""
  b, t = tokens.shape
  cache = model.init_cache(cfg.num_layers, b, cfg.num_kv_heads, 0, cfg.head_dim,
                           params.embed.dtype)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  hidden, _, _, taps = model.forward(params, cfg, tokens, positions, cache,
                                     model.causal_mask(jnp.full((b,), t, jnp.int32), t),
                                     tuple(tap_layers))
  return hidden, taps


def target_loss(params, frozen, batch, *, cfg: ModelConfig, compute_dtype):
  """Next-token loss of windows batch["tokens"] [B, T+1]. Returns (mean loss, metrics)."""
  del frozen
  tokens = batch["tokens"]
  hidden, _ = target_hidden(cast(params, compute_dtype), cfg, tokens[:, :-1])
  logits = model.lm_head(cast(params, compute_dtype), hidden)
  ce = cross_entropy(logits, tokens[:, 1:])
  acc = jnp.mean((jnp.argmax(logits, -1) == tokens[:, 1:]).astype(jnp.float32))
  return jnp.mean(ce), {"accuracy": acc}


# ------------------------------------------------------------------------------------ drafter


def init_drafter_params(dcfg: drafter_lib.DrafterConfig, key, std: float = 0.02,
                        final_norm=None):
  """Random float32 drafter weights (layers as `model.init_params`, norms at 1). `final_norm`
  (e.g. the target's final norm weight) starts the output on the target lm_head's scale."""
  lc = dcfg.layers
  k_fc, k_layers = jax.random.split(key)
  layers = model.init_params(lc, k_layers, jnp.float32, std).layers
  h = lc.hidden_size
  fc = std * jax.random.normal(k_fc, (len(dcfg.target_layer_ids) * h, h), jnp.float32)
  final = (jnp.ones((h,), jnp.float32) if final_norm is None
           else jnp.asarray(final_norm, jnp.float32).reshape(h))
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


def drafter_block_logits(dparams: drafter_lib.DrafterParams, dcfg: drafter_lib.DrafterConfig,
                         tparams: model.Params, taps, tokens, anchors):
  """Drafter logits of every block: float32 [B, A, bs-1, V]; slot k predicts x_{anchor+k}.

  taps [B, S, k*H]: the target's tap features of tokens [B, S]; anchors [B, A] int32 (each block
  is [x_a, MASK x (bs-1)] at positions a..a+bs-1 and sees the context rows p < a).
  """
  if dparams.lm_head is not None:
    raise ValueError("a drafter with its own lm_head (int8, or a restricted draft vocabulary) is "
                     "for inference: train the float drafter, then derive it")
  lc, bs = dcfg.layers, dcfg.block_size
  b, s = tokens.shape
  a = anchors.shape[1]
  ck, cv = drafter_lib.context_kv(dparams, dcfg, taps,
                                  jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)))
  first = jnp.take_along_axis(tokens, anchors, axis=1)                       # [B, A]
  block = jnp.concatenate([first[..., None], jnp.full((b, a, bs - 1), dcfg.mask_token_id,
                                                      tokens.dtype)], axis=-1)
  x = tparams.embed[block.reshape(b, a * bs)].astype(dparams.hidden_norm.dtype)
  positions = (anchors[..., None] + jnp.arange(bs, dtype=jnp.int32)).reshape(b, a * bs)
  cos, sin = model.rope_tables(lc, positions, x.dtype)
  attn = functools.partial(block_attention, block_size=bs)
  hidden, _, _, _ = model.decoder_stack(dparams.layers, lc, x, dparams.final_norm, cos, sin, ck, cv,
                                        anchors, None, attn)
  hidden = hidden.reshape(b, a, bs, -1)[:, :, 1:]
  return model.lm_head(tparams, hidden.astype(tparams.embed.dtype))


def slot_weights(block_size: int, gamma: float):
  """w_k = exp(-(k-1)/gamma), k = 1..bs-1."""
  return jnp.exp(-jnp.arange(block_size - 1, dtype=jnp.float32) / gamma)


def drafter_runs(dparams, tparams, batch, *, dcfg, tcfg: ModelConfig, compute_dtype):
  """Leading correct greedy drafts of every block: int32 [B, A] (0..bs-1)."""
  tokens, lens, anchors = batch["tokens"], batch["lens"], batch["anchors"]
  tp = cast(tparams, compute_dtype)
  _, taps = target_hidden(tp, tcfg, tokens, dcfg.target_layer_ids)
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
  """Weighted block cross-entropy through the frozen target (DESIGN.md section 2).

  batch: tokens [B, S] (prompt + target continuation, right-padded), lens [B] true lengths,
  anchors [B, A], anchor_ok [B, A]. Returns (loss, metrics) with the per-slot accuracy and
  `tau_est`, 1 + the mean number of leading correct greedy drafts per block (a chain-tau estimate).
  """
  tokens, lens = batch["tokens"], batch["lens"]
  anchors, anchor_ok = batch["anchors"], batch["anchor_ok"]
  bs = dcfg.block_size
  tp = cast(tparams, compute_dtype)
  _, taps = target_hidden(tp, tcfg, tokens, dcfg.target_layer_ids)
  taps = jax.lax.stop_gradient(taps)
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


# ---------------------------------------------------------------------------------- optimiser


def lr_at(step: int, total: int, peak: float, warmup_fraction: float,
          final_fraction: float = 0.0) -> float:
  """Linear warmup over warmup_fraction * total steps, then cosine to final_fraction * peak."""
  warm = max(int(round(warmup_fraction * total)), 1)
  if step < warm:
    return peak * (step + 1) / warm
  frac = min((step - warm) / max(total - warm, 1), 1.0)
  return peak * (final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(clip: float, b1: float, b2: float, weight_decay: float):
  """AdamW without its learning rate (passed to each step): clip, Adam, decoupled decay on
  matrices only (norm weights are not decayed)."""
  mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  return optax.chain(optax.clip_by_global_norm(clip), optax.scale_by_adam(b1=b1, b2=b2),
                     optax.add_decayed_weights(weight_decay, mask))


def _global_norm(tree):
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def make_step(loss_fn, tx):
  """Jitted step(state, frozen, batch, lr) -> (state, loss, metrics); state is donated."""

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, frozen, batch, lr):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], frozen,
                                                                       batch)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = jax.tree.map(lambda p, u: p - lr * u, state["params"], updates)
    metrics = dict(metrics, grad_norm=_global_norm(grads))
    return dict(state, params=params, opt_state=opt_state), loss, metrics

  return step


# --------------------------------------------------------------------------------------- loop


def _progress(total: int, start: int, enabled: bool):
  """A tqdm bar when asked for, installed and on a terminal; else None (log lines instead)."""
  if not enabled or not sys.stderr.isatty():
    return None
  try:
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  return tqdm(total=total, initial=start, dynamic_ncols=True)


def _log(msg: str):
  print(msg, flush=True)


def train(*, name: str, workdir: str, params, loss_fn: Callable, frozen: Any,
          batch_fn: Callable[[int], dict], eval_fn: Callable[[Any], dict] | None, tc,
          tokens_per_step: int = 0) -> tuple[Any, dict]:
  """The loop shared by target and drafter. Returns (params to export, summary).

  tc (ml_collections or any attribute object): num_steps, time_budget_s (0: off; else the step
  count is cut, after `calib_steps` timed steps, so the loop ends within the budget), lr,
  warmup_fraction, final_lr_fraction, clip, b1, b2, weight_decay, save_every, eval_every,
  log_every, keep_best (export the params of the best held-out loss), stop_at_step (>0: stop there
  as if interrupted), progress_bar. Checkpoints (orbax) hold params, optimiser state, best params
  and the history; a rerun with the same workdir resumes at the latest saved step with the same
  data (batch_fn(step) is pure) and so the same losses as an uninterrupted run.
  """
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  tx = make_optimizer(tc.clip, tc.b1, tc.b2, tc.weight_decay)
  state = {"params": params, "opt_state": tx.init(params)}
  if tc.keep_best:
    state["best"] = jax.tree.map(jnp.copy, params)
  ckdir = os.path.abspath(os.path.join(workdir, "checkpoints"))
  mngr = ocp.CheckpointManager(ckdir, options=ocp.CheckpointManagerOptions(max_to_keep=2))
  meta = {"total_steps": None, "history": [], "evals": [], "best": None, "train_seconds": 0.0}
  start = 0
  if mngr.latest_step() is not None:
    start = int(mngr.latest_step())
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            state)
    restored = mngr.restore(start, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    state, meta = restored.state, dict(restored.meta)
    _log(f"[{name}] resumed from step {start} of {meta['total_steps']}")
  total = meta["total_steps"] or int(tc.num_steps)
  fixed = meta["total_steps"] is not None or not tc.time_budget_s
  step_fn = make_step(loss_fn, tx)

  def save(step):
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            meta=ocp.args.JsonSave(dict(meta, total_steps=total))),
              force=True)

  def evaluate(step):
    if eval_fn is None:
      return
    ev = {k: float(v) for k, v in eval_fn(state["params"]).items()}
    meta["evals"].append(dict(ev, step=step))
    best = meta["best"]
    if best is None or ev["loss"] < best["loss"]:
      meta["best"] = {"step": step, "loss": ev["loss"]}
      if tc.keep_best:
        state["best"] = jax.tree.map(jnp.copy, state["params"])
    _log(f"[{name}] step {step}: held-out " + " ".join(f"{k} {v:.4f}" for k, v in ev.items()))

  if start == 0 and tc.eval_every:
    evaluate(0)               # the step-0 point of the curve; compiles eval outside the budget
  bar = _progress(total, start, tc.progress_bar)
  t_start = time.perf_counter()
  t_calib = None
  seconds_before = meta["train_seconds"]
  step = start
  while step < total:
    if tc.stop_at_step and step >= tc.stop_at_step:
      break
    batch = batch_fn(step)
    lr = lr_at(step, total, tc.lr, tc.warmup_fraction, tc.final_lr_fraction)
    state, loss, metrics = step_fn(state, frozen, batch, jnp.float32(lr))
    step += 1
    if not fixed and step == start + 1:
      jax.block_until_ready(loss)
      t_calib = time.perf_counter()               # after the compile
    if not fixed and step == start + 1 + tc.calib_steps:
      jax.block_until_ready(loss)
      per_step = (time.perf_counter() - t_calib) / tc.calib_steps
      left = tc.time_budget_s - (time.perf_counter() - t_start)
      total = max(min(total, step + int(0.95 * left / per_step)), step)   # 5%: evals, saves
      fixed = True
      _log(f"[{name}] {per_step * 1e3:.1f} ms/step: {total} steps fit the "
           f"{tc.time_budget_s:.0f} s budget (cap {tc.num_steps})")
      if bar is not None:
        bar.total = total
    if step % tc.log_every == 0 or step == total or step == start + 1:
      loss_f = float(loss)
      row = {"step": step, "loss": loss_f, "lr": lr,
             **{k: float(v) for k, v in metrics.items()}}
      meta["history"].append(row)
      if not math.isfinite(loss_f):
        raise FloatingPointError(f"[{name}] loss is {loss_f} at step {step}")
      elapsed = time.perf_counter() - t_start
      if bar is not None:
        bar.set_postfix(loss=f"{loss_f:.4f}")
      else:
        rate = (step - start) / max(elapsed, 1e-9)
        tok = f" {tokens_per_step * rate / 1e3:.0f}k tok/s" if tokens_per_step else ""
        extra = " ".join(f"{k} {float(v):.3f}" for k, v in metrics.items())
        _log(f"[{name}] step {step}/{total} loss {loss_f:.4f} lr {lr:.2e} {extra} "
             f"({rate:.1f} step/s{tok}, {elapsed:.0f} s)")
    if bar is not None:
      bar.update(1)
    if tc.eval_every and (step % tc.eval_every == 0 or step == total):
      evaluate(step)
    if step % tc.save_every == 0 or step == total:
      meta["train_seconds"] = seconds_before + time.perf_counter() - t_start
      save(step)
  if bar is not None:
    bar.close()
  mngr.wait_until_finished()
  meta["train_seconds"] = seconds_before + time.perf_counter() - t_start
  out = state["best"] if tc.keep_best and meta["best"] is not None else state["params"]
  summary = {"steps": step, "total_steps": total, "finished": step >= total,
             "final_train_loss": meta["history"][-1]["loss"] if meta["history"] else None,
             "best": meta["best"], "train_seconds": meta["train_seconds"],
             "history": meta["history"], "evals": meta["evals"]}
  return out, summary


def plot_curve(summary: dict, path: str, title: str):
  """Loss curve PNG (train loss per logged step, held-out loss per eval); skipped without
  matplotlib. Returns whether a file was written."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    _log("matplotlib is not installed: no loss curve PNG")
    return False
  fig, ax = plt.subplots(figsize=(7, 4))
  h = summary["history"]
  ax.plot([r["step"] for r in h], [r["loss"] for r in h], label="train", lw=1)
  if summary["evals"]:
    ax.plot([r["step"] for r in summary["evals"]], [r["loss"] for r in summary["evals"]], "o-",
            label="held-out", ms=3)
  ax.set_xlabel("step")
  ax.set_ylabel("loss")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def write_json(path: str, obj):
  with open(path, "w") as f:
    json.dump(obj, f, indent=1)


def batched_eval(fn, batches) -> dict:
  """Mean of fn(batch) -> (loss, metrics) over batches (equal weight)."""
  acc: dict = {}
  for b in batches:
    loss, metrics = fn(b)
    for k, v in dict(metrics, loss=loss).items():
      acc.setdefault(k, []).append(float(v))
  return {k: float(np.mean(v)) for k, v in acc.items()}
