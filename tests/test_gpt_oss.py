"""gpt-oss targets (`gpt_oss`: biased q/k/v/o, attention sinks, alternating causal sliding-window
and full layers, YaRN, biased routers and experts with a clamped SwiGLU, MXFP4 experts kept 4-bit):
parity with HF GptOssForCausalLM on the dequantized weights (tests/fixtures/hf/gpt_oss), the
MXFP4 format, windows in a draft tree, lossless speculative decoding, sampling, the slot server,
configs refused."""

import dataclasses
import json
import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dj
from ddtree_jax.checkpoints.hf import Target
from ddtree_jax.checkpoints.safetensors_io import (CheckpointError, read_safetensors,
                                                   write_safetensors)
from ddtree_jax.models import decoder, moe, quant
from ddtree_jax.models.config import ModelConfig
from ddtree_jax.models.registry import config_from_hf
from ddtree_jax.serving import slots
from conftest import FIXTURES
from helpers import (assert_accepted, assert_close_rel, cached_decode_logits, copy_fixture,
                     load_fixture, oracle_drafter, prefilled, slot_server_tokens,
                     write_drafter)

NAME = "gpt_oss"
M = 24
PROMPTS = [[3, 17, 99, 4, 250, 31, 8], [42], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 9]]


@pytest.fixture(scope="module")
def fixture():
  return load_fixture(NAME)


@pytest.fixture(scope="module")
def steps(fixture):
  """The logits [24, V] of the prompt's prefill and one cached step per HF greedy token."""
  target, ref = fixture
  return np.asarray(cached_decode_logits(target, ref["prompt"], ref["greedy"]))


def _logits(target, ids, **changes):
  """forward_logits with ModelConfig fields changed (a model that is wrong on purpose)."""
  cfg = dataclasses.replace(target.config, **changes)
  return np.asarray(dj.forward_logits(dataclasses.replace(target, config=cfg), ids))


def _off(got, want):
  return np.abs(got - want).max() / np.abs(want).max()


# --------------------------------------------------------------------------------------------
# Parity with HF


def test_logits_and_layer_outputs_match_hf(fixture):
  target, ref = fixture
  assert target.config.layer_types == ("sliding_attention", "full_attention") * 2
  assert_close_rel(dj.forward_logits(target, ref["input_ids"]), ref["logits"])
  ids = jnp.asarray(ref["input_ids"])
  b, t = ids.shape
  cache = decoder.init_target_cache(target.config, b, 0, jnp.float32)
  layers = tuple(range(target.config.num_layers))
  _, _, taps = decoder.forward(target.params, target.config, ids,
                               jnp.broadcast_to(jnp.arange(t), (b, t)), cache,
                               decoder.causal_mask(jnp.full((b,), t), t), layers)
  h = target.config.hidden_size
  for i in layers:
    assert_close_rel(taps[..., i * h:(i + 1) * h], ref["hidden_states"][i + 1])


def test_greedy_24_tokens_and_cached_decode_match_hf(fixture, steps):
  target, ref = fixture
  res = dj.generate(target, [ref["prompt"].tolist()], max_new_tokens=M, stop_token_ids=())
  assert res.tokens[0] == ref["greedy"].tolist()
  assert_close_rel(steps, ref["decode_logits"])


@pytest.mark.parametrize("changes", [dict(sliding_window=3), dict(sliding_window=5),
                                     dict(layer_types=("full_attention",) * 4),
                                     dict(rope_scaling=(("beta_fast", 32.0), ("beta_slow", 1.0),
                                                        ("factor", 8.0),
                                                        ("original_max_position_embeddings",
                                                         64.0)))])
def test_the_fixture_tells_each_detail_apart(fixture, changes):
  """A window off by one either way, no window, or YaRN's truncated range (the default): logits
  100x further from HF's than the parity tolerance."""
  target, ref = fixture
  assert _off(_logits(target, ref["input_ids"], **changes), ref["logits"]) > 1e-2


@pytest.mark.parametrize("edit", [
    lambda l: dict(sinks=jnp.zeros_like(l.sinks)),
    lambda l: dict(bo=jnp.zeros_like(l.bo)),
    lambda l: dict(moe=dataclasses.replace(l.moe, router_bias=jnp.zeros_like(l.moe.router_bias))),
    lambda l: dict(moe=dataclasses.replace(l.moe, swiglu_clamp=(1.702, 7.0))),  # gpt-oss's limit
], ids=["no sinks", "no o bias", "no router bias", "limit 7"])
def test_without_sinks_biases_or_the_fixtures_clamp_the_logits_are_wrong(fixture, edit):
  target, ref = fixture
  layers = [dataclasses.replace(l, **edit(l)) for l in target.params.layers]
  wrong = dataclasses.replace(target, params=dataclasses.replace(target.params, layers=layers))
  assert _off(np.asarray(dj.forward_logits(wrong, ref["input_ids"])), ref["logits"]) > 1e-2


# --------------------------------------------------------------------------------------------
# MXFP4


def test_mxfp4_experts_stay_4_bit_and_dequantize_as_transformers(fixture):
  """uint8 blocks of two values and one e8m0 scale per 32 on the device; layer 1's gate_up
  equals transformers' own dequantization of the shipped tensors, bit for bit (interleaved gate
  / up: HF's [E, H, 2I] column 2j is our gate j, 2j + 1 our up j)."""
  target, ref = fixture
  cfg = target.config
  e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
  for layer in target.params.layers:
    w = layer.moe.w_gate_up
    assert isinstance(w, quant.Mxfp4Experts) and isinstance(layer.moe.w_down, quant.Mxfp4Experts)
    assert w.blocks.dtype == jnp.uint8 and w.blocks.nbytes * 2 == e * h * 2 * i
    assert w.scales.nbytes * 32 == e * h * 2 * i
  ours = np.asarray(quant.dequantize(target.params.layers[1].moe.w_gate_up, jnp.float32))
  hf = ref["expert_l1_gate_up"].reshape(e, h, i, 2).transpose(0, 1, 3, 2)
  np.testing.assert_array_equal(ours, hf)


def _random_mxfp4(key, shape):
  k1, k2 = jax.random.split(key)
  e, k = shape[:2]
  blocks = jax.random.randint(k1, (e, k // 2) + shape[2:], 0, 256).astype(jnp.uint8)
  scales = jax.random.randint(k2, (e, k // 32) + shape[2:], 120, 130).astype(jnp.uint8)
  return quant.Mxfp4Experts(blocks=blocks, scales=scales)


def test_mxfp4_reference_equals_dequantize_then_matmul():
  """e8m0's extremes exact (2^-127 subnormal, 2^127); the expert forms (every expert, grouped,
  pair by pair) on MXFP4 stacks equal the same on the dequantized float stacks, biases and
  clamp included, and a plain numpy dequantization of the nibbles."""
  np.testing.assert_array_equal(quant.e8m0_scale(jnp.array([0, 1, 127, 254], jnp.uint8)),
                                np.array([2.0 ** -127, 2.0 ** -126, 1.0, 2.0 ** 127], np.float32))
  e, h, i, r = 4, 64, 32, 5
  keys = jax.random.split(jax.random.key(0), 4)
  base = moe.init_params(keys[0], h, e, i, jnp.float32, std=0.3, biases=True,
                         swiglu_clamp=(1.702, 2.0))
  q = dataclasses.replace(base, w_gate_up=_random_mxfp4(keys[1], (e, h, 2, i)),
                          w_down=_random_mxfp4(keys[2], (e, i, h)))
  w = q.w_down
  nib = np.stack([np.asarray(w.blocks) & 15, np.asarray(w.blocks) >> 4], 2).reshape(e, i, h)
  scale = np.repeat(2.0 ** (np.asarray(w.scales, np.float64) - 127), 32, axis=1)
  np.testing.assert_array_equal(np.asarray(quant.dequantize(w, jnp.float32)),
                                np.asarray(quant.FP4_VALUES)[nib] * scale)
  floats = dataclasses.replace(q, w_gate_up=quant.dequantize(q.w_gate_up, jnp.float32),
                               w_down=quant.dequantize(q.w_down, jnp.float32))
  x = jax.random.normal(keys[3], (r, h), jnp.float32)
  weights, experts = moe.route(q, x, moe.Routing(top_k=2, norm_topk_prob=True))
  experts = experts.at[0, 1].set(e)  # a pair held elsewhere adds nothing
  want = moe.reference(floats, x, weights, experts)
  for form in (moe.reference, moe.grouped, moe.pairs):
    assert_close_rel(form(q, x, weights, experts), want, 1e-5)
  assert_close_rel(moe.grouped(floats, x, weights, experts), want, 1e-5)


def test_mxfp4_tensors_without_the_config_or_of_the_wrong_type_are_named(tmp_path):
  path = copy_fixture(tmp_path, NAME)
  with open(os.path.join(path, "config.json")) as f:
    raw = json.load(f)
  del raw["quantization_config"]
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(raw, f)
  with pytest.raises(CheckpointError, match=r"gate_up_proj_blocks' is MXFP4 but config.json"):
    dj.load_target(path, dtype="float32")
  path = copy_fixture(tmp_path / "b", NAME)
  file = os.path.join(path, "model.safetensors")
  t = {k: np.asarray(v) for k, v in read_safetensors(file).items()}
  name = "model.layers.2.mlp.experts.down_proj_scales"
  t[name] = t[name].astype(np.int16)
  write_safetensors(file, t)
  with pytest.raises(CheckpointError, match=r"down_proj_scales' is int16, MXFP4 stores uint8"):
    dj.load_target(path, dtype="float32")


# --------------------------------------------------------------------------------------------
# Sliding windows in a draft tree


def test_a_tree_deeper_than_the_window_sees_what_each_causal_step_sees(fixture, steps):
  """A 12-node tree after the prompt (its true path of 9 greedy tokens, deeper than the window
  of 4, with three sibling nodes interleaved in node order) verified in one forward: each path
  node's logits are the cached causal step's at its position."""
  target, ref = fixture
  cfg, params = target.config, target.params
  prompt, greedy = ref["prompt"], ref["greedy"]
  _, cache = prefilled(target, prompt)
  t = len(prompt)
  # node: (token, parent); the path is greedy[0..8], siblings hang off depths 1, 3 and 6
  nodes, parent, path = [], [], []
  for d in range(9):
    if d in (2, 4, 7):
      nodes.append((int(greedy[d - 1]) + 1) % 256)
      parent.append(path[-2] if len(path) > 1 else -1)
    nodes.append(int(greedy[d]))
    parent.append(path[-1] if path else -1)
    path.append(len(nodes) - 1)
  n = len(nodes)
  anc = np.eye(n, dtype=bool)
  depth = np.zeros(n, np.int32)
  for j in range(n):
    if parent[j] >= 0:
      anc[j] |= anc[parent[j]]
      depth[j] = depth[parent[j]] + 1
  hidden, _, _ = decoder.forward(params, cfg, jnp.asarray(nodes)[None],
                                 jnp.asarray(t + depth)[None], cache, jnp.asarray(anc)[None])
  got = np.asarray(decoder.lm_head(params, hidden[0]))[path]
  assert_close_rel(got, steps[1:10])


# --------------------------------------------------------------------------------------------
# Lossless speculative decoding


@pytest.fixture(scope="module")
def setup(fixture, tmp_path_factory):
  target, _ = fixture
  drafter = dj.load_drafter(write_drafter(str(tmp_path_factory.mktemp("drafter")), target.config,
                                          block_size=8, target_layer_ids=(0, 3)), target)
  ar = dj.generate(target, PROMPTS, max_new_tokens=M, stop_token_ids=()).tokens
  return target, drafter, ar


@pytest.mark.parametrize("method,budget,batch", [("chain", None, 3)] + [
    ("ddtree", b, n) for b in (5, 37) for n in (1, 3)])
def test_speculative_decoding_is_lossless(setup, method, budget, batch):
  """Drafts that follow AR's tokens (partly corrupted): accepted paths reach past the window of
  4 and run through non-first children; the tokens are AR's."""
  target, drafter, ar = setup
  prompts, ar = PROMPTS[:batch], ar[:batch]
  d = oracle_drafter(drafter, prompts, ar, seed=1 + (budget or 0))
  res = dj.generate(target, prompts, method=method, drafter=d, budget=budget, max_new_tokens=M,
                    stop_token_ids=())
  assert res.tokens == ar
  assert_accepted(d, prompts, res, method, budget)
  # (a path of W tokens: its last node, at depth W - 1, sees no prefix row, only its ancestors)
  longest = max(a for row in res.stats["acceptance_lengths"] for a in row)
  assert longest >= target.config.sliding_window


def test_the_random_drafter_on_the_pallas_kernels_is_lossless(setup):
  """The drafter's own forward in the loop (its logits but the oracle's two picks), DDTree on
  the Pallas kernels: the sink and window layers and the biased experts take XLA's forms there."""
  target, drafter, ar = setup
  ar = [a[:12] for a in ar]
  over = oracle_drafter(drafter, PROMPTS, ar, over_real=True)
  res = dj.generate(target, PROMPTS, method="ddtree", drafter=over, budget=16, max_new_tokens=12,
                    stop_token_ids=(), attention="pallas")
  assert res.tokens == ar
  assert_accepted(over, PROMPTS, res, "ddtree", 16)


def test_sampling_with_a_gpt_oss_target_follows_its_distribution(tmp_path):
  """T > 0 on a tiny gpt-oss-shaped target (one layer: sinks, biases, a window of 2 that the
  prompt and the drafts cross, clamped experts): DDTree samples from the target's own
  distribution."""
  from test_sampling import V, check, empirical_joint, exact_joint  # pylint: disable=import-outside-toplevel
  cfg = ModelConfig(model_type="gpt_oss", vocab_size=V, hidden_size=32, intermediate_size=32,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=False,
                    layer_types=("sliding_attention",), sliding_window=2,
                    attention_bias=True, attention_sinks=True, moe_bias=True,
                    swiglu_clamp=(1.702, 1.0), num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=32, norm_topk_prob=True, moe_layers=(0,))
  target = Target(params=decoder.init_params(cfg, jax.random.key(3), jnp.float32, std=0.4),
                  config=cfg)
  drafter = dj.load_drafter(write_drafter(str(tmp_path), cfg, num_layers=1, block_size=4,
                                          mask_token_id=3, std=0.5, target_layer_ids=(0,)),
                            target)
  tv, pvalue = check(empirical_joint(target, drafter, "ddtree", 16, 1.0), exact_joint(target, 1.0))
  assert tv < 0.03 and pvalue > 1e-3, (tv, pvalue)


def test_slot_server_requests_joining_and_leaving_get_ar_tokens(setup):
  """More requests than slots, prompts longer and shorter than the window: each slot's rows are
  its own, windows counted from its own positions."""
  target, drafter, _ = setup
  rng = random.Random(0)
  prompts = [[rng.randrange(2, 250) for _ in range(rng.randrange(1, 20))] for _ in range(3)]
  limits = [9, 3, 12]
  full = dj.generate(target, prompts, max_new_tokens=max(limits), stop_token_ids=()).tokens
  got = slot_server_tokens(target, drafter, prompts, limits, slots.SlotConfig(
      method="ddtree", budget=8, slots=2, capacity=64, chunk_steps=2, max_chunk_steps=4,
      prompt_buckets=(32,)))
  assert got == [list(f[:n]) for f, n in zip(full, limits)]


# --------------------------------------------------------------------------------------------
# Configs


def _raw():
  with open(os.path.join(FIXTURES, NAME, "config.json")) as f:
    return json.load(f)


def test_a_config_json_without_the_optional_fields_gets_transformers_defaults():
  raw = {k: v for k, v in _raw().items()
         if k not in ("rope_parameters", "layer_types", "swiglu_limit", "sliding_window",
                      "rms_norm_eps")}
  cfg = config_from_hf(raw)
  assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
  assert (cfg.sliding_window, cfg.swiglu_clamp, cfg.rms_norm_eps) == (128, (1.702, 7.0), 1e-5)
  assert cfg.rope_type == "yarn" and cfg.rope_theta == 150000.0
  assert dict(cfg.rope_scaling) == {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": 0.0, "original_max_position_embeddings": 4096.0}


@pytest.mark.parametrize("changes,match", [
    ({"layer_types": ["sliding_attention", "full_attention"]}, "lists 2 layers"),
    ({"layer_types": ["linear_attention"] * 4}, "unsupported layer_types"),
    ({"sliding_window": None}, "sliding_window must be a positive integer"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_local_experts=4"),
    ({"experts_per_token": 3}, "experts_per_token=3 differs from num_experts_per_tok=2"),
    ({"swiglu_limit": -1.0}, "swiglu_limit must be a finite number > 0"),
    ({"num_local_experts": None}, "num_local_experts must be a positive integer"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "unsupported rope_type"),
    ({"mlp_bias": True}, "unsupported config field mlp_bias"),
    ({"quantization_config": {"quant_method": "mxfp4", "dequantize": True}},
     "dequantize=True is not implemented"),
])
def test_bad_configs_are_refused_naming_the_field(tmp_path, changes, match):
  path = copy_fixture(tmp_path, NAME)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({**_raw(), **changes}, f)
  with pytest.raises(ValueError, match=match):
    dj.load_target(path, dtype="float32")
