"""ddtree-jax: DFlash + DDTree speculative decoding in JAX, one compiled program per budget."""

from ddtree_jax.checkpoint import Drafter, Target, load_drafter, load_target
from ddtree_jax.engine import GenerateResult, draft_logits, forward_logits, generate
from ddtree_jax.tree import DraftTree, build_tree

__all__ = ["Drafter", "DraftTree", "GenerateResult", "Target", "build_tree", "draft_logits",
           "forward_logits", "generate", "load_drafter", "load_target"]
