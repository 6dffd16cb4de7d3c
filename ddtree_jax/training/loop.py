"""The training loop shared by the target and the drafter: AdamW with warmup + cosine, gradient
clipping, orbax checkpoints with exact resume, a progress bar, loss curves."""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddtree_jax.checkpoints import files

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
  if os.path.isdir(ckdir):
    files.remove_stale_orbax_temporaries(ckdir)
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
  """Loss curve PNG (train loss per logged step, held-out loss per eval; beside it the evals'
  tau metrics, when they have any); skipped without matplotlib. Returns whether a file was
  written."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    _log("matplotlib is not installed: no loss curve PNG")
    return False
  taus = sorted(k for k in (summary["evals"] or [{}])[0] if k.endswith("tau") and k != "tau_est")
  fig, axes = plt.subplots(1, 2 if taus else 1, figsize=(12 if taus else 7, 4), squeeze=False)
  ax = axes[0, 0]
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
  if taus:  # the held-out acceptance beside the loss
    ax = axes[0, 1]
    for k in taus:
      ax.plot([r["step"] for r in summary["evals"]], [r[k] for r in summary["evals"]], "o-",
              label=k, ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out tokens per step")
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  files.save_figure(fig, path, dpi=110)
  plt.close(fig)
  return True


def write_json(path: str, obj):
  files.write_json(path, obj, indent=1)


def batched_eval(fn, batches) -> dict:
  """Mean of fn(batch) -> (loss, metrics) over batches (equal weight)."""
  acc: dict = {}
  for b in batches:
    loss, metrics = fn(b)
    for k, v in dict(metrics, loss=loss).items():
      acc.setdefault(k, []).append(float(v))
  return {k: float(np.mean(v)) for k, v in acc.items()}
