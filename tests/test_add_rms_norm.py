"""The Pallas split-K sum + residual add + RMSNorm (interpret mode on CPU) against
`ops.residual_norm`, and the decode loop with it."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dj
from conftest import FIXTURES
from ddtree_jax import kernels
from ddtree_jax.models import ops
from ddtree_jax.models import decoder
from ddtree_jax.pallas import add_rms_norm as arn
from helpers import (abstract_h200_mesh, assert_accepted, oracle_drafter, triton_custom_calls, verify_triton_ir,
                     write_drafter)

O_SPEC, DOWN_SPEC = "btnd,ndh->bth", "bti,ih->bth"


def _inputs(b, t, a_shape, h, dtype, seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *shape, s=1.0: jnp.asarray(rng.standard_normal(shape) * s, dtype)
  c = int(np.prod(a_shape))
  return (f(b, t, h, s=2.0), f(b, t, *a_shape), f(*a_shape, h, s=c ** -0.5),
          (1 + f(h, s=0.2)).astype(dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("spec,a_shape,b,t,splits", [
    (O_SPEC, (4, 16), 2, 5, 1), (O_SPEC, (4, 16), 2, 5, 2), (O_SPEC, (4, 16), 1, 65, 4),
    (O_SPEC, (4, 16), 3, 1, 4), (DOWN_SPEC, (96,), 1, 7, 8), (DOWN_SPEC, (1024,), 1, 65, None)])
def test_equals_xla_form(dtype, spec, a_shape, b, t, splits):
  """The o and down sites at every split count (None: the rule's 2 slices at 65 rows), through
  the kernel: float32 to summation order; bf16 within a few bf16 roundings (the projection's
  float32 sum runs in another order than XLA's GEMM)."""
  x, a, w, norm = _inputs(b, t, a_shape, 64, dtype)
  fn = functools.partial(arn.residual_norm, spec=spec, eps=1e-6, splits=splits)
  assert "pallas_call" in str(jax.make_jaxpr(lambda *q: fn(*q[:1], a=q[1], w=q[2], norm=q[3]))(
      x, a, w, norm))
  got = arn.residual_norm(x, spec, a, w, norm, eps=1e-6, splits=splits)
  want = ops.residual_norm(x, spec, a, w, norm, eps=1e-6)
  for g, ref in zip(got, want):
    assert g.shape == ref.shape == x.shape and g.dtype == ref.dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(ref, np.float32),
                               rtol=tol, atol=tol)


def test_bf16_roundings_match_op_by_op():
  """Given the same float32 projection, the kernel rounds as ops.residual_norm does op by op:
  the projection, the add, x / rms, and the weight product each to bf16 (bit for bit). The
  partials are multiples of 1/64 below 8, so their float32 sum is exact in any order."""
  rng = np.random.default_rng(1)
  bf = jnp.bfloat16
  partials = jnp.asarray(rng.integers(-512, 512, (4, 9, 64)) / 64, jnp.float32)
  x = jnp.asarray(rng.standard_normal((9, 64)) * 3, bf)
  norm = jnp.asarray(1 + 0.2 * rng.standard_normal(64), bf)
  got = arn.add_rms_norm(partials, x, norm, eps=1e-6)
  y = partials[0]
  for s in range(1, 4):
    y = y + partials[s]
  want_x = x + y.astype(bf)
  want_h = ops.rms_norm(want_x, norm, 1e-6)
  np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want_x, np.float32))
  np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(want_h, np.float32))


@pytest.mark.parametrize("case", ["int8", "hidden_not_pow2", "mixed_dtypes", "splits_not_dividing"])
def test_other_inputs_take_the_xla_path(case):
  """Int8 weights (the drafter's down), a hidden size Triton cannot block, mixed dtypes and a
  split count that does not divide the contracted dim run `ops.residual_norm` as it is."""
  x, a, w, norm = _inputs(2, 3, (96,), 48 if case == "hidden_not_pow2" else 64, jnp.float32)
  splits = 4
  if case == "int8":
    w = ops.quantize_int8(w)
  elif case == "mixed_dtypes":
    norm = norm.astype(jnp.bfloat16)
  elif case == "splits_not_dividing":
    x, a, w, norm = _inputs(2, 3, (40,), 64, jnp.float32)
    splits = 16
  fn = functools.partial(arn.residual_norm, spec=DOWN_SPEC, eps=1e-6, splits=splits)
  jaxpr = str(jax.make_jaxpr(lambda x, a, w, n: fn(x, a=a, w=w, norm=n))(x, a, w, norm))
  assert "pallas_call" not in jaxpr
  want = ops.residual_norm(x, DOWN_SPEC, a, w, norm, eps=1e-6)
  for g, ref in zip(fn(x, a=a, w=w, norm=norm), want):
    np.testing.assert_array_equal(g, ref)


def test_refuses_other_specs_and_shapes():
  x, a, w, norm = _inputs(1, 2, (4, 16), 64, jnp.float32)
  with pytest.raises(ValueError, match="must be 'bt<c>,<c>h->bth'"):
    arn.residual_norm(x, "btnd,ndh->bht", a, w, norm, eps=1e-6)
  with pytest.raises(ValueError, match="do not match"):  # same sizes, other dims
    arn.residual_norm(x, O_SPEC, a.reshape(1, 2, 16, 4), w, norm, eps=1e-6)


def test_forward_hidden_and_taps_equal_xla_form(monkeypatch):
  """A 2-layer float32 target forward with the Pallas kernels, the residual kernel at every site
  (2 slices forced by the tuning), gives the XLA form's final hidden and the taps (the residual
  stream after each layer)."""
  from ddtree_jax.models.config import ModelConfig
  cfg = ModelConfig(model_type="qwen3", vocab_size=50, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4)
  params = decoder.init_params(cfg, jax.random.key(0), jnp.float32, std=0.1)
  cache = decoder.init_cache(2, 1, 2, 16, 16, jnp.float32)
  tokens = jnp.array([[3, 9, 4, 1, 7]], jnp.int32)
  pos = jnp.arange(5, dtype=jnp.int32)[None]
  mask = decoder.causal_mask(jnp.array([5]), 5)
  run = lambda k: decoder.forward(params, cfg, tokens, pos, cache, mask, (0, 1), kernels=k)
  tuning = kernels.KernelTuning(residual_rows=(1, 64), residual_splits=((0, 2),),
                                residual_min_depth=16)
  kernel, launches = arn.add_rms_norm, []
  monkeypatch.setattr(arn, "add_rms_norm", lambda p, *a, **kw: launches.append(p.shape) or
                      kernel(p, *a, **kw))
  got = run(kernels.Kernels("pallas", tuning=tuning))
  assert len(launches) == 2 * cfg.num_layers  # every o and down site took the kernel
  want = run(kernels.REFERENCE)
  for i in (0, 2):  # hidden, taps
    np.testing.assert_allclose(got[i], want[i], rtol=1e-5, atol=1e-5)


def test_kernel_switch_picks_the_kernel_only_with_pallas_and_no_mesh():
  from ddtree_jax import sharding  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh({"dp": 2, "tp": 4})
  assert kernels.Kernels().residual_norm is ops.residual_norm
  fn = kernels.Kernels("pallas").residual_norm
  assert fn.func is arn.residual_norm and fn.keywords == {"tuning": kernels.KernelTuning()}
  assert kernels.Kernels("pallas", mesh=mesh).residual_norm is ops.residual_norm
  off = kernels.Kernels("pallas").outside_verify  # prefill and drafter: XLA's form
  assert off.tuning.residual_split_count(64, 4096) == 0 and off.attention == "pallas"
  assert off == kernels.Kernels("pallas").outside_verify and hash(off) == hash(
      kernels.Kernels("pallas").outside_verify)


def test_kernel_refuses_what_triton_cannot_block():
  x = jnp.zeros((2, 48), jnp.float32)
  with pytest.raises(ValueError, match="powers of two"):
    arn.add_rms_norm(jnp.zeros((2, 2, 48)), x, jnp.ones(48), eps=1e-6)
  with pytest.raises(ValueError, match="powers of two"):
    arn.add_rms_norm(jnp.zeros((3, 2, 64)), jnp.zeros((2, 64)), jnp.ones(64), eps=1e-6)


@pytest.mark.parametrize("rows,contracted,want", [(1, 4096, 0), (33, 4096, 0), (63, 12288, 0),
                                                  (64, 4096, 4), (65, 12288, 8), (128, 4096, 4),
                                                  (129, 4096, 0), (65, 1024, 2), (65, 96, 0)])
def test_default_splits(rows, contracted, want):
  """XLA's form outside 64-128 rows and where no 2+ slices of >= 512 fit; inside, 8 or 4 slices
  that divide the contracted dim and are >= 512 deep."""
  assert kernels.KernelTuning().residual_split_count(rows, contracted) == want


@pytest.mark.parametrize("rows,contracted,splits", [(1, 4096, 4), (65, 4096, 4), (65, 12288, 8),
                                                    (520, 12288, 1)])
def test_lowers_for_h200(rows, contracted, splits):
  """Qwen3-8B's o and down sites (H = 4096) in bf16: one Triton custom call with valid IR."""
  sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
  args = (sds((1, rows, 4096), bf), sds((1, rows, contracted), bf), sds((contracted, 4096), bf),
          sds((4096,), bf))
  fn = lambda x, a, w, n: arn.residual_norm(x, DOWN_SPEC, a, w, n, eps=1e-6, splits=splits,
                                           interpret=False)
  with jax.sharding.use_abstract_mesh(abstract_h200_mesh()):
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  calls = triton_custom_calls(lowered)
  assert len(calls) == 1
  verify_triton_ir(calls[0])


def test_decode_with_split_kernel_is_lossless(monkeypatch, tmp_path):
  """DDTree B=16 and chain (17 and 6 rows per sequence, 3 ragged prompts) with Pallas attention
  in float32, the o and down GEMMs forced into 4 and 2 split-K slices by the tuning (the tiny
  model's dims are below the default 512-deep slices): the tokens equal XLA AR's."""
  prompts, m = [[3, 17, 99, 4, 250, 31, 8], [42], [9, 8, 7, 6, 5]], 11
  target = dj.load_target(os.path.join(FIXTURES, "qwen3_gqa"), dtype="float32")
  drafter = dj.load_drafter(write_drafter(str(tmp_path), target.config, block_size=6), target)
  ar = dj.generate(target, prompts, max_new_tokens=m, stop_token_ids=(), attention="xla").tokens
  drafter = oracle_drafter(drafter, prompts, ar, corruption=0.3)
  cfg = target.config
  o_dim, down_dim = cfg.num_heads * cfg.head_dim, cfg.intermediate_size
  assert o_dim > down_dim  # (least contracted dim, slices), first match
  tuning = kernels.KernelTuning(residual_rows=(16, 1 << 20), residual_min_depth=16,
                                residual_splits=((o_dim, 4), (down_dim, 2)))
  kernel, launches = arn.add_rms_norm, []
  monkeypatch.setattr(arn, "add_rms_norm", lambda p, *a, **kw: launches.append(p.shape) or
                      kernel(p, *a, **kw))
  for method, budget in (("ddtree", 16), ("chain", None)):
    out = dj.generate(target, prompts, method=method, drafter=drafter, budget=budget,
                      max_new_tokens=m, stop_token_ids=(), attention="pallas",
                      kernel_tuning=tuning)
    assert out.tokens == ar, method
    assert_accepted(drafter, prompts, out, method, budget)
  # the B=16 verify's o and down sites (3 x 17 rows) took the kernel; the prefill (3 x 16) not
  assert {(4, 51, cfg.hidden_size), (2, 51, cfg.hidden_size)} <= set(launches)
  assert all(rows != 48 for _, rows, _ in launches)
