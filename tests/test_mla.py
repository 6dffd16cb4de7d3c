"""DeepSeek-V3 targets (multi-head latent attention + DeepSeekMoE): parity with HF transformers'
DeepseekV3ForCausalLM, the latent cache against per-head attention, lossless chain / DDTree,
FP8 block-quantised checkpoints, tensor / expert parallelism on 8 CPU devices, bad input."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import ddtree_jax as dj
from ddtree_jax import kernels, sharding
from ddtree_jax.models import ops
from ddtree_jax.checkpoints import hf as checkpoint
from ddtree_jax.models import mla
from ddtree_jax.models import decoder
from ddtree_jax.models import moe, quant
from ddtree_jax.pallas.latent_attention import latent_attention
from ddtree_jax.checkpoints.safetensors_io import CheckpointError, read_safetensors, write_safetensors
from helpers import (assert_close_rel, assert_lossless, assert_real_drafter_lossless,
                     cached_decode_logits, copy_fixture, drafter_and_ar, edit_config, load_fixture,
                     oracle_drafter, write_drafter)

FIXTURE_NAMES = ["dsv3_qlora_groups", "dsv3_plain"]
M = 32
PROMPTS = [[3, 17, 99, 4, 250, 31, 8], [42], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 9]]


# --------------------------------------------------------------------------------------------
# Config and parity with HF


def test_config_parsing():
  (groups, _), (plain, _) = (load_fixture(n) for n in FIXTURE_NAMES)
  g, p = groups.config, plain.config
  assert g.is_mla and g.q_lora_rank == 24 and p.q_lora_rank == 0
  assert g.cache_layout == (1, 40, 0) and g.head_dim == 24 and g.rope_dim == 8
  assert g.moe_layers == (1, 2) and g.routing == moe.Routing(2, True, "sigmoid", 4, 2, 2.5)
  assert g.rope_type == "yarn" and abs(g.rope_attention_factor - 0.964327) < 1e-6
  assert abs(g.attention_scale - 0.264642) < 1e-6 and abs(p.attention_scale - 24 ** -0.5) < 1e-9
  layer = groups.params.layers[1]
  assert layer.mla.wq is None and layer.mla.wq_b.shape == (24, 4, 24)
  assert layer.moe.bias.dtype == jnp.float32 and layer.w_gate_up.shape == (64, 2, 24)
  assert plain.params.layers[2].w_down.shape == (32, 64)  # 2 shared experts of 16


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_forward_logits_match_hf(name):
  target, ref = load_fixture(name)
  assert_close_rel(dj.forward_logits(target, ref["input_ids"]), ref["logits"])


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_greedy_24_tokens_match_hf(name):
  target, ref = load_fixture(name)
  res = dj.generate(target, [ref["prompt"].tolist()], max_new_tokens=24, stop_token_ids=())
  assert res.tokens[0] == ref["greedy"].tolist()
  assert_close_rel(cached_decode_logits(target, ref["prompt"], ref["greedy"]), ref["decode_logits"])


def test_latent_attention_equals_per_head_attention():
  """Absorbed attention over latent rows == decompressed per-head K/V, with ragged prefixes
  and a tree mask among the new rows."""
  cfg, _ = load_fixture("dsv3_qlora_groups")
  cfg = cfg.config
  p = mla.init_params(cfg, jax.random.key(1), jnp.float32, std=0.3)
  b, t, s = 2, 5, 12
  keys = jax.random.split(jax.random.key(2), 4)
  h = jax.random.normal(keys[0], (b, t, cfg.hidden_size))
  pos = 9 + jnp.broadcast_to(jnp.arange(t), (b, t))
  cos, sin = ops.rope_tables(cfg, pos, jnp.float32)
  q_nope, q_rope, new = mla.project(p, h, cos, sin)
  cache = jax.random.normal(keys[1], (b, 1, s, cfg.kv_lora_rank + cfg.qk_rope_head_dim))
  prefix = jnp.array([9, 4])
  parent = np.array([-1, 0, 0, 1, 2])
  mask = np.eye(t, dtype=bool)
  for i in range(t):
    j = parent[i]
    while j >= 0:
      mask[i, j], j = True, parent[j]
  mask = jnp.broadcast_to(jnp.asarray(mask), (b, t, t))
  got = mla.attend_latent(mla.absorb_query(p, q_nope, q_rope), cache, prefix, new, mask,
                          scale=cfg.attention_scale, value_dim=cfg.kv_lora_rank)
  got = jnp.einsum("btnc,cnv->btnv", got, p.w_uv)
  want = mla.attend_naive(p, q_nope, q_rope, cache, prefix, new, mask, scale=cfg.attention_scale)
  assert_close_rel(got, want, 1e-5)


def _tree_mask(b, t, seed):
  """Random trees: node i's parent is one of 0..i-1; ancestor-or-self visibility [B, T, T]."""
  rng = np.random.default_rng(seed)
  mask = np.zeros((b, t, t), bool)
  for s in range(b):
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
    for i in range(t):
      j = i
      while j >= 0:
        mask[s, i, j], j = True, parent[j]
  return jnp.asarray(mask)


@pytest.mark.parametrize("t,splits,layer", [(1, 1, None), (5, 3, 1), (9, 2, 0), (1, 8, 1)])
def test_pallas_latent_kernel_equals_reference(t, splits, layer):
  """Interpret mode: tree masks, ragged and empty prefixes, prefix splits, a layer of the
  stacked cache."""
  b, n, c, r, s = 3, 4, 32, 16, 40
  k = jax.random.split(jax.random.key(t), 3)
  q = jax.random.normal(k[0], (b, t, n, c + r))
  cache = jax.random.normal(k[1], (b, 1, s, c + r) if layer is None else (2, b, 1, s, c + r))
  new = jax.random.normal(k[2], (b, t, 1, c + r))
  mask, prefix = _tree_mask(b, t, t), jnp.array([37, 0, 16])
  kw = dict(scale=0.2, value_dim=c, layer=layer)
  got = latent_attention(q, cache, prefix, new, mask, block_q=16, block_k=16, num_splits=splits,
                         **kw)
  assert_close_rel(got, mla.attend_latent(q, cache, prefix, new, mask, **kw), 1e-5)


def test_latent_key_blocks_fit_shared_memory():
  from ddtree_jax.pallas.latent_attention import SMEM_BYTES, fit_block_k
  assert fit_block_k(64, 576, 2) == 64 and fit_block_k(64, 576, 3) == 32
  assert fit_block_k(64, 4096, 4) == 16
  assert 3 * 32 * 576 * 2 <= SMEM_BYTES < 3 * 64 * 576 * 2


def test_latent_kernel_rule():
  """Pallas for one token at any cache, for trees of <= 512 query rows over <= 2048 rows."""
  t = kernels.KernelTuning()
  assert t.use_latent_pallas(1, 128, 1 << 15) and t.use_latent_pallas(17, 16, 1057)
  assert not t.use_latent_pallas(17, 16, 8256) and not t.use_latent_pallas(17, 128, 1057)
  assert not kernels.KernelTuning(latent_pallas=False).use_latent_pallas(1, 16, 1024)


def test_pallas_latent_kernel_in_the_decode_loop_is_lossless(tmp_path):
  """A DeepSeek-V3-style target with kernel-sized widths (latent 32, RoPE 16): DDTree on the
  Pallas latent kernel (and the grouped experts) gives AR's tokens."""
  cfg, _ = load_fixture("dsv3_qlora_groups")
  cfg = dataclasses.replace(cfg.config, qk_rope_head_dim=16, head_dim=32)
  target = checkpoint.Target(params=decoder.init_params(cfg, jax.random.key(4), jnp.float32,
                                                      std=0.3), config=cfg)
  drafter = dj.load_drafter(write_drafter(str(tmp_path), cfg, block_size=8), target)
  ar = dj.generate(target, PROMPTS, max_new_tokens=16, stop_token_ids=()).tokens
  res = dj.generate(target, PROMPTS, method="ddtree", drafter=oracle_drafter(drafter, PROMPTS, ar),
                    budget=16, max_new_tokens=16, stop_token_ids=(), attention="pallas",
                    kernel_tuning=kernels.KernelTuning(latent_split_rows=16))
  assert res.tokens == ar


def test_rope_pairs_to_halves():
  np.testing.assert_array_equal(mla.rope_pairs_to_halves(8), [0, 2, 4, 6, 1, 3, 5, 7])


# --------------------------------------------------------------------------------------------
# Lossless speculative decoding


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  target, _ = load_fixture("dsv3_qlora_groups")
  return (target, *drafter_and_ar(str(tmp_path_factory.mktemp("drafter")), target, PROMPTS, M,
                                  (0, 2)))


@pytest.mark.parametrize("method,budget", [("chain", None), ("ddtree", 1), ("ddtree", 16),
                                           ("ddtree", 256)])  # every budget: test_decode
@pytest.mark.parametrize("batch", [1, 3])
def test_speculative_decoding_is_lossless(setup, method, budget, batch):
  target, drafter, ar = setup
  assert_lossless(target, drafter, PROMPTS[:batch], ar[:batch], method, budget, M,
                  seed=budget or 0)


def test_real_drafter_and_pallas_kernels_are_lossless(setup):
  assert_real_drafter_lossless(*setup[:2], PROMPTS, setup[2])


def test_a_drafter_of_its_own_width_loads(setup, tmp_path):
  """Kimi-K2.5-style DFlash drafters have their own heads and head_dim (7168 hidden, 128-dim
  heads against the target's 192-dim latent-attention heads): scaled down, it loads and drafts."""
  target, _, ar = setup
  own = dataclasses.replace(target.config, num_heads=2, num_kv_heads=1, head_dim=16,
                            intermediate_size=80)
  drafter = dj.load_drafter(write_drafter(str(tmp_path), own, block_size=4,
                                          target_layer_ids=(1,)), target)
  assert drafter.config.layers.head_dim == 16 and drafter.config.layers.num_heads == 2
  res = dj.generate(target, PROMPTS[:1], method="ddtree", drafter=drafter, budget=8,
                    max_new_tokens=12, stop_token_ids=())
  assert res.tokens == [ar[0][:12]]


# --------------------------------------------------------------------------------------------
# FP8 block-quantised checkpoints


def _quantize_fixture(tmp_path, block=16):
  """(fp8 copy, dequantised float32 twin) of dsv3_plain: every 2-D projection and expert in
  float8_e4m3fn with a float32 weight_scale_inv per block x block (DeepSeek-V3's format)."""
  fp8, twin = copy_fixture(tmp_path / "fp8", "dsv3_plain"), copy_fixture(tmp_path / "f32",
                                                                         "dsv3_plain")
  file = "model.safetensors"
  tensors = read_safetensors(os.path.join(fp8, file))
  q_out, t_out = {}, {}
  for name, w in tensors.items():
    w = np.array(w)
    if w.ndim != 2 or not name.endswith("proj.weight") and "proj_with_mqa" not in name:
      q_out[name] = t_out[name] = w
      continue
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    pad = np.zeros((rows * block, cols * block), np.float32)
    pad[:w.shape[0], :w.shape[1]] = w
    amax = np.abs(pad.reshape(rows, block, cols, block)).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale, block, 0), block, 1)[:w.shape[0], :w.shape[1]]
    q = (w / full).astype(ml_dtypes.float8_e4m3fn)
    q_out[name], q_out[name + "_scale_inv"] = q, scale
    t_out[name] = q.astype(np.float32) * full
  write_safetensors(os.path.join(fp8, file), q_out)
  write_safetensors(os.path.join(twin, file), t_out)
  edit_config(fp8, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                        "activation_scheme": "dynamic",
                                        "weight_block_size": [block, block]})
  return fp8, twin


def test_fp8_checkpoint_loads_as_its_dequantised_twin(tmp_path):
  """The routed experts stay float8 on the device (a byte a weight), everything else is
  dequantised on the host; both give the twin's weights and logits."""
  fp8, twin = _quantize_fixture(tmp_path)
  a, b = dj.load_target(fp8, dtype="float32"), dj.load_target(twin, dtype="float32")
  leaves = lambda p: jax.tree.leaves(p, is_leaf=quant.is_quantized)
  kept = [x for x in leaves(a.params) if quant.is_quantized(x)]
  assert len(kept) == 2 * len(a.config.moe_layers)
  for w in kept:
    assert w.q.dtype == jnp.float8_e4m3fn and w.q.nbytes == np.prod(w.shape)
  for x, y in zip(leaves(a.params), leaves(b.params)):
    np.testing.assert_array_equal(np.asarray(quant.dequantize(x, jnp.float32)), np.asarray(y))
  ids = np.asarray(PROMPTS[0])[None]
  np.testing.assert_allclose(dj.forward_logits(a, ids), dj.forward_logits(b, ids), rtol=1e-6,
                             atol=1e-6)


@pytest.mark.parametrize("quant,match", [
    ({"quant_method": "gptq", "bits": 4}, "unsupported quantization_config quant_method='gptq'"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [16, 16]}, "fmt='e5m2'"),
    ({"quant_method": "fp8"}, "weight_block_size"),
])
def test_other_quantisation_formats_are_refused(tmp_path, quant, match):
  path = copy_fixture(tmp_path, "dsv3_plain")
  edit_config(path, quantization_config=quant)
  with pytest.raises(ValueError, match=match):
    dj.load_target(path, dtype="float32")


def test_fp8_without_its_scale_is_named(tmp_path):
  fp8, _ = _quantize_fixture(tmp_path)
  file = os.path.join(fp8, "model.safetensors")
  t = {k: np.array(v) for k, v in read_safetensors(file).items()}
  del t["model.layers.0.self_attn.o_proj.weight_scale_inv"]
  write_safetensors(file, t)
  with pytest.raises(CheckpointError, match=r"o_proj\.weight_scale_inv"):
    dj.load_target(fp8, dtype="float32")


# --------------------------------------------------------------------------------------------
# Tensor and expert parallelism on 8 CPU devices


@pytest.mark.parametrize("shape", [{"tp": 4}, {"ep": 8}, {"tp": 2, "ep": 4}])
def test_meshes_give_the_tokens_of_one_device(setup, shape):
  target, drafter, ar = setup
  mesh = sharding.make_mesh({"dp": 1, "tp": 1, **shape})
  sharded, _ = load_fixture("dsv3_qlora_groups", mesh=mesh)
  heads = sharded.params.layers[0].mla.w_uk.addressable_shards[0].data.shape[1]
  assert heads == 4 // shape.get("tp", 1)
  d = oracle_drafter(dj.load_drafter(drafter.path, sharded), PROMPTS, ar)
  res = dj.generate(sharded, PROMPTS, method="ddtree", drafter=d, budget=16, max_new_tokens=M,
                    stop_token_ids=())
  assert res.tokens == ar


# --------------------------------------------------------------------------------------------
# Bad input and what is skipped


def test_multi_token_prediction_layers_are_skipped(tmp_path):
  path = copy_fixture(tmp_path, "dsv3_plain")
  file = os.path.join(path, "model.safetensors")
  t = {k: np.array(v) for k, v in read_safetensors(file).items()}
  t["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)
  write_safetensors(file, t)
  with pytest.raises(CheckpointError, match=r"does not read .*layers\.3\.eh_proj"):
    dj.load_target(path, dtype="float32")
  edit_config(path, num_nextn_predict_layers=1)
  target = dj.load_target(path, dtype="float32")
  assert len(target.params.layers) == 3


@pytest.mark.parametrize("changes,match", [
    (dict(scoring_func="softmax", topk_method="group_limited_greedy"), "topk_method"),
    (dict(n_group=3), "n_group=3 must divide n_routed_experts=8"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 exceeds n_routed_experts=8"),
    (dict(kv_lora_rank=0), "kv_lora_rank"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(first_k_dense_replace=9), "first_k_dense_replace"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "longrope"),
])
def test_bad_deepseek_config_is_refused_naming_the_field(tmp_path, changes, match):
  path = copy_fixture(tmp_path, "dsv3_plain")
  edit_config(path, **changes)
  with pytest.raises(ValueError, match=match):
    dj.load_target(path, dtype="float32")
