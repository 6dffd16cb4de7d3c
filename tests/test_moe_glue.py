"""The kernels around the MoE decode experts (`pallas.moe_glue`, interpret mode on CPU): the
router's partial logits against their jnp reference and `moe.router_logits`, the combine + shared
+ residual + RMSNorm against `decoder.mlp_block`'s XLA form (elsewhere pairs whose rows hold NaN,
rank order, the bf16 roundings), and both inside `moe_decode` / `Kernels.moe_residual` for each
expert format under ragged routing: experts no token chose, every token on one expert."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import kernels
from ddtree_jax.models import moe
from ddtree_jax.models.ops import rms_norm
from ddtree_jax.pallas import moe_decode, moe_glue
from helpers import assert_close_rel

F32, BF16 = jnp.float32, jnp.bfloat16
H, E, I = 256, 12, 256
LAUNCH = dict(gate_up_block=64, span=48, block_k=128, down_blocks=(16, 64, 128), down_span=48,
              router=(4, 8, 32, 4))


def _layer(fmt="float", seed=0, rows=3, dtype=F32):
  key = jax.random.key(seed)
  params = moe.init_params(key, H, E, I, dtype, std=0.3, experts=fmt)
  return params, jax.random.normal(jax.random.fold_in(key, 1), (rows, H), dtype)


@pytest.mark.parametrize("splits,block_e", [(1, 16), (4, 8), (8, 32)])
def test_router_partials_sum_to_the_router_logits(splits, block_e):
  """Each slice's partial equals the reference's (12 experts: a ragged last block), and their
  sum the float32 router; a TF32 product would miss by ~1e-3."""
  params, x = _layer(rows=2)
  got = moe_glue.router_partials(x, params.router, splits=splits, block_e=block_e, block_h=32)
  want = moe_glue.router_partials_reference(x, params.router, splits)
  assert got.shape == (splits, 2, E)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(jnp.sum(got, 0), moe.router_logits(params, x), rtol=1e-5, atol=1e-5)


def test_router_partials_refuse_slices_that_do_not_fit():
  params, x = _layer(rows=1)
  with pytest.raises(ValueError, match="split"):
    moe_glue.router_partials(x, params.router, splits=3, block_h=32)
  with pytest.raises(ValueError, match="float32"):
    moe_glue.router_partials(x, params.router.astype(BF16), splits=2, block_h=32)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("shared", [False, True])
def test_combine_norm_equals_the_xla_form(dtype, shared):
  """x + (sum of ranks + shared), then RMSNorm, with the XLA form's roundings; pairs held
  elsewhere have NaN rows that must not leak, and a whole row elsewhere adds nothing."""
  r, k = 3, 4
  rng = np.random.default_rng(0)
  y = jnp.asarray(rng.normal(size=(r * k, H)), dtype)
  here = np.ones(r * k, np.int32)
  here[[1, 6, 8, 9, 10, 11]] = 0                     # row 2 entirely elsewhere
  y = y.at[np.flatnonzero(here == 0)].set(jnp.nan)
  w = jnp.asarray(rng.uniform(size=(r, k)), F32)
  x = jnp.asarray(rng.normal(size=(r, H)), dtype)
  norm = jnp.asarray(1 + 0.1 * rng.normal(size=H), dtype)
  extra = jnp.asarray(rng.normal(size=(r, H)), dtype) if shared else None
  got = moe_glue.combine_norm(y, w, jnp.asarray(here), x, norm, extra, eps=1e-6)
  want = moe_glue.combine_norm_reference(y, w, jnp.asarray(here), x, norm, extra, eps=1e-6)
  for g, wv in zip(got, want):
    assert g.dtype == dtype and np.all(np.isfinite(np.asarray(g, F32)))
    tol = 1e-6 if dtype == F32 else 1e-2
    np.testing.assert_allclose(np.asarray(g, F32), np.asarray(wv, F32), rtol=tol, atol=tol)
  base = x[2] + (extra[2] if shared else 0)
  np.testing.assert_allclose(np.asarray(got[0][2], F32), np.asarray(base, F32), rtol=1e-2)
  # the reference is the decoder's own form: the mixture, the shared experts, the add, the norm
  y0 = jnp.where(jnp.asarray(here)[:, None] > 0, y, 0).astype(F32).reshape(r, k, H)
  mix = jnp.einsum("rkh,rk->rh", y0, w).astype(dtype)
  xs = x + (mix + extra if shared else mix)
  np.testing.assert_allclose(np.asarray(want[1], F32), np.asarray(rms_norm(xs, norm, 1e-6), F32),
                             rtol=2e-2, atol=2e-2)


def test_combine_norm_refuses_misfit_shapes():
  y, w = jnp.zeros((6, H)), jnp.zeros((3, 2))
  with pytest.raises(ValueError, match="do not fit"):
    moe_glue.combine_norm(y, w, jnp.ones(5, jnp.int32), jnp.zeros((3, H)), jnp.ones(H), eps=1e-6)


def _ragged(routing, rows, kind):
  """experts [rows, k]: every row on the same k experts (one expert takes every token, most take
  none), or rows on disjoint experts."""
  k = routing.top_k
  if kind == "same":
    return jnp.tile(jnp.arange(k, dtype=jnp.int32)[None], (rows, 1))
  return jnp.asarray(np.arange(rows * k).reshape(rows, k) % E, jnp.int32)


@pytest.mark.parametrize("fmt", ["float", "int4", "fp8"])
@pytest.mark.parametrize("kind", ["same", "spread"])
def test_decode_with_residual_under_ragged_routing(fmt, kind):
  """moe_decode over given experts with the residual: the reference mixture, plus the shared
  output and the residual, normed; gate/up and down spans of 48 columns in 64-wide loads (a
  ragged last span)."""
  routing = moe.Routing(3, norm_topk_prob=True)
  params, x = _layer(fmt, rows=3)
  ex = _ragged(routing, 3, kind)
  w = jax.nn.softmax(jax.random.normal(jax.random.key(5), ex.shape), -1)
  resid = jax.random.normal(jax.random.key(6), x.shape)
  shared = jax.random.normal(jax.random.key(7), x.shape)
  norm = 1 + 0.1 * jax.random.normal(jax.random.key(8), (H,))
  got_x, got_h = moe_decode.moe_decode(params, x, routing, w, ex, resid, norm, shared, eps=1e-6,
                                       **LAUNCH)
  want_x = resid + (moe.reference(params, x, w, ex) + shared)
  assert_close_rel(got_x, want_x, 1e-5)
  assert_close_rel(got_h, rms_norm(want_x, norm, 1e-6), 1e-5)
  plain = moe_decode.moe_decode(params, x, routing, w, ex, **LAUNCH)
  assert_close_rel(plain, moe.reference(params, x, w, ex), 1e-5)


@pytest.mark.parametrize("fmt", ["float", "int4"])
def test_routed_in_kernel_from_partials(fmt):
  """Routed inside the gate/up kernel from the router kernel's partials (4 slices): the
  reference mixture of `moe.route`'s choice, with and without the residual."""
  routing = moe.Routing(3, norm_topk_prob=True)
  params, x = _layer(fmt)
  w, ex = moe.route(params, x, routing)
  want = moe.reference(params, x, w, ex)
  assert_close_rel(moe_decode.moe_decode(params, x, routing, **LAUNCH), want, 1e-5)
  norm = jnp.ones((H,))
  got_x, _ = moe_decode.moe_decode(params, x, routing, residual=x, norm=norm, eps=1e-6, **LAUNCH)
  assert_close_rel(got_x, x + want, 1e-5)


def test_fill_span_spreads_pairs_over_the_sms():
  """Qwen3-30B-A3B at one token: 8 pairs x 16 programs of 48 columns in 64-wide loads; spans
  are multiples of 16 and never wider than the load."""
  assert moe_decode.fill_span(768, 8, 132, 64) == (48, 64)
  assert moe_decode.fill_span(768, 64, 132, 64) == (64, 64)
  assert moe_decode.fill_span(768, 16, 132, 128) == (96, 128)
  for n, p in ((768, 6), (1408, 6), (2048, 8), (512, 1)):
    span, width = moe_decode.fill_span(n, p, 132, 128)
    assert span % 16 == 0 and span <= width <= 128 and width & (width - 1) == 0


def test_kernels_moe_residual_equals_the_xla_block():
  """Kernels("pallas").moe_residual at decode rows (the fused launch: a moe_combine_norm call)
  and past them equals Kernels("xla")'s moe, shared add, residual add and norm."""
  routing = moe.Routing(3, norm_topk_prob=True)
  params, x = _layer(rows=4)
  tuning = kernels.KernelTuning(moe_decode_max=9, moe_decode_launch=(64, 128, 4),
                                moe_pair_blocks=(16, 32, 128), moe_router_launch=(4, 8, 32, 4))
  fused = kernels.Kernels("pallas", tuning=tuning).moe_residual
  plain = kernels.Kernels("xla").moe_residual
  resid, norm = 2 * x[::-1], jnp.full((H,), 1.5)
  for rows, decode in ((1, True), (3, True), (4, False)):
    args = (params, resid[:rows], x[:rows], x[:rows] * 0.5, norm)
    call = lambda *a: fused(*a, routing=routing, eps=1e-6)
    jaxpr = str(jax.make_jaxpr(call)(*args))
    assert ("moe_combine_norm" in jaxpr) == decode and ("moe_router" in jaxpr) == decode
    for g, w in zip(call(*args), plain(*args, routing=routing, eps=1e-6)):
      assert_close_rel(g, w, 1e-5)
