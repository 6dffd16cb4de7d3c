"""Pallas kernels (GPU Triton backend; interpret mode on CPU)."""

from ddtree_jax.pallas.add_rms_norm import residual_norm
from ddtree_jax.pallas.qk_norm_rope import project_qk_norm_rope, qk_norm_rope, qkv_norm_rope
from ddtree_jax.pallas.tree_attention import attention_config, tree_attention

__all__ = ["attention_config", "project_qk_norm_rope", "qk_norm_rope", "qkv_norm_rope",
           "residual_norm", "tree_attention"]
