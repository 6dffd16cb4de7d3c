"""The Pallas q/k RMSNorm + RoPE kernel (interpret mode on CPU) against `model.norm_rope`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ddtree_jax import model, sharding
from ddtree_jax.config import ModelConfig
from ddtree_jax.pallas import qk_norm_rope
from helpers import abstract_h200_mesh, triton_custom_calls, verify_triton_ir


def _inputs(b, t, n, k, d, dtype, norms=True, seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *shape, s=1.0: jnp.asarray(rng.standard_normal(shape) * s, dtype)
  cfg = ModelConfig(model_type="qwen3", vocab_size=8, hidden_size=n * d, intermediate_size=8,
                    num_layers=1, num_heads=k, num_kv_heads=k, head_dim=d, rope_theta=1e6)  # RoPE
  positions = jnp.asarray(rng.integers(0, 4096, (b, t)), jnp.int32)
  cos, sin = model.rope_tables(cfg, positions, dtype)
  norm = lambda: (1 + f(d, s=0.2)).astype(dtype) if norms else None
  return f(b, t, n, d, s=3.0), f(b, t, 2, k, d), norm(), norm(), cos, sin


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("b,t,n,k,d", [(2, 5, 8, 2, 32), (1, 3, 4, 4, 128), (3, 1, 2, 1, 16),
                                       (2, 3, 6, 2, 32), (1, 2, 40, 8, 16), (1, 2, 12, 6, 16),
                                       (2, 3, 2, 6, 16), (1, 2, 3, 3, 16)])
def test_kernel_equals_norm_rope(dtype, b, t, n, k, d):
  """bf16: bit for bit (the kernel rounds where each XLA op does); float32: to summation order."""
  args = _inputs(b, t, n, k, d, dtype)
  got = qk_norm_rope(*args, eps=1e-6)
  want = model.norm_rope(*args, eps=1e-6)
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    if dtype == jnp.bfloat16:
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    else:
      np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-6)
  np.testing.assert_array_equal(got[2], args[1][:, :, 1])  # v is the projection's second half


@pytest.mark.parametrize("case", ["no_norms", "half_dim_not_pow2", "mixed_dtypes"])
def test_other_inputs_take_the_xla_path(case):
  """Llama (no q/k norm), a D/2 Triton cannot block and a float32 norm with bf16 activations
  take `model.norm_rope` as it is."""
  args = _inputs(2, 3, 4, 2, 24 if case == "half_dim_not_pow2" else 16,
                 jnp.bfloat16 if case == "mixed_dtypes" else jnp.float32, norms=case != "no_norms")
  if case == "mixed_dtypes":
    args = (*args[:2], args[2].astype(jnp.float32), *args[3:])
  jaxpr = str(jax.make_jaxpr(functools.partial(qk_norm_rope, eps=1e-6))(*args))
  assert "pallas_call" not in jaxpr
  want = jax.jit(functools.partial(model.norm_rope, eps=1e-6))(*args)
  for g, w in zip(qk_norm_rope(*args, eps=1e-6), want):
    np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("rules,n,k", [(sharding.ShardingRules(), 8, 4),
                                      (sharding.ShardingRules(kv_heads=None), 16, 4),
                                      (sharding.ShardingRules(kv_heads=None), 8, 4)],
                         ids=["kv_split", "kv_replicated", "kv_replicated_more_than_q"])
def test_sharded_equals_unsharded(rules, n, k):
  """Per shard: 2 q heads with their 1 kv head; 4 q heads with all 4 kv heads (replicated); 2 q
  heads with all 4 kv heads. The kernel runs on every shard."""
  mesh = sharding.make_mesh({"dp": 2, "tp": 4})
  args = _inputs(2, 5, n, k, 32, jnp.float32)
  kv = "tp" if rules.kv_heads else None
  specs = (P("dp", None, "tp", None), P("dp", None, None, kv, None), P(), P(), P("dp"), P("dp"))
  placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
  fn = jax.jit(functools.partial(sharding.shard_qk_norm_rope(qk_norm_rope, mesh, rules), eps=1e-6))
  assert "pallas_call" in str(jax.make_jaxpr(fn)(*placed))
  got = fn(*placed)
  assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, specs[0]), 4)
  for g, w in zip(got, model.norm_rope(*args, eps=1e-6)):
    np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("t,n,k", [(1, 32, 8), (33, 32, 8), (65, 32, 8), (65, 40, 8), (7, 6, 2),
                                   (5, 2, 6)])
def test_lowers_for_h200(t, n, k):
  """Qwen3-8B / 14B heads (32 or 40 q, 8 kv, D=128), the bundled model's (6 / 2) and a tp shard
  with more kv than q heads (2 / 6) in bf16: one Triton custom call with valid IR."""
  sds = jax.ShapeDtypeStruct
  bf = jnp.bfloat16
  args = (sds((1, t, n, 128), bf), sds((1, t, 2, k, 128), bf), sds((128,), bf), sds((128,), bf),
          sds((1, t, 128), bf), sds((1, t, 128), bf))
  fn = functools.partial(qk_norm_rope, eps=1e-6, interpret=False)
  with jax.sharding.use_abstract_mesh(abstract_h200_mesh()):
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  calls = triton_custom_calls(lowered)
  assert len(calls) == 1
  verify_triton_ir(calls[0])
