"""The committed quantized fixtures are in the formats their makers ship (checked on the files
alone, with numpy, independent of the engine's loaders):

  kimi_k25_int4  Kimi K2.5 / K2.6: a kimi_k25 wrapper config (quantization_config inside
                 text_config), `language_model.` text tensors, routed experts as
                 compressed-tensors pack-quantized int4, vision / projector / MTP tensors.
  dsv3_fp8       DeepSeek-V3: top-level fp8 quantization_config, decoder-layer Linears as
                 float8_e4m3fn `weight` + float32 `weight_scale_inv` per 32x32 block.

Both reference.npz files hold `expert_l1_e0_gate`, the float32 weight HF's model ran with for
layer 1 expert 0's gate_proj; unpacking the stored tensors here must give it bit for bit.

The hybrid fixtures (qwen3_5_text, qwen3_next, qwen3_5_moe_text) hold Gated DeltaNet layers in
the two tensor layouts (separate projections; fused in_proj_qkvz / in_proj_ba) where
config.json's layer types say, and a reference whose greedy tokens are its decode logits'
argmax.
"""

import json
import math
import os
import re

import ml_dtypes
import numpy as np
import pytest

from conftest import FIXTURES
from ddtree_jax.checkpoints.safetensors_io import read_safetensors

KIMI = os.path.join(FIXTURES, "kimi_k25_int4")
FP8 = os.path.join(FIXTURES, "dsv3_fp8")
EXPERT = "model.layers.1.mlp.experts.0.gate_proj"
GREEDY_TOKENS = 24


def _config(path):
  with open(os.path.join(path, "config.json")) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def kimi():
  return (_config(KIMI), read_safetensors(os.path.join(KIMI, "model.safetensors")),
          np.load(os.path.join(KIMI, "reference.npz")))


@pytest.fixture(scope="module")
def fp8():
  return (_config(FP8), read_safetensors(os.path.join(FP8, "model.safetensors")),
          np.load(os.path.join(FP8, "reference.npz")))


def unpack_int4(packed, scale, group_size=32):
  """compressed-tensors pack-quantized int4 -> float32 [out, in]: input 8r+j is nibble j of
  int32 word r (lowest bits first), stored + 8; times the scale of its group of inputs."""
  words = packed.view(np.uint32)
  nibbles = (words[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
  q = nibbles.reshape(packed.shape[0], -1).astype(np.float32) - 8
  return q * np.repeat(scale.astype(np.float32), group_size, axis=1)


def dequantize_fp8(weight, scale_inv, block=(32, 32)):
  """DeepSeek FP8 -> float32 [out, in]: each weight times its block's scale."""
  out, inp = weight.shape
  full = np.repeat(np.repeat(scale_inv, block[0], axis=0), block[1], axis=1)[:out, :inp]
  return weight.astype(np.float32) * full


def _check_reference(ref, hidden):
  assert ref["input_ids"].shape == (2, 11) and ref["logits"].shape == (2, 11, 256)
  assert ref["hidden_states"].shape == (4, 2, 11, hidden)
  assert ref["greedy"].shape == (GREEDY_TOKENS,) and ref["greedy"].dtype == np.int32
  assert ref["decode_logits"].shape == (GREEDY_TOKENS, 256)
  np.testing.assert_array_equal(ref["decode_logits"].argmax(-1), ref["greedy"])


def test_kimi_config(kimi):
  cfg, _, _ = kimi
  assert cfg["model_type"] == "kimi_k25"
  assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
  assert cfg["auto_map"]["AutoConfig"] == "configuration_kimi_k25.KimiK25Config"
  assert isinstance(cfg["vision_config"], dict) and "media_placeholder_token_id" in cfg
  text = cfg["text_config"]
  assert text["model_type"] == "kimi_k2" and text["architectures"] == ["DeepseekV3ForCausalLM"]
  assert text["num_nextn_predict_layers"] == 1 and text["moe_intermediate_size"] % 32 == 0
  assert text["rope_scaling"]["type"] == "yarn" and text["rope_scaling"]["factor"] == 4.0
  # As Moonshot ships it: in text_config, not at the top level.
  assert "quantization_config" not in cfg
  q = text["quantization_config"]
  assert (q["quant_method"], q["format"], q["quantization_status"]) == (
      "compressed-tensors", "pack-quantized", "compressed")
  group = q["config_groups"]["group_0"]
  assert group["targets"] == ["Linear"]
  assert group["input_activations"] is None and group["output_activations"] is None
  w = group["weights"]
  assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"],
          w["dynamic"], w["actorder"]) == (4, "int", True, "group", 32, False, None)
  assert q["ignore"][:4] == ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                             "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]


def test_kimi_tensors(kimi):
  cfg, tensors, _ = kimi
  text = cfg["text_config"]
  h, e = text["hidden_size"], text["moe_intermediate_size"]
  layers, experts = text["num_hidden_layers"], text["n_routed_experts"]
  shapes = {"gate_proj": (e, h), "up_proj": (e, h), "down_proj": (h, e)}
  routed = set()
  for layer in range(text["first_k_dense_replace"], layers):
    for x in range(experts):
      for proj, (out, inp) in shapes.items():
        m = f"language_model.model.layers.{layer}.mlp.experts.{x}.{proj}"
        packed, scale, shape = (tensors[f"{m}.weight_packed"], tensors[f"{m}.weight_scale"],
                                tensors[f"{m}.weight_shape"])
        assert packed.dtype == np.int32 and packed.shape == (out, inp // 8)
        assert scale.dtype == ml_dtypes.bfloat16 and scale.shape == (out, inp // 32)
        assert shape.dtype == np.int32 and shape.tolist() == [out, inp]
        assert (scale.astype(np.float32) > 0).all()
        assert f"{m}.weight" not in tensors
        routed |= {f"{m}.weight_packed", f"{m}.weight_scale", f"{m}.weight_shape"}
  # The text model's other tensors are float32, under language_model.
  text_model = re.compile(rf"^language_model\.(lm_head|model\.(embed_tokens|norm|"
                          rf"layers\.({'|'.join(map(str, range(layers)))})\.))")
  for name, t in tensors.items():
    if text_model.match(name) and name not in routed:
      assert t.dtype == np.float32, name
  assert tensors["language_model.lm_head.weight"].shape == (text["vocab_size"], h)
  assert tensors["language_model.model.layers.1.mlp.gate.e_score_correction_bias"].shape == (
      experts,)
  assert not any(n.startswith("model.") for n in tensors)
  # What the text model does not run: the MTP layer, the vision tower, its projector.
  mtp = f"language_model.model.layers.{layers}."
  for suffix in ("enorm.weight", "hnorm.weight", "eh_proj.weight_packed",
                 "input_layernorm.weight"):
    assert mtp + suffix in tensors, suffix
  assert any(n.startswith("vision_tower.") for n in tensors)
  assert any(n.startswith("mm_projector.") for n in tensors)


def test_kimi_int4_unpacks_to_reference(kimi):
  _, tensors, ref = kimi
  m = "language_model." + EXPERT
  weight = unpack_int4(tensors[m + ".weight_packed"], tensors[m + ".weight_scale"])
  assert weight.shape == tuple(tensors[m + ".weight_shape"])
  np.testing.assert_array_equal(weight, ref["expert_l1_e0_gate"])
  # Symmetric int4: stored nibbles span the full 0..15 (values -8..7).
  nibbles = (tensors[m + ".weight_packed"].view(np.uint32)[..., None]
             >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
  assert nibbles.min() == 0 and nibbles.max() == 15


def test_kimi_reference_and_canaries(kimi):
  _, _, ref = kimi
  _check_reference(ref, 64)
  for name in ("configuration_kimi_k25.py", "modeling_kimi_k25.py",
               "configuration_deepseek.py", "modeling_deepseek.py"):
    with open(os.path.join(KIMI, name)) as f:
      assert "CANARY_EXECUTED" in f.read()
  assert not os.path.exists(os.path.join(KIMI, "CANARY_EXECUTED"))


def test_fp8_config(fp8):
  cfg, _, _ = fp8
  assert cfg["model_type"] == "deepseek_v3"
  assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3",
                                        "quant_method": "fp8", "weight_block_size": [32, 32]}


def test_fp8_tensors(fp8):
  cfg, tensors, _ = fp8
  linear = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\..*proj(_with_mqa)?\.weight$")
  quantized = [n for n in tensors if linear.match(n)]
  # attention (q_a, q_b, kv_a, kv_b, o) per layer, dense MLP, shared and routed experts
  layers, dense = cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
  assert len(quantized) == 5 * layers + 3 * dense + 3 * (layers - dense) * (
      cfg["n_routed_experts"] + 1)
  partial = 0
  for name in quantized:
    w, s = tensors[name], tensors[name + "_scale_inv"]
    assert w.dtype == ml_dtypes.float8_e4m3fn and w.ndim == 2, name
    assert s.dtype == np.float32 and s.shape == tuple(math.ceil(d / 32) for d in w.shape), name
    assert (s > 0).all(), name
    partial += any(d % 32 for d in w.shape)
    # scale = max|block| / 448: every block reaches the largest e4m3 value
    f = np.abs(w.astype(np.float32))
    f = np.pad(f, [(0, -f.shape[0] % 32), (0, -f.shape[1] % 32)])
    block_max = f.reshape(f.shape[0] // 32, 32, f.shape[1] // 32, 32).max(axis=(1, 3))
    np.testing.assert_array_equal(block_max, 448.0, err_msg=name)
  assert partial > 0, "no weight with a partial edge block"
  for name, t in tensors.items():
    if name not in quantized and not name.endswith("_scale_inv"):
      assert t.dtype == np.float32, name
  for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight"):
    assert tensors[name].dtype == np.float32 and name + "_scale_inv" not in tensors


def test_fp8_dequantizes_to_reference(fp8):
  _, tensors, ref = fp8
  name = EXPERT + ".weight"
  weight = dequantize_fp8(tensors[name], tensors[name + "_scale_inv"])
  np.testing.assert_array_equal(weight, ref["expert_l1_e0_gate"])
  _check_reference(ref, tensors["model.embed_tokens.weight"].shape[1])


LINEAR_THEN_FULL = ["linear_attention"] * 3 + ["full_attention"]


@pytest.mark.parametrize("name,fused,kinds", [
    ("qwen3_5_text", False, LINEAR_THEN_FULL), ("qwen3_next", True, LINEAR_THEN_FULL),
    ("qwen3_5_moe_text", False, ["linear_attention", "full_attention"] * 2)])
def test_hybrid_fixtures_hold_both_layer_kinds(name, fused, kinds):
  d = os.path.join(FIXTURES, name)
  with open(os.path.join(d, "config.json")) as f:
    cfg = json.load(f)
  tensors = read_safetensors(os.path.join(d, "model.safetensors"))
  assert cfg["layer_types"] == kinds
  hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
  dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
  conv_dim = 2 * hk * dk + hv * dv
  for i, kind in enumerate(kinds):
    prefix = f"model.layers.{i}."
    names = {n[len(prefix):] for n in tensors if n.startswith(prefix)}
    if kind == "full_attention":
      assert "self_attn.q_proj.weight" in names and not any("linear_attn" in n for n in names)
      # the q projection also yields the output gate: 2 x heads x head_dim rows
      assert tensors[f"model.layers.{i}.self_attn.q_proj.weight"].shape[0] == (
          2 * cfg["num_attention_heads"] * cfg["head_dim"])
      continue
    pre = f"model.layers.{i}.linear_attn."
    assert tensors[pre + "conv1d.weight"].shape == (conv_dim, 1, cfg["linear_conv_kernel_dim"])
    if fused:
      assert tensors[pre + "in_proj_qkvz.weight"].shape[0] == conv_dim + hv * dv
      assert tensors[pre + "in_proj_ba.weight"].shape[0] == 2 * hv
    else:
      assert tensors[pre + "in_proj_qkv.weight"].shape[0] == conv_dim
      assert {pre + f"in_proj_{x}.weight" for x in "zba"} <= set(tensors)
  ref = np.load(os.path.join(d, "reference.npz"))
  np.testing.assert_array_equal(np.argmax(ref["decode_logits"], -1), ref["greedy"])
  assert len(ref["greedy"]) == 24
