"""Tokenizer + target LM of the bundled default model (experiments/train_target.py).

Defaults are the GPU run (one H200: ~11 min, the corpus and 5000 steps; the shape from
`experiments/perf/run_h200.sh target_sweep`, docs/findings/default-model.md); `--config=configs/train_target.py:smoke` is a tiny
CPU run. Override any field, e.g. --config.train.num_steps=100 --config.workdir=/tmp/run.
"""

import ml_collections


def get_config(preset: str = "gpu"):
  if preset not in ("gpu", "smoke"):
    raise ValueError(f"unknown preset {preset!r} (gpu or smoke)")
  c = ml_collections.ConfigDict()
  c.preset = preset
  c.workdir = "out/train_default"      # tokenizer, token caches, checkpoints, exports, curves
  c.seed = 0

  c.data = ml_collections.ConfigDict()
  c.data.stdlib_root = ""              # "" = sysconfig.get_paths()["stdlib"] of this interpreter
  c.data.packages = "all"              # installed packages' sources too: comma list of import
                                       # names, "deps" = the project's (data.DEPENDENCIES), "all"
  c.data.heldout_fraction = 0.02       # by sha256 of the relative path (ddtree_jax/training/data.py)
  c.data.max_files = 0                 # > 0: only the first N files per split (smoke)
  c.data.vocab_size = 8192             # byte-level BPE, ids 0/1 = <|endoftext|>/<|mask|>

  c.model = ml_collections.ConfigDict()
  c.model.hidden_size = 384
  c.model.num_layers = 8
  c.model.num_heads = 6
  c.model.num_kv_heads = 2
  c.model.head_dim = 64
  c.model.intermediate_size = 1024
  c.model.rope_theta = 10000.0
  c.model.rms_norm_eps = 1e-6
  c.model.tie_word_embeddings = True
  c.model.seq_len = 512
  c.model.init_std = 0.02

  c.train = ml_collections.ConfigDict()
  c.train.batch_size = 128
  c.train.num_steps = 5000             # cap; time_budget_s may cut it (the cut is recorded)
  c.train.time_budget_s = 0.0          # 0 = run num_steps (wall clock incl. compile)
  c.train.calib_steps = 20
  c.train.lr = 1.5e-3
  c.train.warmup_fraction = 0.04
  c.train.final_lr_fraction = 0.1
  c.train.clip = 1.0
  c.train.b1 = 0.9
  c.train.b2 = 0.95
  c.train.weight_decay = 0.1
  c.train.compute_dtype = "bfloat16"   # matmul dtype; master weights stay float32
  c.train.save_every = 250
  c.train.eval_every = 500
  c.train.eval_windows = 48
  c.train.log_every = 100
  c.train.keep_best = True             # export the params of the best held-out loss
  c.train.stop_at_step = 0             # > 0: stop there as if interrupted (resume tests)
  c.train.progress_bar = True          # tqdm on a terminal, log lines otherwise

  c.export = ml_collections.ConfigDict()
  c.export.dtype = "bfloat16"          # shipped weights (40 MB cap for the pair)

  if preset == "smoke":
    c.workdir = "/tmp/ddtree_smoke"
    c.data.max_files = 8
    c.data.packages = ""
    c.data.vocab_size = 512
    c.model.update(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   intermediate_size=128, seq_len=64)
    c.train.update(batch_size=8, num_steps=30, time_budget_s=0.0, lr=3e-3, compute_dtype="float32",
                   save_every=10, eval_every=10, eval_windows=8, log_every=5)
    c.export.dtype = "float32"
  return c
