"""DFlash drafter of the bundled default model (experiments/train_drafter.py).

Reads the target exported by train_target.py from `workdir`/target/hf. Defaults are the GPU run
(one H200, ~6 min with regeneration); `--config=configs/train_drafter.py:smoke` is a tiny CPU run.
"""

import ml_collections


def get_config(preset: str = "gpu"):
  if preset not in ("gpu", "smoke"):
    raise ValueError(f"unknown preset {preset!r} (gpu or smoke)")
  c = ml_collections.ConfigDict()
  c.preset = preset
  c.workdir = "out/train_default"      # same workdir as the target run
  c.seed = 0
  c.stage = "all"                      # regenerate | train | all

  c.drafter = ml_collections.ConfigDict()
  c.drafter.num_layers = 2
  c.drafter.block_size = 16
  c.drafter.target_layer_ids = ""    # "" = the DFlash default rule; else e.g. "1,3,5"
  c.drafter.init_std = 0.02

  # Training data: the target's own greedy continuations of prompts cut from the train split.
  c.regen = ml_collections.ConfigDict()
  c.regen.num_sequences = 40960
  c.regen.heldout_sequences = 128      # from held-out files: validation loss / tau estimate
  c.regen.prompt_min = 16
  c.regen.prompt_max = 192
  c.regen.new_tokens = 320             # prompt_max + new_tokens <= the target's seq_len
  c.regen.batch_size = 1024
  c.regen.time_budget_s = 70.0         # stop adding batches past this (0 = all num_sequences)
  c.regen.dtype = "float32"            # the shipped (bf16-rounded) weights, float32 math
  c.regen.matmul_precision = "highest"
  c.regen.attention = "xla"

  c.train = ml_collections.ConfigDict()
  c.train.batch_size = 32              # sequences per step
  c.train.num_anchors = 512            # per sequence, fresh each epoch (capped by the candidates)
  c.train.gamma = 7.0                  # slot weights exp(-(k-1)/gamma)
  c.train.num_steps = 20000
  c.train.time_budget_s = 180.0
  c.train.calib_steps = 20
  c.train.lr = 6e-4
  c.train.warmup_fraction = 0.04
  c.train.final_lr_fraction = 0.0
  c.train.clip = 1.0
  c.train.b1 = 0.9
  c.train.b2 = 0.95
  c.train.weight_decay = 0.01
  c.train.compute_dtype = "bfloat16"
  c.train.save_every = 250
  c.train.eval_every = 250
  c.train.log_every = 100
  c.train.keep_best = False
  c.train.stop_at_step = 0
  c.train.progress_bar = True

  c.export = ml_collections.ConfigDict()
  c.export.dtype = "bfloat16"

  if preset == "smoke":
    c.workdir = "/tmp/ddtree_smoke"
    c.drafter.update(num_layers=1, block_size=8, target_layer_ids="")
    c.regen.update(num_sequences=16, heldout_sequences=4, prompt_min=8, prompt_max=24,
                   new_tokens=32, batch_size=16, time_budget_s=0.0)
    c.train.update(batch_size=4, num_anchors=16, gamma=4.0, num_steps=30, time_budget_s=0.0,
                   lr=3e-3, compute_dtype="float32", save_every=10, eval_every=10, log_every=5)
    c.export.dtype = "float32"
  return c
