"""ops.einsum_weight: the engine's weight einsum gives a one-row input twice (so that
XLA:GPU keeps the dot a GEMM instead of a multiply + reduce) when each of the weight's matrices,
split over the mesh's tp axis, is under STRENGTH_REDUCED_DOT_ELEMENTS; the values are those of
jnp.einsum either way (CPU, float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ddtree_jax import sharding
from ddtree_jax.models import ops
from ddtree_jax.models.ops import einsum_weight


def _doubled(fn, *args) -> bool:
  """Whether fn's jaxpr broadcasts a size-1 dim of an input to 2 (the row given twice); traced
  afresh each time (a new function object: no trace cache across threshold changes)."""
  jaxpr = jax.make_jaxpr(lambda *a: fn(*a))(*args)
  return any(eqn.primitive.name == "broadcast_in_dim"
             and any(i == 1 and o == 2 for i, o in zip(eqn.invars[0].aval.shape,
                                                      eqn.outvars[0].aval.shape))
             for eqn in jaxpr.eqns)


@pytest.mark.parametrize("spec,x_shape,w_shape", [
    ("btc,ch->bth", (1, 1, 48), (48, 40)),            # one row: doubled
    ("btc,ch->bth", (1, 5, 48), (48, 40)),            # five rows: as is
    ("btnd,cnd->btnc", (1, 1, 4, 8), (24, 4, 8)),     # a dim of w's kept from x (a batch dim)
    ("bth,hnd->btnd", (1, 1, 16), (16, 3, 8)),        # two output dims of w
    ("...h,hv->...v", (1, 1, 16), (16, 24)),          # ellipsis: plain einsum
])
def test_values_equal_einsum(spec, x_shape, w_shape):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=x_shape), jnp.float32)
  w = jnp.asarray(rng.normal(size=w_shape), jnp.float32)
  want = jnp.einsum(spec, x, w, precision=jax.lax.Precision.HIGHEST)
  for f32 in (False, True):
    got = einsum_weight(spec, x, w, f32=f32)
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  got16 = einsum_weight(spec, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), f32=True)
  assert got16.dtype == jnp.float32 and got16.shape == want.shape


def test_one_row_is_doubled_under_the_threshold_only(monkeypatch):
  x1, x5 = jnp.ones((1, 1, 32)), jnp.ones((1, 5, 32))
  w = jnp.ones((32, 64))
  run = lambda x, w: einsum_weight("btc,ch->bth", x, w)
  assert _doubled(run, x1, w) and not _doubled(run, x5, w)
  monkeypatch.setattr(ops, "STRENGTH_REDUCED_DOT_ELEMENTS", 32 * 64)  # w is not under it
  assert not _doubled(run, x1, w)
  # per matrix: w_uk-like [C, N, D] with N a batch dim holds N matrices of C x D
  wb = jnp.ones((32, 4, 16))
  runb = lambda x, w: einsum_weight("btnd,cnd->btnc", x, w)
  monkeypatch.setattr(ops, "STRENGTH_REDUCED_DOT_ELEMENTS", 32 * 16 + 1)
  assert _doubled(runb, jnp.ones((1, 1, 4, 16)), wb)


def test_the_threshold_is_per_tp_shard(monkeypatch):
  """Under GSPMD XLA decides on each device's shard: a weight over the threshold whose tp shard is
  under it is doubled too (8 forced CPU devices, tests/conftest.py)."""
  mesh = sharding.make_mesh({"dp": 1, "tp": 8})
  w = jax.device_put(jnp.ones((32, 64)), NamedSharding(mesh, P(None, "tp")))
  x = jax.device_put(jnp.ones((1, 1, 32)), NamedSharding(mesh, P()))
  assert ops.tp_shards(w) == 8 and ops.tp_shards(jnp.ones(3)) == 1
  monkeypatch.setattr(ops, "STRENGTH_REDUCED_DOT_ELEMENTS", 32 * 64 // 4)
  run = lambda x, w: einsum_weight("btc,ch->bth", x, w)
  assert _doubled(run, x, w)                                  # 2048 / 8 < 512
  assert not _doubled(run, jnp.ones((1, 1, 32)), jnp.ones((32, 64)))  # one device
  np.testing.assert_allclose(np.asarray(jax.jit(run)(x, w)), np.full((1, 1, 64), 32.0))
