"""Test setup: 8 forced host devices (sharding tests) and float32-exact CPU math."""

import gc
import os

# The tests' programs are tiny and each is run a few times, so XLA:CPU's compile dominates: its
# LLVM backend optimizes at -O0 and skips its expensive passes (results are the same programs'
# results; only the machine code is slower). docs/findings/tests-that-can-fail.md.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                      "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must follow the environment set-up)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drops every compiled program after each test module. XLA:CPU maps memory for each compiled
  executable; kept alive by engine's program cache and JAX's caches they add up over a pytest
  worker's modules, until a compile crosses Linux's limit on mappings (vm.max_map_count) and
  segfaults (docs/findings/compile-time.md)."""
  yield
  from ddtree_jax import engine  # pylint: disable=import-outside-toplevel
  engine._PROGRAMS.clear()  # pylint: disable=protected-access
  jax.clear_caches()
  gc.collect()
