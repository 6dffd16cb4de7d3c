"""Pallas GPU kernels, each beside its jnp reference (interpret mode on CPU); their tuning
defaults live in `tuning.py`, and `ddtree_jax.kernels` chooses between kernel and reference."""
