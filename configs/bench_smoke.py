"""A small benchmark matrix that runs on CPU in about a minute (`make bench-smoke`).

Uses the default pair (configs/default.py); while the bundled drafter is absent, the fixture
target gets a random DFlash drafter (acceptance ~1: the numbers only show the plumbing works).
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
  c = _sibling("default").get_config()
  c.random_drafter = not c.drafter
  c.drafter_shape.num_layers = 2
  c.drafter_shape.block_size = 8
  c.methods = "ar,chain,ddtree"
  c.budgets = "4,16"
  c.batches = "1,2"
  c.max_new_tokens = 16
  c.ignore_eos = True
  c.repeats = 2
  c.profile = "ddtree"
  c.profile_repeats = 2
  c.out_dir = "out/bench_smoke"
  return c
