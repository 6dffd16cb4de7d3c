"""A DFlash drafter (experiments/train_drafter.py): the bundled default model's, or any target's.

Bundled (target ""): reads the target exported by train_target.py from `workdir`/target/hf.
Defaults are the GPU run (one H200, ~6 min with regeneration); `:smoke` is a tiny CPU run.
`:any` is a drafter for the checkpoint at config.target on the prompts of config.data (z-lab's
shape: 5 layers, block 16), in bf16 on one device; `make train-drafter TARGET=... DATA=...`.
"""

import ml_collections


def get_config(preset: str = "gpu"):
  if preset not in ("gpu", "smoke", "any"):
    raise ValueError(f"unknown preset {preset!r} (gpu, smoke or any)")
  c = ml_collections.ConfigDict()
  c.preset = preset
  c.workdir = "out/train_default"      # same workdir as the target run
  c.seed = 0
  c.stage = "all"                      # regenerate | train | all
  c.target = ""                        # a checkpoint folder: train its drafter ("" = bundled)
  c.data = ""                          # with target: the corpus of prompts (JSONL or text)

  c.drafter = ml_collections.ConfigDict()
  c.drafter.num_layers = 2
  c.drafter.block_size = 16
  c.drafter.target_layer_ids = ""    # "" = the DFlash default rule; else e.g. "1,3,5"
  c.drafter.init_std = 0.02
  c.drafter.mask_token_id = -1         # -1: the tokenizer's <|mask|> (the bundled tokenizer's)
  c.drafter.num_heads = 0              # 0: the target's (and kv heads, head size, MLP width)
  c.drafter.num_kv_heads = 0
  c.drafter.head_dim = 0
  c.drafter.intermediate_size = 0

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
  c.regen.temperature = 0.0            # > 0: sampled continuations (the target's at that T)
  c.regen.capture = False              # keep the target's features of the same forwards on disk
                                       # (workdir/regen/*_features.npy): training runs no target

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
  c.train.target_dtype = "float32"     # the frozen target's weights in training
  c.train.save_every = 250
  c.train.eval_every = 250
  c.train.log_every = 100
  c.train.keep_best = False
  c.train.stop_at_step = 0
  c.train.progress_bar = True

  c.export = ml_collections.ConfigDict()
  c.export.dtype = "bfloat16"

  # Chain and DDTree tau by generation over the held-out prompts: after export, and at every
  # evaluation (train.eval_every) when each_eval.
  c.eval = ml_collections.ConfigDict()
  c.eval.budgets = (16, 32, 64)
  c.eval.new_tokens = 128
  c.eval.each_eval = False

  if preset == "smoke":
    c.workdir = "/tmp/ddtree_smoke"
    c.drafter.update(num_layers=1, block_size=8, target_layer_ids="")
    c.regen.update(num_sequences=16, heldout_sequences=4, prompt_min=8, prompt_max=24,
                   new_tokens=32, batch_size=16, time_budget_s=0.0)
    c.train.update(batch_size=4, num_anchors=16, gamma=4.0, num_steps=30, time_budget_s=0.0,
                   lr=3e-3, compute_dtype="float32", save_every=10, eval_every=10, log_every=5)
    c.export.dtype = "float32"
    c.eval.update(budgets=(4, 8), new_tokens=16)
  if preset == "any":
    c.workdir = "out/train_drafter"
    c.drafter.update(num_layers=5, block_size=16)
    c.regen.update(num_sequences=8192, heldout_sequences=64, prompt_max=1024, new_tokens=512,
                   batch_size=64, time_budget_s=0.0, dtype="bfloat16", matmul_precision="default")
    c.train.update(num_anchors=256, time_budget_s=0.0, target_dtype="bfloat16")
    c.eval.each_eval = True
  return c
