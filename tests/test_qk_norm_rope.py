"""The Pallas q/k RMSNorm + RoPE kernel (interpret mode on CPU) against `attention.norm_rope`."""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ddtree_jax as dj
from conftest import FIXTURES
from ddtree_jax import kernels, sharding
from ddtree_jax.models import attention
from ddtree_jax.models import ops
from ddtree_jax.models import decoder
from ddtree_jax.checkpoints import tensor_reader
from ddtree_jax.models.config import ModelConfig
from ddtree_jax.pallas import qk_norm_rope as qk_lib
from ddtree_jax.pallas.qk_norm_rope import qk_norm_rope
from helpers import (abstract_h200_mesh, assert_accepted, oracle_drafter, triton_custom_calls, verify_triton_ir,
                     write_drafter)


def _inputs(b, t, n, k, d, dtype, norms=True, seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *shape, s=1.0: jnp.asarray(rng.standard_normal(shape) * s, dtype)
  cfg = ModelConfig(model_type="qwen3", vocab_size=8, hidden_size=n * d, intermediate_size=8,
                    num_layers=1, num_heads=k, num_kv_heads=k, head_dim=d, rope_theta=1e6)  # RoPE
  positions = jnp.asarray(rng.integers(0, 4096, (b, t)), jnp.int32)
  cos, sin = ops.rope_tables(cfg, positions, dtype)
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
  want = attention.norm_rope(*args, eps=1e-6)
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
  take `attention.norm_rope` as it is."""
  args = _inputs(2, 3, 4, 2, 24 if case == "half_dim_not_pow2" else 16,
                 jnp.bfloat16 if case == "mixed_dtypes" else jnp.float32, norms=case != "no_norms")
  if case == "mixed_dtypes":
    args = (*args[:2], args[2].astype(jnp.float32), *args[3:])
  jaxpr = str(jax.make_jaxpr(functools.partial(qk_norm_rope, eps=1e-6))(*args))
  assert "pallas_call" not in jaxpr
  want = jax.jit(functools.partial(attention.norm_rope, eps=1e-6))(*args)
  for g, w in zip(qk_norm_rope(*args, eps=1e-6), want):
    np.testing.assert_array_equal(g, w)


def _layer(hid, n, k, d, dtype, seed=1, fused=False):
  rng = np.random.default_rng(seed)
  f = lambda *shape, s=0.3: jnp.asarray(rng.standard_normal(shape) * s, dtype)
  layer = decoder.LayerParams(input_norm=None, wq=f(hid, n, d), wkv=f(hid, 2, k, d), wo=f(n, d, hid),
                            q_norm=1 + f(d), k_norm=1 + f(d), post_norm=None, w_gate_up=None,
                            w_down=None)
  if fused:
    layer = decoder.fuse_qkv(decoder.Params(embed=None, layers=[layer], final_norm=None,
                                        lm_head=None)).layers[0]
  return layer


@pytest.mark.parametrize("rules,n,k", [(sharding.ShardingRules(), 8, 4),
                                      (sharding.ShardingRules(kv_heads=None), 16, 4),
                                      (sharding.ShardingRules(kv_heads=None), 8, 4)],
                         ids=["kv_split", "kv_replicated", "kv_replicated_more_than_q"])
def test_sharded_equals_unsharded(rules, n, k):
  """The mesh hook: GSPMD projections, then per shard 2 q heads with their 1 kv head; 4 q heads
  with all 4 kv heads (replicated); 2 q heads with all 4 kv heads. The kernel runs on every
  shard."""
  mesh = sharding.make_mesh({"dp": 2, "tp": 4})
  _, _, _, _, cos, sin = _inputs(2, 5, n, k, 32, jnp.float32)
  layer = _layer(24, n, k, 32, jnp.float32)
  h = jnp.asarray(np.random.default_rng(2).standard_normal((2, 5, 24)), jnp.float32)
  kv = "tp" if rules.kv_heads else None
  put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
  placed = dataclasses.replace(layer, wq=put(layer.wq, None, "tp", None),
                               wkv=put(layer.wkv, None, None, kv, None))
  fn = jax.jit(functools.partial(kernels.shard_qk_norm_rope(qk_norm_rope, mesh, rules), eps=1e-6))
  args = (placed, put(h, "dp"), put(cos, "dp"), put(sin, "dp"))
  assert "pallas_call" in str(jax.make_jaxpr(fn)(*args))
  got = fn(*args)
  assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, P("dp", None, "tp", None)), 4)
  for g, w in zip(got, attention.project_norm_rope(layer, h, cos, sin, eps=1e-6)):
    np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-6)
  with pytest.raises(ValueError, match="one device"):
    fn(_layer(24, n, k, 32, jnp.float32, fused=True), *args[1:])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("splits", [None, 0, 1, 2, 3, 4])
def test_fused_projection(dtype, splits):
  """A fused layer (`decoder.fuse_qkv`) through the kernel hook, its split-K partials summed in the
  kernel (S = 2-4), against the unfused XLA form: float32 to summation order; bf16 within one
  bf16 rounding of the projection (a different summation order), and bit for bit against the
  same projection rounded and normed op by op in XLA."""
  b, t, hid, n, k, d = 2, 3, 48, 6, 2, 16
  _, _, _, _, cos, sin = _inputs(b, t, n, k, d, dtype)
  layer = _layer(hid, n, k, d, dtype)
  fused = _layer(hid, n, k, d, dtype, fused=True)
  assert fused.wq is None and fused.wqkv.shape == (hid, n + 2 * k, d)
  h = jnp.asarray(np.random.default_rng(3).standard_normal((b, t, hid)), dtype)
  got = qk_lib.project_qk_norm_rope(fused, h, cos, sin, eps=1e-6, splits=splits)
  want = attention.project_norm_rope(layer, h, cos, sin, eps=1e-6)
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    tol = 2e-5 if dtype == jnp.float32 else 0.07
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol,
                               atol=tol)
  s = splits or 1
  hs = h.reshape(b, t, s, hid // s).astype(jnp.float32)
  ws = fused.wqkv.reshape(s, hid // s, n + 2 * k, d).astype(jnp.float32)
  y = sum(jnp.einsum("btc,cnd->btnd", hs[:, :, i], ws[i]) for i in range(s)).astype(dtype)
  q, kv = ops.split_qkv(y, n)
  if dtype == jnp.bfloat16 and splits not in (None, 0):  # same float32 partials, same sum order
    for g, w in zip(got, attention.norm_rope(q, kv, layer.q_norm, layer.k_norm, cos, sin, eps=1e-6)):
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_split_rule_and_xla_path_of_fused_layers():
  rule = kernels.KernelTuning().qkv_split_count
  assert [rule(r) for r in (1, 31, 32, 33, 65, 128, 129)] == [0, 0, 2, 2, 2, 2, 0]
  layer = _layer(32, 4, 2, 16, jnp.float32, fused=True)
  _, _, _, _, cos, sin = _inputs(1, 2, 4, 2, 16, jnp.float32)
  h = jnp.ones((1, 2, 32), jnp.float32)
  unfused = _layer(32, 4, 2, 16, jnp.float32)
  for g, w in zip(attention.project_norm_rope(layer, h, cos, sin, eps=1e-6),
                  attention.project_norm_rope(unfused, h, cos, sin, eps=1e-6)):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="int8"):
    decoder.fuse_qkv(decoder.Params(embed=None, final_norm=None, lm_head=None, layers=[
        dataclasses.replace(unfused, wq=ops.quantize_int8(unfused.wq))]))
  with pytest.raises(ValueError, match="own wkv"):
    attention.project_kv(layer, None, h, cos, sin)
  params = lambda *layers: decoder.Params(embed=None, final_norm=None, lm_head=None,
                                        layers=list(layers))
  with pytest.raises(ValueError, match="wq is float32 but wkv bfloat16"):
    decoder.fuse_qkv(params(dataclasses.replace(unfused, wkv=unfused.wkv.astype(jnp.bfloat16))))
  with pytest.raises(ValueError, match="neither wqkv nor both"):
    decoder.fuse_qkv(params(dataclasses.replace(unfused, wkv=None)))
  mesh = sharding.make_mesh({"dp": 1, "tp": 2})
  sharded = jax.device_put(unfused.wq, NamedSharding(mesh, P(None, "tp")))
  with pytest.raises(ValueError, match="placed on several devices"):
    decoder.fuse_qkv(params(dataclasses.replace(unfused, wq=sharded)))
  fused_twice = decoder.fuse_qkv(params(layer)).layers[0]
  assert fused_twice.wqkv is layer.wqkv


@pytest.mark.parametrize("case,fused", [(c, f) for c in ("no_norms", "half_dim_not_pow2",
                                                          "mixed_dtypes") for f in (False, True)]
                         + [("fused_weight_dtype", True)])
def test_project_hook_takes_xla_path_where_kernel_does_not_apply(case, fused):
  """Where the kernel would fall back (Llama, D/2 not a power of two, a float32 norm or fused
  weight with bf16 activations), the hook is `attention.project_norm_rope` as it is: no kernel and
  no split-K, even at row counts where the tuning splits."""
  d = 24 if case == "half_dim_not_pow2" else 16
  dtype = jnp.bfloat16 if case in ("mixed_dtypes", "fused_weight_dtype") else jnp.float32
  layer = _layer(32, 4, 2, d, dtype, fused=fused)
  if case == "no_norms":
    layer = dataclasses.replace(layer, q_norm=None, k_norm=None)
  if case == "mixed_dtypes":
    layer = dataclasses.replace(layer, q_norm=layer.q_norm.astype(jnp.float32))
  if case == "fused_weight_dtype":
    layer = dataclasses.replace(layer, wqkv=layer.wqkv.astype(jnp.float32))
  _, _, _, _, cos, sin = _inputs(1, 40, 4, 2, d, dtype)
  h = jnp.asarray(np.random.default_rng(3).standard_normal((1, 40, 32)), dtype)
  assert kernels.KernelTuning().qkv_split_count(40) == 2
  hook = functools.partial(qk_lib.project_qk_norm_rope, eps=1e-6)
  jaxpr = str(jax.make_jaxpr(hook)(layer, h, cos, sin))
  assert "pallas_call" not in jaxpr and "float32[2," not in jaxpr
  want = jax.jit(functools.partial(attention.project_norm_rope, eps=1e-6))(layer, h, cos, sin)
  for g, w in zip(jax.jit(hook)(layer, h, cos, sin), want):
    assert g.dtype == w.dtype
    np.testing.assert_array_equal(g, w)


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


@pytest.mark.parametrize("t,splits", [(33, 2), (65, 2), (65, 1)])
def test_fused_operand_lowers_for_h200(t, splits):
  """Qwen3-8B's fused q/k/v operand (32 + 2 x 8 heads, D=128): S float32 partials or the bf16
  projection itself, one Triton custom call with valid IR."""
  sds = jax.ShapeDtypeStruct
  bf = jnp.bfloat16
  parts = sds((splits, 1, t, 48, 128), jnp.float32 if splits > 1 else bf)
  args = (parts, sds((128,), bf), sds((128,), bf), sds((1, t, 128), bf), sds((1, t, 128), bf))
  fn = functools.partial(qk_lib.qkv_norm_rope, n=32, eps=1e-6, interpret=False)
  with jax.sharding.use_abstract_mesh(abstract_h200_mesh()):
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  calls = triton_custom_calls(lowered)
  assert len(calls) == 1
  verify_triton_ir(calls[0])


def test_kernel_switch_picks_the_projection():
  mesh = sharding.make_mesh({"dp": 2, "tp": 4})
  tuning = kernels.KernelTuning(qkv_splits=4)
  assert kernels.Kernels().project_qkv is attention.project_norm_rope
  fn = kernels.Kernels("pallas", tuning=tuning).project_qkv
  assert fn.func is qk_lib.project_qk_norm_rope and fn.keywords == {"tuning": tuning}
  fn = kernels.Kernels("pallas", mesh=mesh).project_qkv
  assert fn.__qualname__.startswith("shard_qk_norm_rope")


def test_loaded_target_is_fused_and_exports_the_same(tmp_path):
  """load_target fuses q/k/v on one device (not on a mesh, not with fuse_qkv=False); both
  layouts give the same forward and export the same HF tensors."""
  from ddtree_jax.checkpoints import hf as checkpoint
  from ddtree_jax.checkpoints import export as hf_export  # pylint: disable=import-outside-toplevel
  path = os.path.join(FIXTURES, "qwen3_gqa")
  fused = dj.load_target(path, dtype="float32")
  plain = dj.load_target(path, dtype="float32", fuse_qkv=False)
  cfg = fused.config
  assert all(l.wqkv is not None and l.wq is None for l in fused.params.layers)
  assert all(l.wqkv is None for l in plain.params.layers)
  assert fused.params.layers[0].wqkv.shape == (cfg.hidden_size,
                                               cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
  tokens = jnp.asarray([[3, 17, 99, 4, 250]], jnp.int32)
  np.testing.assert_allclose(dj.forward_logits(fused, tokens),
                             dj.forward_logits(plain, tokens), rtol=1e-5, atol=1e-5)
  a = checkpoint.read_checkpoint_tensors(
      hf_export.save_target_hf(str(tmp_path / "f"), fused.params, cfg, dtype="float32"))
  b = checkpoint.read_checkpoint_tensors(
      hf_export.save_target_hf(str(tmp_path / "p"), plain.params, cfg, dtype="float32"))
  assert sorted(a) == sorted(b)
  for name in a:
    np.testing.assert_array_equal(a[name], b[name])
  for host, dev in zip(fused.params.layers, decoder.fuse_qkv(plain.params).layers):
    np.testing.assert_array_equal(host.wqkv, dev.wqkv)  # concatenated on the host = on device
  mesh = sharding.make_mesh({"dp": 2, "tp": 1})
  assert dj.load_target(path, dtype="float32", mesh=mesh).params.layers[0].wqkv is None
  with pytest.raises(ValueError, match="fuse_qkv=False"):
    sharding.shard_params(fused.params, mesh)
  with pytest.raises(ValueError, match="fuse_qkv is for one device"):
    checkpoint.load_target_params(path, cfg, jnp.float32, mesh=mesh, fuse_qkv=True)


def test_joined_reads_slices_of_the_concatenation():
  rng = np.random.default_rng(0)
  parts = [rng.standard_normal((3, n, 4)) for n in (5, 2, 2)]
  joined, want = tensor_reader.Joined(parts, axis=1), np.concatenate(parts, axis=1)
  assert joined.shape == want.shape
  for idx in [..., (slice(None),), (slice(1, 3), slice(4, 8)), (slice(None), slice(6, None),
                                                                 slice(0, 2))]:
    np.testing.assert_array_equal(joined[idx], want[idx])
  with pytest.raises(TypeError, match="slices only"):
    joined[0]


def test_fused_decode_with_forced_splits_is_lossless(monkeypatch, tmp_path):
  """DDTree B=16 and chain (17 and 6 rows per sequence, 3 ragged prompts) with Pallas attention
  in float32 on the fused target, its q/k/v projection forced into 4 split-K slices summed by
  the kernel (`KernelTuning`): the tokens equal XLA AR's on the unfused target."""
  prompts, m = [[3, 17, 99, 4, 250, 31, 8], [42], [9, 8, 7, 6, 5]], 13
  path = os.path.join(FIXTURES, "qwen3_gqa")
  target = dj.load_target(path, dtype="float32")
  plain = dj.load_target(path, dtype="float32", fuse_qkv=False)
  drafter = dj.load_drafter(write_drafter(str(tmp_path), target.config, block_size=6), target)
  ar = dj.generate(plain, prompts, max_new_tokens=m, stop_token_ids=(), attention="xla").tokens
  drafter = oracle_drafter(drafter, prompts, ar, corruption=0.3)
  tuning = kernels.KernelTuning(qkv_splits=4, qkv_rows=(16, 1 << 20))
  kernel, launches = qk_lib.qkv_norm_rope, []
  monkeypatch.setattr(qk_lib, "qkv_norm_rope", lambda p, *a, **kw: launches.append(p.shape) or
                      kernel(p, *a, **kw))
  for method, budget in (("ddtree", 16), ("chain", None)):
    out = dj.generate(target, prompts, method=method, drafter=drafter, budget=budget,
                      max_new_tokens=m, stop_token_ids=(), attention="pallas",
                      kernel_tuning=tuning)
    assert out.tokens == ar, method
    assert_accepted(drafter, prompts, out, method, budget)
  cfg = target.config
  heads = cfg.num_heads + 2 * cfg.num_kv_heads
  assert (4, 3, 17, heads, cfg.head_dim) in launches  # the tree verify took the split
