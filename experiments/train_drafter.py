"""Steps 3-4 of `make train`: regenerate training data with the target, train its DFlash drafter.

  python -m experiments.train_drafter --config=configs/train_drafter.py[:smoke] [--config.stage=...]

stage=regenerate: greedy continuations by the exported target (`workdir`/target/hf) of prompts cut
from the train split (and a few from held-out files, for validation), cached as .npy under
`workdir`/regen (skipped when present). stage=train: the DFlash recipe (docs/design.md §2) with
the frozen target, orbax checkpoints + resume under `workdir`/drafter/checkpoints, export in the
z-lab format to `workdir`/drafter/hf (loadable by dj.load_drafter). stage=all: both.
The last line printed is one JSON summary.
"""

import functools
import json
import os
import time

from absl import app
from absl import logging
from ml_collections import config_flags

import jax
import jax.numpy as jnp
import numpy as np

import ddtree_jax as dj
from ddtree_jax import engine
from ddtree_jax.checkpoints import hf as checkpoint
from ddtree_jax.training import data
from ddtree_jax.checkpoints import files
from ddtree_jax.checkpoints import export as hf_export
from ddtree_jax.training import loop as train_loop
from ddtree_jax.training import losses as training
from ddtree_jax.models.registry import config_from_hf
from ddtree_jax.models.drafter import DrafterConfig, default_target_layer_ids

_CONFIG = config_flags.DEFINE_config_file("config", "configs/train_drafter.py", "run configuration")


def _regen_paths(workdir, split):
  d = os.path.join(workdir, "regen")
  return {k: os.path.join(d, f"{split}_{k}.npy") for k in ("tokens", "lens", "prompt_lens")}


def regenerate(cfg, target, split_tokens, split, count, seed, budget_s=0.0):
  """Greedy continuations of `count` prompts of `split_tokens`; cached .npy (tokens [N, S] right-
  padded with EOS, lens [N], prompt_lens [N]). With budget_s > 0, stops after the batch that
  would end past the budget (at least one batch) and keeps the sequences made so far."""
  paths = _regen_paths(cfg.workdir, split)
  if all(os.path.exists(p) for p in paths.values()):
    return {k: np.load(p) for k, p in paths.items()}
  r = cfg.regen
  prompts = data.prompt_windows(split_tokens, count, r.prompt_min, r.prompt_max, seed)
  width = r.prompt_max + r.new_tokens
  eos = target.config.eos_token_ids[0] if target.config.eos_token_ids else 0
  tokens = np.full((count, width), eos, np.int32)
  lens = np.zeros((count,), np.int32)
  plens = np.array([len(p) for p in prompts], np.int32)
  t0 = t_batch = time.perf_counter()
  for i in range(0, count, r.batch_size):
    chunk = prompts[i:i + r.batch_size]
    pad = r.batch_size - len(chunk)             # one batch shape: one compiled program
    batch = [p.tolist() for p in chunk] + [chunk[0].tolist()] * pad
    with jax.default_matmul_precision(r.matmul_precision):
      res = dj.generate(target, batch, method="ar", max_new_tokens=r.new_tokens,
                        stop_token_ids=(), attention=r.attention)
    for j, (p, out) in enumerate(zip(chunk, res.tokens)):
      seq = np.concatenate([p, np.asarray(out, np.int32)])
      tokens[i + j, :len(seq)] = seq
      lens[i + j] = len(seq)
    done = min(i + r.batch_size, count)
    elapsed, last = time.perf_counter() - t0, time.perf_counter() - t_batch
    t_batch = time.perf_counter()
    print(f"[regen {split}] {done}/{count} sequences ({elapsed:.1f} s)", flush=True)
    if budget_s and i and done < count and elapsed + last > budget_s:   # i > 0: past the compile
      print(f"[regen {split}] stopping at {done} sequences: the {budget_s:.0f} s budget",
            flush=True)
      tokens, lens, plens = tokens[:done], lens[:done], plens[:done]
      break
  os.makedirs(os.path.dirname(paths["tokens"]), exist_ok=True)
  out = {"tokens": tokens, "lens": lens, "prompt_lens": plens}
  for k, p in paths.items():
    files.save_npy(p, out[k])
  return out


def drafter_config(cfg, target, tokenizer) -> DrafterConfig:
  d = cfg.drafter
  tc = target.config
  ids = (tuple(int(x) for x in str(d.target_layer_ids).split(",") if x.strip())
         or default_target_layer_ids(tc.num_layers, d.num_layers))
  mask = tokenizer.token_to_id(data.MASK)
  if mask is None:
    raise ValueError(f"the target's tokenizer has no {data.MASK} token")
  layers = config_from_hf({
      "model_type": "qwen3", "vocab_size": tc.vocab_size, "hidden_size": tc.hidden_size,
      "intermediate_size": tc.intermediate_size, "num_hidden_layers": d.num_layers,
      "num_attention_heads": tc.num_heads, "num_key_value_heads": tc.num_kv_heads,
      "head_dim": tc.head_dim, "rms_norm_eps": tc.rms_norm_eps, "rope_theta": tc.rope_theta,
      "max_position_embeddings": tc.max_position_embeddings})
  return DrafterConfig(layers=layers, block_size=d.block_size, mask_token_id=mask,
                       target_layer_ids=ids)


engine.define_compilation_cache_flags()


def main(_):
  engine.compilation_cache_from_flags()
  logging.set_verbosity(logging.WARNING)
  cfg = _CONFIG.value
  t0 = time.perf_counter()
  if cfg.stage not in ("regenerate", "train", "all"):
    raise ValueError(f"unknown stage {cfg.stage!r}")
  with open(os.path.join(cfg.workdir, "data", "corpus.json")) as f:
    settings = json.load(f)["settings"]
  tok, train_tokens, heldout_tokens = data.prepare_corpus(cfg.workdir, **settings)
  hf_target = os.path.join(cfg.workdir, "target", "hf")
  target = dj.load_target(hf_target, dtype=cfg.regen.dtype)
  t_regen = time.perf_counter()
  train_set = regenerate(cfg, target, train_tokens, "train", cfg.regen.num_sequences, cfg.seed,
                         cfg.regen.time_budget_s)
  held_set = regenerate(cfg, target, heldout_tokens, "heldout", cfg.regen.heldout_sequences,
                        cfg.seed + 1)
  t_regen = time.perf_counter() - t_regen
  print(f"regenerated data: {len(train_set['tokens'])} train / {len(held_set['tokens'])} held-out "
        f"sequences of <= {train_set['tokens'].shape[1]} tokens ({t_regen:.1f} s)", flush=True)
  if cfg.stage == "regenerate":
    print(json.dumps({"stage": "regenerate", "seconds": round(t_regen, 1)}), flush=True)
    return

  tc = cfg.train
  dcfg = drafter_config(cfg, target, tok)
  cdt = checkpoint.parse_dtype(tc.compute_dtype)
  frozen = (target.params if target.dtype == jnp.float32
            else dj.load_target(hf_target, dtype="float32").params)
  max_cand = int(np.max(train_set["lens"] - train_set["prompt_lens"]) - 1)
  num_anchors = max(1, min(tc.num_anchors, max_cand))
  params = training.init_drafter_params(dcfg, jax.random.key(cfg.seed), cfg.drafter.init_std,
                                        final_norm=frozen.final_norm)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  print(f"drafter: {n_params / 1e6:.2f}M params, {dcfg.layers.num_layers} layers, block "
        f"{dcfg.block_size}, taps {dcfg.target_layer_ids}, mask {dcfg.mask_token_id}, "
        f"{num_anchors} anchors/sequence, backend {jax.default_backend()}", flush=True)
  loss_fn = functools.partial(training.drafter_loss, dcfg=dcfg, tcfg=target.config,
                              gamma=tc.gamma, compute_dtype=cdt)

  def batch_fn(step, s=train_set):
    b = data.drafter_batch(s["tokens"], s["lens"], s["prompt_lens"], tc.batch_size, num_anchors,
                           cfg.seed, step)
    return {k: jnp.asarray(v) for k, v in b.items()}

  # Held-out: every anchor of every sequence, so chain decoding can be replayed exactly.
  held_anchors = int(np.max(held_set["lens"] - held_set["prompt_lens"]) - 1)
  held_batches = []
  for i in range(0, len(held_set["tokens"]), tc.batch_size):
    n = min(tc.batch_size, len(held_set["tokens"]) - i)
    b = data.drafter_batch(held_set["tokens"][i:i + n], held_set["lens"][i:i + n],
                           held_set["prompt_lens"][i:i + n], n, held_anchors, cfg.seed + 1, 0)
    held_batches.append({k: jnp.asarray(v) for k, v in b.items()})
  eval_loss = jax.jit(loss_fn)
  eval_runs = jax.jit(functools.partial(training.drafter_runs, dcfg=dcfg, tcfg=target.config,
                                        compute_dtype=cdt))

  def eval_fn(p):
    out = train_loop.batched_eval(lambda b: eval_loss(p, frozen, b), held_batches)
    committed = steps = 0
    for b in held_batches:
      runs = np.asarray(eval_runs(p, frozen, b))
      c, s = training.simulate_chain(runs, np.asarray(b["anchors"]), np.asarray(b["anchor_ok"]),
                                     np.asarray(b["lens"]))
      committed, steps = committed + c, steps + s
    out["chain_tau_sim"] = committed / max(steps, 1)
    return out

  out = os.path.join(cfg.workdir, "drafter")
  os.makedirs(out, exist_ok=True)
  params, summary = train_loop.train(
      name="drafter", workdir=out, params=params, loss_fn=loss_fn, frozen=frozen,
      batch_fn=batch_fn, eval_fn=eval_fn, tc=tc,
      tokens_per_step=tc.batch_size * num_anchors * (dcfg.block_size - 1))
  hf = hf_export.save_drafter_hf(os.path.join(out, "hf"), params, dcfg, target.config.num_layers,
                                  cfg.export.dtype)
  shipped = dj.load_drafter(hf, target, dtype="float32")
  final = eval_fn(shipped.params)
  train_loop.plot_curve(summary, os.path.join(out, "loss.png"), "DFlash drafter")
  result = {"stage": "drafter", "params_m": round(n_params / 1e6, 3), "steps": summary["steps"],
            "total_steps": summary["total_steps"], "finished": summary["finished"],
            "final_train_loss": summary["final_train_loss"],
            "exported_heldout_loss": final["loss"], "exported_heldout_tau_est": final["tau_est"],
            "exported_heldout_chain_tau_sim": final["chain_tau_sim"],
            "exported_heldout_acc_slot1": final["acc_slot1"],
            "regen_seconds": round(t_regen, 1), "train_seconds": round(summary["train_seconds"], 1),
            "wall_seconds": round(time.perf_counter() - t0, 1), "export": hf}
  train_loop.write_json(os.path.join(out, "metrics.json"), dict(result, history=summary["history"],
                                                              evals=summary["evals"]))
  print(json.dumps(result), flush=True)


if __name__ == "__main__":
  app.run(main)
