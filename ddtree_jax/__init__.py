"""ddtree-jax: DFlash + DDTree speculative decoding in JAX, one compiled program per budget."""

import os as _os

from ddtree_jax.checkpoints.dflash import Drafter, load_drafter
from ddtree_jax.checkpoints.hf import Target, load_target
from ddtree_jax.engine import (GenerateResult, budget_costs, compile_many, compile_only,
                               draft_logits, forward_logits, generate)
from ddtree_jax.speculative.tree import DraftTree, build_tree

DEFAULT_MODEL_DIR = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "default_model")


def load_default(dtype="float32") -> tuple[Target, Drafter]:
  """The bundled pair: a small Qwen3 code LM trained on the Python standard library and its DFlash
  drafter (ddtree_jax/default_model/{target,drafter}, made by `make train`)."""
  target_dir = _os.path.join(DEFAULT_MODEL_DIR, "target")
  drafter_dir = _os.path.join(DEFAULT_MODEL_DIR, "drafter")
  for d in (target_dir, drafter_dir):
    if not _os.path.exists(_os.path.join(d, "config.json")):
      raise FileNotFoundError(f"{d}: no bundled model here yet; `make train` makes and installs it")
  target = load_target(target_dir, dtype=dtype)
  return target, load_drafter(drafter_dir, target)


__all__ = ["DEFAULT_MODEL_DIR", "Drafter", "DraftTree", "GenerateResult", "Target", "budget_costs",
           "build_tree", "compile_many", "compile_only", "draft_logits", "forward_logits",
           "generate", "load_default", "load_drafter", "load_target"]
