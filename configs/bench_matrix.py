"""The GPU benchmark matrix: ar / chain / ddtree x budgets x concurrency, bf16 (`make bench`).

  python -m experiments.bench_matrix --config=configs/bench_matrix.py              # Qwen3-8B
  python -m experiments.bench_matrix --config=configs/bench_matrix.py:llama3_8b
  python -m experiments.bench_matrix --config=configs/bench_matrix.py:default      # bundled pair
Checkpoints come from QWEN3_8B_DIR / QWEN3_8B_DFLASH_DIR (LLAMA3_8B_* for llama3_8b) or
--config.target / --config.drafter. Without them the target and/or drafter are random weights of
the same shapes (random_target / random_drafter, recorded in the JSON): the step timings are
real, acceptance is ~1 and prompts are `prompt_len` random tokens.
"""

import importlib.util
import os

MODELS = ("qwen3_8b", "llama3_8b", "default")


def _sibling(name):
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
  spec = importlib.util.spec_from_file_location(f"ddtree_configs_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config(model="qwen3_8b"):
  if model not in MODELS:
    raise ValueError(f"unknown model {model!r} for configs/bench_matrix.py; valid: {MODELS}")
  c = _sibling(model).get_config()
  c.random_target = not c.target
  c.random_drafter = not c.drafter
  c.methods = "ar,chain,ddtree"
  c.budgets = "1,4,8,16,32,64,128"
  c.batches = "1,4,16"
  c.max_new_tokens = 128 if model == "default" else 256
  c.ignore_eos = True                                # every method emits max_new_tokens
  c.prompt_len = 512 if c.random_target else 0       # random targets have no tokenizer
  c.repeats = 3
  c.profile = "chain,ddtree"                         # 4 extra compiles per profiled cell
  c.profile_repeats = 5
  c.compile_threads = 8                              # an H200 host has 16 cores
  c.out_dir = f"out/bench_matrix_{model}"
  return c
