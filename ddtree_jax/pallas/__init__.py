"""Pallas kernels (GPU Triton backend; interpret mode on CPU)."""

from ddtree_jax.pallas.tree_attention import attention_config, tree_attention

__all__ = ["attention_config", "tree_attention"]
