"""Hybrid targets (Qwen3.5, Qwen3-Next: Gated DeltaNet + gated attention): loading as shipped,
lossless speculative decoding whose accepted paths run through differing siblings, the slot
server, meshes (the Gated DeltaNet layers split over tp by key-head group), sampling. HF parity of
the fixtures: tests/test_model.py."""

import json
import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ddtree_jax as dj
from ddtree_jax.checkpoints.safetensors_io import read_safetensors, write_safetensors
from ddtree_jax import engine, sharding
from ddtree_jax.checkpoints.hf import Target
from ddtree_jax.models import decoder
from ddtree_jax.models.config import ModelConfig
from ddtree_jax.models import gated_deltanet as gd
from ddtree_jax.models.gated_deltanet import GDNDims
from ddtree_jax.serving import slots
from ddtree_jax.models.registry import config_from_hf
from conftest import FIXTURES
from experiments.perf import collectives
from helpers import (assert_accepted, assert_close_rel, assert_lossless,
                     assert_real_drafter_lossless, drafter_and_ar, load_fixture, oracle_drafter,
                     slot_server_tokens, write_drafter)

M = 32
PROMPTS = [[3, 17, 99, 4, 250, 31, 8], [42], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 9]]


NAMES = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"]
FULL = "qwen3_5_moe_text"  # layers alternating kinds, experts: every budget, batch and mesh


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
  """name -> (target, a random drafter tapping layers 0 and 3, AR's tokens), loaded once."""
  cache = {}

  def get(name):
    if name not in cache:
      target, _ = load_fixture(name)
      cache[name] = (target, *drafter_and_ar(str(tmp_path_factory.mktemp(name)), target,
                                             PROMPTS, M, (0, 3)))
    return cache[name]
  return get


RUNS = ([(FULL, m, b, n) for m, b in [("chain", None), ("ddtree", 1), ("ddtree", 16),
                                      ("ddtree", 256)]  # every budget: test_decode
         for n in (1, 3)]
        + [(name, m, b, 3) for name in NAMES if name != FULL
           for m, b in [("chain", None), ("ddtree", 16), ("ddtree", 64)]])


@pytest.mark.parametrize("name,method,budget,batch", RUNS)
def test_speculative_decoding_is_lossless(pairs, name, method, budget, batch):
  """The oracle ranks the true token second at some positions, so accepted paths run through
  non-first children (asserted): each branch's recurrent state and convolution window must be
  its own, or those tokens change. Every budget and batch on the fixture whose Gated DeltaNet
  layers follow attention ones; chain and two budgets on the others."""
  target, drafter, ar = pairs(name)
  assert_lossless(target, drafter, PROMPTS[:batch], ar[:batch], method, budget, M,
                  seed=(budget or 0) + 1)


def test_real_drafter_and_pallas_kernels_are_lossless(pairs):
  """The drafter itself (taps from a Gated DeltaNet layer and an attention one)."""
  target, drafter, ar = pairs(FULL)
  assert_real_drafter_lossless(target, drafter, PROMPTS, ar)


def test_sliding_window_drafter_is_lossless(tmp_path):
  """A drafter whose first layer attends to keys within 5 positions (z-lab's sliding_attention
  layers), its own forward in the loop."""
  target, _ = load_fixture("qwen3_next")
  over = {"use_sliding_window": True, "sliding_window": 5,
          "layer_types": ["sliding_attention", "full_attention"]}
  drafter = dj.load_drafter(write_drafter(str(tmp_path / "d"), target.config, block_size=8,
                                          target_layer_ids=(0, 3), config_overrides=over), target)
  assert drafter.config.layers.window(0) == 5
  ar = dj.generate(target, PROMPTS, max_new_tokens=12, stop_token_ids=()).tokens
  over = oracle_drafter(drafter, PROMPTS, ar, over_real=True)
  res = dj.generate(target, PROMPTS, method="ddtree", drafter=over, budget=16, max_new_tokens=12,
                    stop_token_ids=())
  assert res.tokens == ar
  assert_accepted(over, PROMPTS, res, "ddtree", 16)


def test_cache_holds_kv_rows_for_attention_layers_and_a_state_for_the_others():
  target, _ = load_fixture("qwen3_next")
  cfg = target.config
  assert cfg.attention_layers == (3,) and cfg.recurrent_layers == (0, 1, 2)
  cache = decoder.init_target_cache(cfg, 2, 16, jnp.float32)
  d = cfg.gdn
  assert cache.k.shape == (1, 2, cfg.num_kv_heads, 16, cfg.head_dim)
  assert cache.state.shape == (3, 2, d.value_heads, d.key_dim, d.value_dim)
  assert cache.window.shape == (3, 2, d.conv_kernel - 1, d.key_heads, d.group_dim)
  assert d.key_heads * d.group_dim == d.conv_dim


def _fuse_experts(tensors, layers, experts):
  """Per-expert Linears as the fused 3-D experts.gate_up_proj / down_proj of Qwen3.5-MoE's
  published checkpoints."""
  for layer in layers:
    p = f"model.layers.{layer}.mlp.experts."
    gate = [tensors.pop(f"{p}{e}.gate_proj.weight") for e in range(experts)]
    up = [tensors.pop(f"{p}{e}.up_proj.weight") for e in range(experts)]
    tensors[p + "gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
    tensors[p + "down_proj"] = np.stack([tensors.pop(f"{p}{e}.down_proj.weight")
                                         for e in range(experts)])
  return tensors


def _wrap(src, dst, kind="qwen3_5", fuse=False):
  """tests/fixtures/hf/<src> saved as the vision-language wrapper: text_config, tensors under
  model.language_model.*, plus vision and MTP tensors the loader must skip; fuse: the experts
  as 3-D tensors."""
  with open(os.path.join(FIXTURES, src, "config.json")) as f:
    text = json.load(f)
  os.makedirs(dst)
  tensors = {k: np.asarray(v) for k, v in
             read_safetensors(os.path.join(FIXTURES, src, "model.safetensors")).items()}
  if fuse:
    tensors = _fuse_experts(tensors, range(text["num_hidden_layers"]), text["num_experts"])
  wrapped = {("lm_head.weight" if k == "lm_head.weight" else
              "model.language_model." + k[len("model."):]): np.asarray(v)
             for k, v in tensors.items()}
  wrapped["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
  wrapped["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
  write_safetensors(os.path.join(dst, "model.safetensors"), wrapped)
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": kind,
               "text_config": text, "vision_config": {"model_type": "qwen3_5_vision"},
               "tie_word_embeddings": False, "image_token_id": 250}, f)
  return dst


@pytest.mark.parametrize("src,kind,fuse", [("qwen3_5_text", "qwen3_5", False),
                                           ("qwen3_5_moe_text", "qwen3_5_moe", True)])
def test_the_wrapped_checkpoint_gives_the_text_models_output(tmp_path, src, kind, fuse):
  """Qwen3_5(Moe)ForConditionalGeneration as published (Qwen3.5-MoE's experts fused on disk):
  HF's logits and greedy tokens of the text model."""
  _, ref = load_fixture(src)
  wrapped = dj.load_target(_wrap(src, str(tmp_path / "wrapped"), kind, fuse), dtype="float32")
  assert wrapped.config.model_type == kind
  assert_close_rel(dj.forward_logits(wrapped, ref["input_ids"]), ref["logits"])
  got = dj.generate(wrapped, [ref["prompt"].tolist()], max_new_tokens=24, stop_token_ids=())
  assert got.tokens[0] == ref["greedy"].tolist()


@pytest.mark.parametrize("changes,match", [
    ({"linear_num_value_heads": 3}, "not a multiple of linear_num_key_heads"),
    ({"layer_types": ["linear_attention", "full_attention"]}, "lists 2 layers"),
    ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, "unsupported layer_types"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "unsupported rope_type"),
])
def test_bad_hybrid_config_is_refused_naming_the_field(tmp_path, changes, match):
  with open(os.path.join(FIXTURES, "qwen3_5_text", "config.json")) as f:
    raw = json.load(f)
  with pytest.raises(ValueError, match=match):
    config_from_hf({**raw, **changes})


def test_slot_server_requests_joining_and_leaving_get_ar_tokens(tmp_path):
  """More requests than slots, of different prompts and limits, on a hybrid: each slot's state
  and window are written at insert and read by its own row only."""
  target, _ = load_fixture("qwen3_next")
  drafter = dj.load_drafter(write_drafter(str(tmp_path / "d"), target.config, block_size=8,
                                          target_layer_ids=(0, 3)), target)
  rng = random.Random(0)
  prompts = [[rng.randrange(2, 250) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
  limits = [9, 3, 14, 6, 11]
  full = dj.generate(target, prompts, max_new_tokens=max(limits), stop_token_ids=()).tokens
  got = slot_server_tokens(target, drafter, prompts, limits, slots.SlotConfig(
      method="ddtree", budget=8, slots=2, capacity=96, chunk_steps=2, max_chunk_steps=4,
      prompt_buckets=(32,)))
  assert got == [list(f[:n]) for f, n in zip(full, limits)]


@pytest.mark.parametrize("shape", [{"dp": 2, "tp": 2}, {"dp": 4, "tp": 2},
                                   {"dp": 2, "tp": 2, "ep": 2}])
def test_a_mesh_gives_one_devices_tokens(pairs, shape):
  """Batch over dp (the recurrent states with it, padded to a multiple), attention heads, Gated
  DeltaNet key-head groups (their weights, states and windows), MLP widths and vocabulary over
  tp, experts over ep: AR's tokens, and the drafter's acceptance of one device."""
  target, drafter, ar = pairs(FULL)
  one = dj.generate(target, PROMPTS, method="ddtree", drafter=drafter, budget=16,
                    max_new_tokens=M, stop_token_ids=())
  mesh = sharding.make_mesh(shape)
  sharded = dj.load_target(os.path.join(FIXTURES, target.config.model_type), dtype="float32",
                           mesh=mesh)
  sharded_drafter = dj.load_drafter(drafter.path, sharded)
  d, tp, hid = target.config.gdn, shape["tp"], target.config.hidden_size
  local = lambda a: a.sharding.shard_shape(a.shape)
  gdn = sharded.params.layers[target.config.recurrent_layers[0]].gdn
  assert local(gdn.w_qkv) == (hid, d.key_heads // tp, d.group_dim)
  assert local(gdn.conv) == (d.conv_kernel, d.key_heads // tp, d.group_dim)
  assert local(gdn.w_out) == (d.value_heads * d.value_dim // tp, hid)
  cache = engine.prefill_state(sharded, PROMPTS, method="ddtree", drafter=sharded_drafter,
                               budget=16, max_new_tokens=M, stop_token_ids=())[0].cache
  assert local(cache.state)[2:] == (d.value_heads // tp, d.key_dim, d.value_dim)
  assert local(cache.window)[3:] == (d.key_heads // tp, d.group_dim)
  res = dj.generate(sharded, PROMPTS, method="ddtree", drafter=sharded_drafter, budget=16,
                    max_new_tokens=M, stop_token_ids=())
  assert res.tokens == one.tokens == ar
  assert res.stats["acceptance_lengths"] == one.stats["acceptance_lengths"]


@pytest.mark.parametrize("chain", [False, True])
def test_a_gated_deltanet_layer_split_over_tp_communicates_only_its_output(chain):
  """The layer laid out by its `partition_specs` on dp 2 x tp 2, a tree's verify and commit (or a
  prompt's, chain): after XLA's SPMD partitioner its only float collective is the all-reduce of
  its output [B / dp, T, H] (w_out row parallel), nothing gathers its weights, state or window.
  (XLA exchanges the few bools of the commit's accepted-path mask with or without tp: not
  counted.)"""
  d, hid, b, t = GDNDims(2, 4, 16, 12), 64, 4, 9
  mesh = sharding.make_mesh({"dp": 2, "tp": 2})
  on = lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
  params = jax.eval_shape(lambda: gd.init_params(d, hid, jax.random.key(0), jnp.float32))
  params = jax.tree.map(on, params, params.partition_specs(sharding.Axes(
      mesh, sharding.DEFAULT_RULES)), is_leaf=lambda a: isinstance(a, jax.ShapeDtypeStruct))
  rows = lambda dtype, *shape: on(jax.ShapeDtypeStruct((b, *shape), dtype), P("dp"))
  state = on(jax.ShapeDtypeStruct((b, d.value_heads, d.key_dim, d.value_dim), jnp.float32),
             P("dp", "tp"))
  window = on(jax.ShapeDtypeStruct((b, d.conv_kernel - 1, d.key_heads, d.group_dim),
                                   jnp.float32), P("dp", None, "tp"))

  def layer(p, x, positions, visible, state, window, src, count):
    y, pending = gd.block(p, d, x, positions, visible, state, window, chain=chain)
    return y, gd.commit_block(state, window, pending, src, count)
  out = (NamedSharding(mesh, P("dp")), (state.sharding, window.sharding))
  lowered = jax.jit(layer, out_shardings=out).lower(
      params, rows(jnp.float32, t, hid), rows(jnp.int32, t), rows(jnp.bool_, t, t), state,
      window, rows(jnp.int32, t), rows(jnp.int32))
  found = collectives.collectives(collectives.compile_partitioned(lowered)[0])
  assert [(c.kind, c.types) for c in found if not c.types.startswith("pred")] == [
      ("all-reduce", f"f32[{b // 2},{t},{hid}]")]


def test_key_heads_that_tp_does_not_divide_are_refused_or_replicated():
  """Hk = 2 on tp = 4: refused naming the dimension; `linear_heads=None` replicates the layer."""
  params = jax.eval_shape(lambda: gd.init_params(GDNDims(2, 4, 16, 12), 64, jax.random.key(0),
                                                 jnp.float32))
  mesh = sharding.make_mesh({"dp": 1, "tp": 4})
  with pytest.raises(ValueError, match=r"key heads \(2\) is not divisible by mesh axis 'tp' of "
                                       r"size 4.*linear_heads=None"):
    params.partition_specs(sharding.Axes(mesh, sharding.DEFAULT_RULES))
  specs = params.partition_specs(sharding.Axes(mesh, sharding.ShardingRules(linear_heads=None)))
  assert all(s == P(*[None] * len(s)) for s in jax.tree.leaves(
      specs, is_leaf=lambda x: isinstance(x, P)))


def test_sampling_with_a_hybrid_target_follows_its_distribution(tmp_path):
  """T > 0 on a tiny hybrid (two Gated DeltaNet layers, one gated attention layer, experts with
  a shared one): DDTree samples from the target's own distribution."""
  from test_sampling import V, check, empirical_joint, exact_joint  # pylint: disable=import-outside-toplevel
  cfg = ModelConfig(model_type="qwen3_next", vocab_size=V, hidden_size=32, intermediate_size=64,
                    num_layers=3, num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True,
                    layer_types=("linear_attention", "full_attention", "linear_attention"),
                    gdn=GDNDims(1, 2, 8, 8), attn_output_gate=True, partial_rotary_factor=0.5,
                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    norm_topk_prob=True, moe_layers=(0, 2), shared_expert_size=16)
  params = decoder.init_params(cfg, jax.random.key(3), jnp.float32, std=0.4)
  target = Target(params=params, config=cfg)
  drafter = dj.load_drafter(write_drafter(str(tmp_path), cfg, num_layers=1, block_size=4,
                                          mask_token_id=3, std=0.5), target)
  p = exact_joint(target, 1.0)
  tv, pvalue = check(empirical_joint(target, drafter, "ddtree", 16, 1.0), p)
  assert tv < 0.03 and pvalue > 1e-3, (tv, pvalue)
