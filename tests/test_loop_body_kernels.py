"""profiling.loop_body_kernels (compile_offline's per-stage kernel list), read from an optimized
HLO (here a CPU compile)."""

import jax
import jax.numpy as jnp

from ddtree_jax.tools import profiling


def test_body_kernels_are_attributed_to_the_step_stages():
  def body(carry):
    i, x = carry
    with jax.named_scope("draft"):
      y = jnp.sort(x * 3.0)
    with jax.named_scope("verify"):
      z = jnp.cumsum(jnp.exp(y)) + jnp.max(y)
    return i + 1, z / z[-1]

  loop = lambda x: jax.lax.while_loop(lambda c: c[0] < 5, body, (0, x))[1]
  hlo = jax.jit(loop).lower(jnp.ones(64)).compile().as_text()
  kernels = profiling.loop_body_kernels(hlo)
  stages = [stage for stage, _, _ in kernels]
  assert "draft" in stages and "verify" in stages
  assert stages.index("draft") < stages.index("verify")  # in program order
  assert any("sort" in what for stage, _, what in kernels if stage == "draft")
  assert set(stages) <= {"draft", "tree", "verify", "accept_commit", "other"}
