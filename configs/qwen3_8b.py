"""Qwen3-8B target + its DFlash drafter (z-lab/Qwen3-8B-DFlash-b16 format), bf16.

Checkpoint folders come from env vars or flags:
  QWEN3_8B_DIR=/models/Qwen3-8B QWEN3_8B_DFLASH_DIR=/models/Qwen3-8B-DFlash-b16 \
    python -m experiments.bench_matrix --config=configs/qwen3_8b.py
  python -m experiments.coding_eval --config=configs/qwen3_8b.py --config.target=/models/Qwen3-8B
Without checkpoints: --config.random_target=True --config.random_drafter=True (random weights of
the same shapes: step timing only, acceptance ~1).
"""

import importlib.util
import os


def _sibling(name):
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
  spec = importlib.util.spec_from_file_location(f"ddtree_configs_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


CODING_PROMPTS = (
    'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same forwards and '
    'backwards."""\n',
    'def merge_sorted(a: list, b: list) -> list:\n    """Merge two sorted lists into one sorted '
    'list."""\n',
    "Write a Python function that returns the n-th prime number, with a short explanation.\n",
    "Solve: what is the sum of all positive divisors of 360? Show your reasoning step by step.\n",
)


def get_config():
  default = _sibling("default")
  c = default.get_config()
  c.target = os.environ.get("QWEN3_8B_DIR", os.environ.get("DDTREE_TARGET", ""))
  c.drafter = os.environ.get("QWEN3_8B_DFLASH_DIR", os.environ.get("DDTREE_DRAFTER", ""))
  c.dtype = "bfloat16"
  c.methods = "ar,chain,ddtree"
  c.budgets = "16,32,64,128,256,512"
  c.prompts = CODING_PROMPTS
  c.max_new_tokens = 256
  c.out_dir = "out/qwen3_8b"
  c.shape = default.qwen3_8b_shape()
  c.drafter_shape.num_layers = 5                     # the published Qwen3-8B DFlash drafter
  c.drafter_shape.block_size = 16
  c.drafter_shape.target_layer_ids = "1,9,17,25,33"
  c.drafter_shape.mask_token_id = 151669
  c.coding.max_new_tokens = 256
  return c
