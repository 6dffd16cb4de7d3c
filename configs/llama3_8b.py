"""Llama-3(.1)-8B target + a DFlash drafter for it, bf16.

  LLAMA3_8B_DIR=/models/Llama-3.1-8B-Instruct LLAMA3_8B_DFLASH_DIR=/models/llama-dflash \
    python -m experiments.bench_matrix --config=configs/bench_matrix.py:llama3_8b
Without checkpoints: --config.random_target=True --config.random_drafter=True.
"""

import importlib.util
import os


def _sibling(name):
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
  spec = importlib.util.spec_from_file_location(f"ddtree_configs_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config():
  c = _sibling("qwen3_8b").get_config()
  c.target = os.environ.get("LLAMA3_8B_DIR", os.environ.get("DDTREE_TARGET", ""))
  c.drafter = os.environ.get("LLAMA3_8B_DFLASH_DIR", os.environ.get("DDTREE_DRAFTER", ""))
  c.out_dir = "out/llama3_8b"
  s = c.shape
  s.model_type = "llama"
  s.vocab_size = 128256
  s.hidden_size = 4096
  s.intermediate_size = 14336
  s.num_layers = 32
  s.num_heads = 32
  s.num_kv_heads = 8
  s.head_dim = 128
  s.rope_theta = 500000.0
  s.rms_norm_eps = 1e-5
  s.tie_word_embeddings = False
  c.drafter_shape.num_layers = 5
  c.drafter_shape.block_size = 16
  c.drafter_shape.target_layer_ids = ""              # the DFlash default rule for 32 layers
  c.drafter_shape.mask_token_id = -1                 # random drafters: vocab_size - 1
  return c
