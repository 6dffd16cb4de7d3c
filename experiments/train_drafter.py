"""Train a DFlash drafter for a target: the bundled pair's (steps 3-4 of `make train`), or any
target this engine loads on a corpus of the user's (`make train-drafter TARGET=... DATA=...`).

  python -m experiments.train_drafter --config=configs/train_drafter.py[:smoke] [--config.stage=...]
  python -m experiments.train_drafter --config=configs/train_drafter.py:any \
      --config.target=/models/Qwen3-8B --config.data=prompts.jsonl --config.workdir=out/d8b

Bundled (config.target ""): prompts cut from the train split of `workdir`/data, the exported
target `workdir`/target/hf. Any target (config.target a checkpoint folder): prompts from
config.data (`ddtree_jax/training/corpus.py`: JSONL conversations rendered with the target's chat
template, or text), a held-out share kept apart. stage=regenerate: the target's continuations of
the prompts (greedy, or sampled at regen.temperature; cut at its stop tokens for any target),
cached as .npy under `workdir`/regen (skipped when present). stage=train: the DFlash recipe
(docs/design.md §2) with the frozen target, orbax checkpoints + resume under
`workdir`/drafter/checkpoints, export in the z-lab format to `workdir`/drafter/hf (loadable by
dj.load_drafter), then held-out chain and DDTree tau by generation. stage=all: both. The last
line printed is one JSON summary. --mesh_dp / --mesh_tp (--mesh_layout) lay the target, the
drafter and each batch out on a mesh (the batch over dp, the weights over tp), for
regeneration and training alike.
"""

import functools
import json
import os
import time

from absl import app
from ml_collections import config_flags

import jax
import jax.numpy as jnp
import numpy as np

import ddtree_jax as dj
from ddtree_jax import engine, sharding
from ddtree_jax.checkpoints import hf as checkpoint
from ddtree_jax.training import data, drafter_recipe as recipe
from ddtree_jax.checkpoints import export as hf_export
from ddtree_jax.training import loop as train_loop
from ddtree_jax.training import losses as training

_CONFIG = config_flags.DEFINE_config_file("config", "configs/train_drafter.py", "run configuration")


engine.define_compilation_cache_flags()
sharding.define_mesh_flags()
sharding.define_layout_flag()


def main(_):
  engine.compilation_cache_from_flags()
  cfg = _CONFIG.value
  t0 = time.perf_counter()
  if cfg.stage not in ("regenerate", "train", "all"):
    raise ValueError(f"unknown stage {cfg.stage!r}")
  mesh, rules = sharding.mesh_from_flags(), sharding.rules_from_flags()
  if mesh is not None and cfg.train.batch_size % sharding.batch_multiple(mesh, rules):
    raise ValueError(f"train.batch_size {cfg.train.batch_size} must be a multiple of the mesh's "
                     f"dp size {sharding.batch_multiple(mesh, rules)}")
  target, frozen, tok, train_set, held_set, held_prompts, t_regen = recipe.load_data(
      cfg, mesh, rules)
  print(f"regenerated data: {len(train_set['tokens'])} train / {len(held_set['tokens'])} held-out "
        f"sequences of <= {train_set['tokens'].shape[1]} tokens ({t_regen:.1f} s)", flush=True)
  if cfg.stage == "regenerate":
    print(json.dumps({"stage": "regenerate", "seconds": round(t_regen, 1)}), flush=True)
    return

  tc = cfg.train
  dcfg = recipe.drafter_config(cfg.drafter, target.config, tok)
  cdt = checkpoint.parse_dtype(tc.compute_dtype)
  max_cand = int(np.max(train_set["lens"] - train_set["prompt_lens"]) - 1)
  num_anchors = max(1, min(tc.num_anchors, max_cand))
  params = training.init_drafter_params(dcfg, jax.random.key(cfg.seed), cfg.drafter.init_std,
                                        final_norm=frozen.final_norm)
  params = sharding.shard_params(params, mesh, rules)  # over tp as the engine lays a drafter out
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  print(f"drafter: {n_params / 1e6:.2f}M params, {dcfg.layers.num_layers} layers, block "
        f"{dcfg.block_size}, taps {dcfg.target_layer_ids}, mask {dcfg.mask_token_id}, "
        f"{num_anchors} anchors/sequence, backend {jax.default_backend()}", flush=True)
  loss_fn = functools.partial(training.drafter_loss, dcfg=dcfg, tcfg=target.config,
                              gamma=tc.gamma, compute_dtype=cdt)

  def device_batch(b, s, offset=0):
    """A host batch on the devices (over dp; padded to a multiple of it with rows that hold no
    anchor), with its rows' captured features when there are any."""
    rows = b.pop("rows")
    if "features" in s:
      b["features"] = recipe.feature_rows(s["features"], rows + offset)
    n = len(rows)
    keys = list(b)
    padded = dict(zip(keys, sharding.pad_batch([np.asarray(b[k]) for k in keys], mesh, rules)))
    padded["anchor_ok"][n:] = False
    return {k: sharding.put_batch(v, mesh, rules) for k, v in padded.items()}

  def batch_fn(step, s=train_set):
    return device_batch(data.drafter_batch(s["tokens"], s["lens"], s["prompt_lens"],
                                           tc.batch_size, num_anchors, cfg.seed, step), s)

  # Held-out: every anchor of every sequence, so chain decoding can be replayed exactly.
  held_anchors = int(np.max(held_set["lens"] - held_set["prompt_lens"]) - 1)
  held_batches = []
  for i in range(0, len(held_set["tokens"]), tc.batch_size):
    n = min(tc.batch_size, len(held_set["tokens"]) - i)
    b = data.drafter_batch(held_set["tokens"][i:i + n], held_set["lens"][i:i + n],
                           held_set["prompt_lens"][i:i + n], n, held_anchors, cfg.seed + 1, 0)
    held_batches.append(device_batch(b, held_set, offset=i))
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
    if cfg.eval.each_eval:  # the acceptance by generation at every evaluation, not only the last
      out.update(recipe.heldout_tau(target, dj.Drafter(params=p, config=dcfg), held_prompts,
                                    tuple(cfg.eval.budgets), cfg.eval.new_tokens,
                                    cfg.regen.batch_size))
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
  final.update(recipe.heldout_tau(target, shipped, held_prompts, tuple(cfg.eval.budgets),
                                  cfg.eval.new_tokens, cfg.regen.batch_size))  # as exported
  train_loop.plot_curve(summary, os.path.join(out, "loss.png"), "DFlash drafter")
  result = {"stage": "drafter", "params_m": round(n_params / 1e6, 3), "steps": summary["steps"],
            "total_steps": summary["total_steps"], "finished": summary["finished"],
            "final_train_loss": summary["final_train_loss"],
            "exported_heldout_loss": final["loss"], "exported_heldout_tau_est": final["tau_est"],
            "exported_heldout_chain_tau_sim": final["chain_tau_sim"],
            "exported_heldout_acc_slot1": final["acc_slot1"],
            **{f"heldout_{k}": v for k, v in final.items() if k.endswith("_tau")},
            "regen_seconds": round(t_regen, 1), "train_seconds": round(summary["train_seconds"], 1),
            "wall_seconds": round(time.perf_counter() - t0, 1), "export": hf}
  train_loop.write_json(os.path.join(out, "metrics.json"), dict(result, history=summary["history"],
                                                              evals=summary["evals"]))
  print(json.dumps(result), flush=True)


if __name__ == "__main__":
  app.run(main)
