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


def test_costliest_path_takes_the_largest_branch_of_each_switch():
  """A loop whose body switches between a cheap and a dear branch (the dear one with a nested
  cond): the path counts the dear branch's kernels and both conditionals; dropping the dear
  branch's extra work lowers it, as a step of budget="auto" runs one branch per switch."""
  def loop(dear_work):
    def body(carry):
      i, x = carry
      def cheap(x):
        return x + 1.0
      def dear(x):
        for _ in range(dear_work):
          x = jnp.sort(jnp.exp(x))[::-1] * 0.5
        return jax.lax.cond(x[0] > 0, lambda y: jnp.cumsum(y), lambda y: y * 2.0, x)
      return i + 1, jax.lax.switch(i % 2, [cheap, dear], x)
    return lambda x: jax.lax.while_loop(lambda c: c[0] < 5, body, (0, x))[1]

  counts = {w: profiling.costliest_path(jax.jit(loop(w)).lower(jnp.ones(64)).compile().as_text())
            for w in (1, 4)}
  assert counts[4]["conditionals"] == counts[1]["conditionals"] == 2
  assert counts[4]["kernels"] > counts[1]["kernels"] > 2
