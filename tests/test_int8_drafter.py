"""Int8 (W8A8) drafter: the quantization, the int8 matmul, and decoding with it stays lossless
(the drafts change a little; the output is still the target's)."""

import dataclasses

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ddtree_jax as dj
from ddtree_jax import sharding
from ddtree_jax.models import ops
from ddtree_jax.checkpoints import export as hf_export
from ddtree_jax.models import decoder
from ddtree_jax.training import losses as training
from helpers import PAIR_NEW_TOKENS, PAIR_PROMPTS, assert_accepted, oracle_drafter, small_pair

M, PROMPTS = PAIR_NEW_TOKENS, PAIR_PROMPTS


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  return small_pair(str(tmp_path_factory.mktemp("int8")))


def test_quantize_int8_rounds_each_output_channel():
  rng = np.random.default_rng(0)
  w = rng.standard_normal((5, 3, 4)).astype(np.float32)
  w[:, 1, 2] = 0.0                      # an all-zero channel
  w[:, 0, 0] *= 100.0                   # a channel on another scale
  qw = ops.quantize_int8(w)
  assert qw.q.dtype == jnp.int8 and qw.q.shape == (3, 4, 5) and qw.scale.shape == (3, 4)
  assert qw.shape == (5, 3, 4)                           # the float weight's
  q, scale = np.moveaxis(np.asarray(qw.q, np.float32), -1, 0), np.asarray(qw.scale)
  assert np.all(np.abs(q * scale - w) <= scale / 2 * (1 + 1e-6))
  assert np.all(np.max(np.abs(q), axis=0)[scale != 1.0] == 127)  # the channel's max maps to 127
  assert scale[1, 2] == 1.0 and np.all(q[:, 1, 2] == 0)
  assert ops.quantize_int8(rng.standard_normal((2, 3, 4)), num_in=2).scale.shape == (4,)


def test_dense_with_int8_weight_is_w8a8():
  """Each row of x over its contracted dims gets its own int8 scale; the result is the einsum of
  the dequantized operands (exact int32 accumulation), close to the float einsum."""
  rng = np.random.default_rng(1)
  x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
  x[1, 2] = 0.0                                           # an all-zero row
  x[0, 1] *= 50.0                                         # a row on another scale
  w = rng.standard_normal((4, 5, 6)).astype(np.float32)  # [N, D, H] as wo
  qw = ops.quantize_int8(w, num_in=2)
  got = np.asarray(ops.dense("btnd,ndh->bth", jnp.asarray(x), qw))
  sx = np.maximum(np.abs(x).max(axis=(2, 3), keepdims=True), 1e-30) / 127
  xq = np.round(x / sx) * sx
  deq = np.moveaxis(np.asarray(qw.q, np.float32), 0, -1) * np.asarray(qw.scale)  # [N, D, H]
  want = np.einsum("btnd,ndh->bth", xq, deq)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert np.all(got[1, 2] == 0)
  exact = np.einsum("btnd,ndh->bth", x, w)
  assert np.max(np.abs(got - exact) / np.maximum(np.abs(exact).max(-1, keepdims=True), 1)) < 3e-2
  y = ops.dense("bth,hv->btv", jnp.asarray(x[..., 0, :4], jnp.bfloat16),
                  ops.quantize_int8(w[:, 0]), jnp.float32)
  assert y.dtype == jnp.float32 and y.shape == (2, 3, 6)
  with pytest.raises(ValueError, match="kept dims"):
    ops.dense("bth,hv->vbt", jnp.asarray(x[..., 0, :4]), ops.quantize_int8(w[:, 0]))
  with pytest.raises(ValueError, match="num_in"):  # wo quantized as if it had one input dim
    ops.dense("btnd,ndh->bth", jnp.asarray(x), ops.quantize_int8(w))


def test_int8_drafter_drafts_near_the_float_one_and_decodes_losslessly(pair):
  target, path, ar = pair
  d, d8 = dj.load_drafter(path, target), dj.load_drafter(path, target, int8=True)
  h, v = target.config.hidden_size, target.config.vocab_size
  assert isinstance(d8.params.layers[0].w_down, ops.Int8Weight)
  assert isinstance(d8.params.fc, ops.Int8Weight) and d8.params.lm_head.shape == (h, v)
  assert decoder.param_bytes(d8.params) < 0.5 * decoder.param_bytes(d.params) + 2 * h * v
  a, b = dj.draft_logits(target, d, PROMPTS[0]), dj.draft_logits(target, d8, PROMPTS[0])
  assert a.shape == b.shape
  err = float(jnp.max(jnp.abs(a - b))) / float(jnp.std(a))
  assert 0 < err < 0.25, err            # W8A8, so not equal, but close on the logits' scale
  # the int8 drafter gives every logit but the oracle's two picks: its drafts get accepted
  over = oracle_drafter(d8, PROMPTS, ar, over_real=True)
  for method, budget in (("chain", None), ("ddtree", 16), ("ddtree", 3)):
    res = dj.generate(target, PROMPTS, method=method, drafter=over, budget=budget,
                      max_new_tokens=M, stop_token_ids=())
    assert res.tokens == ar, (method, budget)
    assert_accepted(over, PROMPTS, res, method, budget)


def test_int8_context_kv_uses_the_stacked_weight(pair):
  """The context rows' k/v come from one GEMM over every layer's stacked int8 k/v weight: the same
  int8 values as the layers' own, so exactly the per-layer result."""
  target, path, _ = pair
  d8 = dj.load_drafter(path, target, int8=True)
  p, layers = d8.params, d8.params.layers
  assert p.context_wkv.shape == (layers[0].wkv.shape[0], len(layers)) + layers[0].wkv.shape[1:]
  for i, layer in enumerate(layers):
    np.testing.assert_array_equal(p.context_wkv.q[i], layer.wkv.q)
    np.testing.assert_array_equal(p.context_wkv.scale[i], layer.wkv.scale)
  rng = np.random.default_rng(2)
  taps = jnp.asarray(rng.standard_normal((2, 5, p.fc.shape[0])), jnp.float32)
  pos = jnp.asarray(np.arange(10).reshape(2, 5), jnp.int32)
  got = d8.config.context(p, taps, pos)
  want = d8.config.context(dataclasses.replace(p, context_wkv=None), taps, pos)
  chex.assert_trees_all_equal(got, want)
  # it reads the stacked weight, not the layers' own: zeroing theirs changes nothing
  zeroed = [dataclasses.replace(l, wkv=dataclasses.replace(l.wkv, q=jnp.zeros_like(l.wkv.q)))
            for l in layers]
  chex.assert_trees_all_equal(d8.config.context(dataclasses.replace(p, layers=zeroed), taps, pos),
                              got)
  assert float(jnp.max(jnp.abs(got[0][0]))) > 0


def test_int8_drafter_sharded_equals_unsharded(pair):
  target, path, ar = pair
  d8 = dj.load_drafter(path, target, int8=True)
  want = dj.generate(target, PROMPTS, method="ddtree", drafter=d8, budget=16, max_new_tokens=M,
                     stop_token_ids=())
  mesh = sharding.make_mesh({"dp": 2, "tp": 4})
  st = dj.load_target(target.path, dtype="float32", mesh=mesh)
  sd8 = dj.load_drafter(path, st, int8=True)
  laid = lambda x, *spec: x.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec)), x.ndim)
  # q is [out..., in...]: each weight's float split moves with its dims (sharding.py's table)
  layer, p = sd8.params.layers[0], sd8.params
  for w, q_spec, s_spec in ((layer.wq, ("tp", None, None), ("tp", None)),
                            (layer.wkv, (None, "tp", None, None), (None, "tp", None)),
                            (layer.w_gate_up, (None, "tp", None), (None, "tp")),
                            (layer.w_down, (None, "tp"), (None,)),
                            (p.fc, ("tp", None), ("tp",)), (p.lm_head, ("tp", None), ("tp",)),
                            (p.context_wkv, (None, None, "tp", None, None), (None, None, "tp"))):
    assert laid(w.q, *q_spec) and laid(w.scale, *s_spec), (w.shape, w.q.sharding, w.scale.sharding)
  assert not isinstance(layer.wo, ops.Int8Weight)  # o stays float
  assert laid(layer.wo, "tp", None, None)
  np.testing.assert_allclose(dj.draft_logits(st, sd8, PROMPTS[0]),
                             dj.draft_logits(target, d8, PROMPTS[0]), rtol=1e-5, atol=1e-5)
  res = dj.generate(st, PROMPTS, method="ddtree", drafter=sd8, budget=16, max_new_tokens=M,
                    stop_token_ids=())
  assert res.tokens == ar == want.tokens
  assert res.stats["acceptance_lengths"] == want.stats["acceptance_lengths"]


def test_int8_drafter_is_not_saved_or_trained(pair, tmp_path):
  target, path, _ = pair
  d8 = dj.load_drafter(path, target, int8=True)
  with pytest.raises(ValueError, match="int8"):
    hf_export.save_drafter_hf(str(tmp_path / "out"), d8.params, d8.config,
                               target.config.num_layers)
  with pytest.raises(ValueError, match="int8"):
    training.drafter_block_logits(d8.params, d8.config, target.params, None, None, None)
