"""Test setup: 8 forced host devices (sharding tests) and float32-exact CPU math."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must follow the environment set-up)

jax.config.update("jax_default_matmul_precision", "highest")

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
