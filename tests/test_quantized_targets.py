"""Quantized targets as published: Kimi K2.5 / K2.6 (`kimi_k25`, routed experts compressed-tensors
int4) and DeepSeek-V3 (block FP8). The routed experts stay quantized on the device; parity with
HF DeepseekV3ForCausalLM run on the dequantized weights (tests/fixtures/make_hf_reference.py)."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dj
from ddtree_jax import kernels, sharding
from ddtree_jax.checkpoints import quantized
from ddtree_jax.checkpoints.safetensors_io import CheckpointError, read_safetensors, write_safetensors
from ddtree_jax.checkpoints.tensor_reader import TensorReader
from ddtree_jax.models import moe, quant
from helpers import (assert_close_rel, assert_lossless, assert_real_drafter_lossless,
                     cached_decode_logits, copy_fixture, drafter_and_ar, load_fixture,
                     oracle_drafter)

KIMI, FP8 = "kimi_k25_int4", "dsv3_fp8"
M = 24
PROMPTS = [[3, 17, 99, 4, 250, 31, 8], [42], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 9]]


def _edit(path, fn):
  """config.json of checkpoint `path` rewritten by fn(dict) (in place)."""
  file = os.path.join(path, "config.json")
  with open(file) as f:
    cfg = json.load(f)
  fn(cfg)
  with open(file, "w") as f:
    json.dump(cfg, f)


def _tensors(path):
  file = os.path.join(path, "model.safetensors")
  return file, {k: np.array(v) for k, v in read_safetensors(file).items()}


# --------------------------------------------------------------------------------------------
# Parity with HF, and what stays quantized


@pytest.mark.parametrize("name", [KIMI, FP8])
def test_forward_logits_match_hf(name):
  target, ref = load_fixture(name)
  assert_close_rel(dj.forward_logits(target, ref["input_ids"]), ref["logits"])


@pytest.mark.parametrize("name", [KIMI, FP8])
def test_greedy_24_tokens_match_hf(name):
  target, ref = load_fixture(name)
  res = dj.generate(target, [ref["prompt"].tolist()], max_new_tokens=24, stop_token_ids=())
  assert res.tokens[0] == ref["greedy"].tolist()
  assert_close_rel(cached_decode_logits(target, ref["prompt"], ref["greedy"]), ref["decode_logits"])


@pytest.mark.parametrize("name,kind,bits", [(KIMI, quant.Int4Experts, 4),
                                            (FP8, quant.Fp8Experts, 8)])
def test_routed_experts_stay_quantized_on_the_device(name, kind, bits):
  target, _ = load_fixture(name)
  cfg = target.config
  for i in cfg.moe_layers:
    moe = target.params.layers[i].moe
    for w, (k, n) in ((moe.w_gate_up, (cfg.hidden_size, 2 * cfg.moe_intermediate_size)),
                      (moe.w_down, (cfg.moe_intermediate_size, cfg.hidden_size))):
      assert isinstance(w, kind)
      weights = cfg.num_experts * k * n
      values = w.packed if bits == 4 else w.q
      assert values.nbytes * 8 == weights * bits
      assert w.scale.nbytes < values.nbytes / 4
  dense = [x for x in jax.tree.leaves(target.params, is_leaf=quant.is_quantized)
           if not quant.is_quantized(x)]
  assert all(x.dtype == jnp.float32 for x in dense)


def test_int4_unpacking_equals_compressed_tensors():
  """Layer 1's expert 0 gate projection on the device equals compressed-tensors' own
  decompression of it (the fixture script's), bit for bit in float32."""
  target, ref = load_fixture(KIMI)
  w = target.params.layers[1].moe.w_gate_up
  got = quant.dequantize(quant.take(w, jnp.array([0])), jnp.float32)[0, :, 0, :]   # [H, I]
  np.testing.assert_array_equal(np.asarray(got).T, ref["expert_l1_e0_gate"])


def _rounded_experts(params):
  """params with every quantized stack replaced by its weights rounded to bfloat16 (float32
  arrays): the model a dequantizer that multiplies in bfloat16 writes out (compressed-tensors'
  with Kimi's bfloat16 scales, as the fixture script checks)."""
  return jax.tree.map(lambda w: quant.dequantize(w, jnp.bfloat16).astype(jnp.float32)
                      if quant.is_quantized(w) else w, params, is_leaf=quant.is_quantized)


@pytest.mark.parametrize("name", [KIMI, FP8])
def test_float32_logits_are_the_dequantized_models(name, caplog):
  """load_target(dtype="float32") with experts kept quantized: logits within 1e-5 of HF on the
  float32 dequantized weights, a tolerance the same model on bfloat16-rounded weights misses by
  10x or more (about 4e-3 here). At bfloat16 the logits are the bfloat16 model's on the
  dequantized weights (that model's own distance from HF, routing flips included, is not the
  experts'). The load says what the experts compute in."""
  path = os.path.join(os.path.dirname(__file__), "fixtures", "hf", name)
  ids = jnp.asarray(np.load(os.path.join(path, "reference.npz"))["input_ids"])
  with caplog.at_level("INFO", logger=quantized.__name__):
    target, ref = load_fixture(name)
  fmt = "int4 (groups of 32)" if name == KIMI else "fp8 (blocks of"
  assert any(fmt in r.getMessage() and "products in float32" in r.getMessage()
             for r in caplog.records), [r.getMessage() for r in caplog.records]
  assert_close_rel(dj.forward_logits(target, ids), ref["logits"], 1e-5)
  rounded = dataclasses.replace(target, params=_rounded_experts(target.params))
  off = np.abs(np.asarray(dj.forward_logits(rounded, ids)) - ref["logits"])
  assert off.max() > 1e-4 * np.abs(ref["logits"]).max()
  low = dj.load_target(path, dtype="bfloat16")
  floats = jax.tree.map(lambda w: quant.dequantize(w, jnp.bfloat16) if quant.is_quantized(w)
                        else w, low.params, is_leaf=quant.is_quantized)
  assert_close_rel(dj.forward_logits(low, ids),
                   dj.forward_logits(dataclasses.replace(low, params=floats), ids), 1e-3)


def test_float16_experts_run_xla_s_form_and_say_so(caplog):
  """The Pallas expert kernels take float32 or bfloat16: at float16 the quantized experts run
  XLA's dequantizing form (the layer still works on the Pallas kernels) and the load says so."""
  with caplog.at_level("INFO", logger=quantized.__name__):
    target = dj.load_target(os.path.join(os.path.dirname(__file__), "fixtures", "hf", KIMI),
                            dtype="float16")
  assert any("float16 through XLA's" in r.getMessage() for r in caplog.records)
  moe_params = target.params.layers[1].moe
  x = jax.random.normal(jax.random.key(0), (2, target.config.hidden_size), jnp.float16)
  routing = target.config.routing
  got = kernels.Kernels("pallas").moe(moe_params, x, routing=routing)
  w, ex = moe.route(moe_params, x, routing)
  assert got.dtype == jnp.float16
  assert_close_rel(got, moe.reference(moe_params, x, w, ex), 1e-3)


# --------------------------------------------------------------------------------------------
# The wrapper: what is skipped, what never runs


def test_vision_mtp_skipped_code_never_runs_and_strays_refused(tmp_path):
  path = copy_fixture(tmp_path, KIMI)
  names = set(read_safetensors(os.path.join(path, "model.safetensors")))
  assert any(n.startswith("vision_tower.") for n in names)
  assert any(n.startswith("mm_projector.") for n in names)
  assert any(n.startswith("language_model.model.layers.3.") for n in names)  # MTP
  assert any(n.endswith(".py") for n in os.listdir(path))
  dj.load_target(path, dtype="float32")
  assert not os.path.exists(os.path.join(path, "CANARY_EXECUTED"))
  file, t = _tensors(path)
  t["language_model.model.layers.0.stray.weight"] = np.zeros((4,), np.float32)
  write_safetensors(file, t)
  with pytest.raises(CheckpointError, match=r"does not read .*layers\.0\.stray"):
    dj.load_target(path, dtype="float32")


def test_a_kimi_k25_wrapper_without_its_text_model_is_refused(tmp_path):
  path = copy_fixture(tmp_path, KIMI)
  _edit(path, lambda c: c["text_config"].update(model_type="llama"))
  with pytest.raises(ValueError, match="text_config.model_type='llama'"):
    dj.load_target(path, dtype="float32")


# --------------------------------------------------------------------------------------------
# Bad quantized tensors and formats not implemented: errors that name them

EXPERT = "language_model.model.layers.1.mlp.experts.2.down_proj."


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.update({EXPERT + "weight_shape": np.array([64, 128], np.int32)}),
     r"weight_shape' is \[64, 128\], the model expects \[64, 64\]"),
    (lambda t: t.pop(EXPERT + "weight_scale"), r"has no '.*down_proj\.weight_scale'"),
    (lambda t: t.update({EXPERT + "weight_packed": t[EXPERT + "weight_packed"][:, :4]}),
     r"weight_packed' is int32 \(64, 4\), expected int32 \(64, 8\)"),
])
def test_broken_int4_tensors_are_named_with_their_file(tmp_path, edit, match):
  path = copy_fixture(tmp_path, KIMI)
  file, t = _tensors(path)
  edit(t)
  write_safetensors(file, t)
  with pytest.raises(CheckpointError, match=match) as err:
    dj.load_target(path, dtype="float32")
  assert "model.safetensors" in str(err.value)


def test_a_group_size_that_does_not_divide_the_inputs_is_named():
  packed = np.zeros((8, 5), np.int32)                         # in = 40: not groups of 32
  r = TensorReader({"w.weight_packed": packed, "w.weight_scale": np.ones((8, 1), np.float32),
                    "w.weight_shape": np.array([8, 40], np.int32)}, "ckpt",
                   quantized.Quantization(int4_group=32))
  with pytest.raises(CheckpointError, match="group_size 32 does not divide the input dim 40"):
    r.quantized_linear("w.weight", 8, 40)


def _quantization(cfg):
  """Kimi ships its quantization_config inside text_config (compressed-tensors and the loader
  look at the top level first, then there)."""
  return cfg["text_config"]["quantization_config"]


def _group(cfg):
  return _quantization(cfg)["config_groups"]["group_0"]


@pytest.mark.parametrize("edit,match", [
    (lambda c: _group(c)["weights"].update(symmetric=False), "symmetric=False"),
    (lambda c: _group(c)["weights"].update(actorder="group"), "actorder='group'"),
    (lambda c: _group(c)["weights"].update(group_size=128), "group_size=128"),
    (lambda c: _group(c)["weights"].update(num_bits=8), "num_bits=8"),
    (lambda c: _group(c).update(input_activations={"num_bits": 8}), "input_activations"),
    (lambda c: _quantization(c).update(format="int-quantized"), "int-quantized"),
])
def test_compressed_tensors_schemes_not_implemented_are_refused(tmp_path, edit, match):
  path = copy_fixture(tmp_path, KIMI)
  _edit(path, edit)
  with pytest.raises(ValueError, match=match):
    dj.load_target(path, dtype="float32")


# --------------------------------------------------------------------------------------------
# Lossless speculative decoding on the int4 target, on one device and on meshes


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  target, _ = load_fixture(KIMI)
  return (target, *drafter_and_ar(str(tmp_path_factory.mktemp("drafter")), target, PROMPTS, M,
                                  (0, 2)))


@pytest.mark.parametrize("method,budget", [("chain", None), ("ddtree", 1), ("ddtree", 16),
                                           ("ddtree", 64)])  # every budget: test_decode
@pytest.mark.parametrize("batch", [1, 3])
def test_speculative_decoding_on_the_int4_target_is_lossless(setup, method, budget, batch):
  target, drafter, ar = setup
  assert_lossless(target, drafter, PROMPTS[:batch], ar[:batch], method, budget, M,
                  seed=1 + (budget or 0))


def test_real_drafter_and_the_int4_pallas_kernels_are_lossless(setup):
  """The drafter's own forward in the loop; DDTree on the Pallas kernels, whose int4 expert
  GEMMs dequantize in the kernel (`pallas/quant_gemm.py`, interpret mode here)."""
  assert_real_drafter_lossless(*setup[:2], PROMPTS, setup[2])


@pytest.mark.parametrize("shape", [{"ep": 8}, {"tp": 2, "ep": 4}])
def test_int4_experts_over_expert_parallel_meshes_give_one_devices_tokens(setup, shape):
  target, drafter, ar = setup
  mesh = sharding.make_mesh({"dp": 1, "tp": 1, **shape})
  sharded, _ = load_fixture(KIMI, mesh=mesh)
  packed = sharded.params.layers[1].moe.w_gate_up.packed
  assert packed.addressable_shards[0].data.shape[0] == 8 // shape["ep"]
  d = oracle_drafter(dj.load_drafter(drafter.path, sharded), PROMPTS, ar)
  res = dj.generate(sharded, PROMPTS, method="ddtree", drafter=d, budget=16, max_new_tokens=M,
                    stop_token_ids=())
  assert res.tokens == ar
