"""Qwen3-MoE targets: the router and dropless experts, parity with HF transformers'
Qwen3MoeForCausalLM, lossless chain / DDTree, expert parallelism on 8 CPU devices, bad input."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dj
from conftest import FIXTURES
from ddtree_jax import kernels, sharding
from ddtree_jax.checkpoints import hf as checkpoint
from ddtree_jax.checkpoints import export as hf_export
from ddtree_jax.models import decoder
from ddtree_jax.models import moe
from ddtree_jax.models.config import ModelConfig
from ddtree_jax.pallas.grouped_gemm import combine, grouped_matmul, pair_matmul, tiles
from ddtree_jax.pallas.moe_ops import expert_ops, pair_ops
from ddtree_jax.checkpoints.safetensors_io import CheckpointError, read_safetensors, write_safetensors
from helpers import (assert_close_rel, assert_lossless, assert_real_drafter_lossless,
                     cached_decode_logits, copy_fixture, drafter_and_ar, edit_config, load_fixture,
                     oracle_drafter, write_drafter)

FIXTURE_NAMES = ["qwen3_moe_top2", "qwen3_moe_sparse_step", "qwen3_moe_top1"]
M = 32
PROMPTS = [[3, 17, 99, 4, 250, 31, 8], [42], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 9]]


def _pallas(*args, blocks=(16, 16, 16)):
  """moe.grouped on the Pallas kernels (interpret mode), small tiles: several per expert."""
  return moe.grouped(*args, ops=expert_ops(kernels.KernelTuning(), blocks))


def _pairs_pallas(*args):
  """moe.pairs on the Pallas kernels (interpret mode), blocks smaller than H and I."""
  return moe.pairs(*args, ops=pair_ops(kernels.KernelTuning(), (16, 16, 16)))


def _experts(seed=0, e=8, h=32, i=24, r=11, k=3):
  key = jax.random.key(seed)
  params = moe.init_params(key, h, e, i, jnp.float32, std=0.3)
  x = jax.random.normal(jax.random.fold_in(key, 1), (r, h), jnp.float32)
  return params, x, *moe.route(params, x, moe.Routing(k, norm_topk_prob=True))


# --------------------------------------------------------------------------------------------
# The mixture and its grouped GEMM


def test_grouped_equals_reference_and_rows_are_independent():
  params, x, w, ex = _experts()
  want = moe.reference(params, x, w, ex)
  assert_close_rel(moe.grouped(params, x, w, ex), want, 1e-5)
  assert_close_rel(_pallas(params, x, w, ex), want, 1e-5)
  assert_close_rel(moe.pairs(params, x, w, ex), want, 1e-5)
  assert_close_rel(_pairs_pallas(params, x, w, ex), want, 1e-5)
  for fn in (moe.grouped, _pallas, moe.pairs, _pairs_pallas):  # a row alone: as in the batch
    alone = jnp.concatenate([fn(params, x[r:r + 1], w[r:r + 1], ex[r:r + 1]) for r in range(4)])
    assert_close_rel(alone, fn(params, x, w, ex)[:4], 1e-6)


def test_router_is_float32_softmax_topk_renormalised():
  params, x, _, _ = _experts()
  probs = np.asarray(jax.nn.softmax(np.asarray(x, np.float64) @ np.asarray(params.router,
                                                                          np.float64)))
  for norm in (True, False):
    w, ex = moe.route(params, x, moe.Routing(3, norm))
    top = np.argsort(-probs, axis=1, kind="stable")[:, :3]
    np.testing.assert_array_equal(np.asarray(ex), top)
    p = np.take_along_axis(probs, top, axis=1)
    np.testing.assert_allclose(np.asarray(w), p / p.sum(1, keepdims=True) if norm else p,
                               rtol=1e-5)


def test_elsewhere_pairs_add_nothing():
  """Expert id E (another shard's expert) contributes zero, in every implementation."""
  params, x, w, ex = _experts()
  gone = jnp.where(ex == 2, 8, ex)
  kept = jnp.where(ex == 2, jnp.zeros_like(w), w)
  want = moe.reference(params, x, kept, ex)
  for fn in (moe.reference, moe.grouped, _pallas, moe.pairs, _pairs_pallas):
    assert_close_rel(fn(params, x, w, gone), want, 1e-5)


def test_pair_matmul_rows_and_elsewhere_pairs():
  """Row p = lhs[p // rows_per_lhs] @ rhs[groups[p]] (repeated groups, in any order); a pair of
  group E is skipped (its row stays unwritten); rows_per_lhs that lhs cannot feed is refused."""
  rng = np.random.default_rng(3)
  lhs = jnp.asarray(rng.normal(size=(6, 40)), jnp.float32)
  rhs = jnp.asarray(rng.normal(size=(5, 40, 24)), jnp.float32)
  groups = jnp.asarray([4, 0, 4, 5, 2, 0])
  for per in (1, 2):
    got = np.asarray(pair_matmul(lhs[:6 // per], rhs, groups, rows_per_lhs=per, block_n=16,
                                 block_k=16))
    for p in (0, 1, 2, 4, 5):
      np.testing.assert_allclose(got[p], np.asarray(lhs[p // per] @ rhs[groups[p]]), rtol=1e-5,
                                 atol=1e-5)
  with pytest.raises(ValueError, match="rows_per_lhs"):
    pair_matmul(lhs[:2], rhs, groups, rows_per_lhs=2)


def test_pallas_moe_layer_runs_few_pairs_pair_by_pair():
  """Kernels("pallas").moe with the decode kernel off: decode rows (pairs <= moe_pair_max) pair
  by pair, verify rows over the sorted pairs; both equal the reference."""
  params, x, _, _ = _experts(r=9)
  routing = moe.Routing(3, norm_topk_prob=True)
  layer = kernels.Kernels("pallas", tuning=kernels.KernelTuning(
      moe_decode_max=0, moe_pair_max=6, moe_pair_blocks=(16, 16, 16))).moe
  for rows in (1, 2, 9):  # 3 and 6 pairs by pair, 27 sorted
    w, ex = moe.route(params, x[:rows], routing)
    assert_close_rel(layer(params, x[:rows], routing=routing), moe.reference(params, x[:rows], w, ex), 1e-5)


@pytest.mark.parametrize("m,e,block_m", [(1, 8, 16), (8, 8, 16), (17, 8, 16), (40, 5, 8),
                                         (3, 16, 16), (64, 4, 16)])
def test_pallas_grouped_matmul_equals_ragged_dot(m, e, block_m):
  rng = np.random.default_rng(m * 31 + e)
  sizes = np.bincount(rng.integers(0, e, m), minlength=e).astype(np.int32)
  sizes[0] = 0  # an expert no row chose
  sizes[-1] += m - sizes.sum()
  lhs = jnp.asarray(rng.normal(size=(m, 40)), jnp.float32)
  rhs = jnp.asarray(rng.normal(size=(e, 40, 72)), jnp.float32)
  want = jax.lax.ragged_dot(lhs, rhs, jnp.asarray(sizes))
  got = grouped_matmul(lhs, rhs, jnp.asarray(sizes), block_m=block_m, block_n=32, block_k=16)
  assert_close_rel(got, want, 1e-5)
  # every row is covered by exactly one tile, and no tile spans two groups
  group, row0, rows = (np.asarray(a) for a in tiles(jnp.asarray(sizes), m, block_m))
  owner = np.repeat(np.arange(e), sizes)
  covered = np.zeros(m, int)
  for g, r0, n in zip(group, row0, rows):
    covered[r0:r0 + n] += 1
    assert n == 0 or set(owner[r0:r0 + n]) == {g}
  assert (covered == 1).all()


def test_pallas_swiglu_gate_up_and_combine_equal_xla():
  """The fused gate/up + SwiGLU launch and the combine kernel against moe's XLA forms; the
  combine ignores elsewhere pairs (-1) even where their rows hold garbage (NaN)."""
  rng = np.random.default_rng(5)
  sizes = jnp.asarray([3, 0, 6, 1], jnp.int32)
  xs = jnp.asarray(rng.normal(size=(12, 40)), jnp.float32)        # 2 rows past sum(sizes)
  w = jnp.asarray(rng.normal(size=(4, 40, 2, 24)), jnp.float32)
  want = moe.xla_gate_up(xs, w, sizes)[:10]
  assert_close_rel(grouped_matmul(xs, w, sizes, block_m=4, block_n=16, block_k=16, swiglu=True)[:10],
         want, 1e-5)
  y = jnp.asarray(rng.normal(size=(10, 40)), jnp.float32).at[7].set(jnp.nan)
  position = jnp.asarray([[0, 3, -1], [9, -1, 7], [2, 1, 5]], jnp.int32)
  position = jnp.where(position == 7, -1, position)                 # row 7: NaN, never picked
  weights = jnp.asarray(rng.uniform(size=(3, 3)), jnp.float32)
  got = combine(y, position, weights, block_h=16)
  assert_close_rel(got, moe.xla_combine(y, position, weights), 1e-6)
  assert np.isfinite(np.asarray(got)).all()
  with pytest.raises(ValueError, match=r"\[E, K, 2, N\]"):
    grouped_matmul(xs, w.reshape(4, 40, 48), sizes, swiglu=True)


def test_grouped_matmul_refuses_mismatched_operands():
  with pytest.raises(ValueError, match="do not match"):
    grouped_matmul(jnp.zeros((4, 8)), jnp.zeros((2, 6, 8)), jnp.array([2, 2]))
  with pytest.raises(ValueError, match="bfloat16"):
    grouped_matmul(jnp.zeros((4, 8)), jnp.zeros((2, 8, 8), jnp.bfloat16), jnp.array([2, 2]))


# --------------------------------------------------------------------------------------------
# Parity with HF transformers


def test_config_parsing():
  (top2, _), (sparse, _), (top1, _) = (load_fixture(n) for n in FIXTURE_NAMES)
  assert top2.config.moe_layers == (0, 1) and top2.config.norm_topk_prob
  assert sparse.config.moe_layers == (1, 3) and sparse.config.num_experts_per_tok == 3
  assert top1.config.moe_layers == (1, 2) and top1.config.num_experts_per_tok == 1
  assert top1.params.layers[0].moe is None and top1.params.layers[1].w_down is None
  assert top1.params.layers[1].moe.router.dtype == jnp.float32
  assert top1.params.layers[1].moe.w_gate_up.shape == (8, 32, 2, 24)


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


def test_fused_expert_layout_loads_the_same(tmp_path):
  """A checkpoint with 3-D experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I]."""
  path = copy_fixture(tmp_path, "qwen3_moe_sparse_step")
  file = os.path.join(path, "model.safetensors")
  t = {k: np.array(v) for k, v in read_safetensors(file).items()}
  for layer in (1, 3):
    p = f"model.layers.{layer}.mlp.experts."
    gate = [t.pop(f"{p}{e}.gate_proj.weight") for e in range(8)]
    up = [t.pop(f"{p}{e}.up_proj.weight") for e in range(8)]
    t[p + "gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
    t[p + "down_proj"] = np.stack([t.pop(f"{p}{e}.down_proj.weight") for e in range(8)])
  write_safetensors(file, t)
  fused = dj.load_target(path, dtype="float32")
  target, ref = load_fixture("qwen3_moe_sparse_step")
  same = jax.tree_util.tree_map(np.array_equal, fused.params, target.params)
  assert all(jax.tree_util.tree_leaves(same))
  assert_close_rel(dj.forward_logits(fused, ref["input_ids"]), ref["logits"])


def test_hf_export_round_trip(tmp_path):
  target, ref = load_fixture("qwen3_moe_top1")
  out = hf_export.save_target_hf(str(tmp_path / "out"), target.params, target.config,
                                 dtype="float32")
  again = dj.load_target(out, dtype="float32")
  assert again.config == target.config
  assert all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(np.array_equal, again.params,
                                                              target.params)))
  assert set(read_safetensors(os.path.join(out, "model.safetensors"))) == set(
      read_safetensors(os.path.join(FIXTURES, "qwen3_moe_top1", "model.safetensors")))


# --------------------------------------------------------------------------------------------
# Lossless speculative decoding


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  target, _ = load_fixture("qwen3_moe_sparse_step")
  return (target, *drafter_and_ar(str(tmp_path_factory.mktemp("drafter")), target, PROMPTS, M,
                                  (1, 3)))


@pytest.mark.parametrize("method,budget", [("chain", None), ("ddtree", 1), ("ddtree", 16),
                                           ("ddtree", 256)])  # every budget: test_decode
@pytest.mark.parametrize("batch", [1, 3])
def test_speculative_decoding_is_lossless(setup, method, budget, batch):
  target, drafter, ar = setup
  assert_lossless(target, drafter, PROMPTS[:batch], ar[:batch], method, budget, M,
                  seed=(budget or 0) + 1)


def test_real_drafter_chain_and_pallas_kernels_are_lossless(setup):
  """The drafter itself (its taps from MoE layers), and the Pallas path (grouped GEMM)."""
  assert_real_drafter_lossless(*setup[:2], PROMPTS, setup[2])


def test_sampling_with_a_moe_target_follows_its_distribution(tmp_path):
  """T > 0 on a tiny MoE target: DDTree samples from the target's own distribution."""
  from test_sampling import V, check, empirical_joint, exact_joint  # pylint: disable=import-outside-toplevel
  cfg = ModelConfig(model_type="qwen3_moe", vocab_size=V, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True,
                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    norm_topk_prob=True, moe_layers=(0, 1))
  target = checkpoint.Target(params=decoder.init_params(cfg, jax.random.key(3), jnp.float32,
                                                      std=0.4), config=cfg)
  drafter = dj.load_drafter(write_drafter(str(tmp_path), cfg, num_layers=1, block_size=4,
                                          mask_token_id=3, std=0.5), target)
  p = exact_joint(target, 1.0)
  tv, pvalue = check(empirical_joint(target, drafter, "ddtree", 16, 1.0), p)
  assert tv < 0.03 and pvalue > 1e-3, (tv, pvalue)


# --------------------------------------------------------------------------------------------
# Expert parallelism on 8 CPU devices


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
  """A MoE target whose heads, kv heads, experts and expert width all divide 8 (written with
  hf_export), a drafter, AR tokens and the one-device DDTree acceptance lengths."""
  cfg = ModelConfig(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=64,
                    num_layers=2, num_heads=8, num_kv_heads=8, head_dim=8, qk_norm=True,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                    norm_topk_prob=True, moe_layers=(0, 1), eos_token_ids=(1,))
  root = tmp_path_factory.mktemp("ep")
  params = decoder.init_params(cfg, jax.random.key(5), jnp.float32, std=0.3)
  path = hf_export.save_target_hf(str(root / "target"), params, cfg, dtype="float32")
  target = dj.load_target(path, dtype="float32", fuse_qkv=False)
  dpath = write_drafter(str(root / "drafter"), cfg, block_size=8)
  drafter = dj.load_drafter(dpath, target)
  ar = dj.generate(target, PROMPTS, max_new_tokens=24, stop_token_ids=()).tokens
  res = dj.generate(target, PROMPTS, method="ddtree", drafter=oracle_drafter(drafter, PROMPTS, ar),
                    budget=16, max_new_tokens=24, stop_token_ids=())
  assert res.tokens == ar
  return path, dpath, ar, res.stats["acceptance_lengths"]


@pytest.mark.parametrize("ep,tp", [(2, 1), (4, 1), (8, 1), (1, 8), (2, 4), (4, 2)])
def test_expert_parallel_equals_one_device(wide, ep, tp):
  path, dpath, ar, acc = wide
  mesh = sharding.make_mesh({"dp": 1, "tp": tp, "ep": ep})
  target = dj.load_target(path, dtype="float32", mesh=mesh)
  w = target.params.layers[0].moe.w_gate_up
  assert w.addressable_shards[0].data.shape == (8 // ep, 64, 2, 16 // tp)
  drafter = dj.load_drafter(dpath, target)
  res = dj.generate(target, PROMPTS, method="ddtree", drafter=oracle_drafter(drafter, PROMPTS, ar),
                    budget=16, max_new_tokens=24, stop_token_ids=())
  assert res.tokens == ar
  assert res.stats["acceptance_lengths"] == acc


def test_shard_moe_equals_one_device():
  params, x, _, _ = _experts(r=8, k=2)
  want = kernels.REFERENCE.moe(params, x, routing=moe.Routing(2, norm_topk_prob=True))
  for shape in ({"dp": 2, "tp": 2, "ep": 2}, {"dp": 1, "tp": 1, "ep": 8}):
    mesh = sharding.make_mesh(shape)
    got = kernels.Kernels(mesh=mesh).moe(params, x, routing=moe.Routing(2, norm_topk_prob=True))
    assert_close_rel(got, want, 1e-5)


# --------------------------------------------------------------------------------------------
# Bad input


def test_experts_not_divisible_by_the_expert_axis():
  with pytest.raises(ValueError, match=r"num_experts \(8\) is not divisible by mesh axis 'ep'"):
    dj.load_target(os.path.join(FIXTURES, "qwen3_moe_top2"), dtype="float32",
                   mesh=sharding.make_mesh({"dp": 1, "tp": 1, "ep": 3}))


def test_missing_expert_tensor_is_named(tmp_path):
  path = copy_fixture(tmp_path, "qwen3_moe_top2")
  file = os.path.join(path, "model.safetensors")
  t = {k: np.array(v) for k, v in read_safetensors(file).items()}
  del t["model.layers.1.mlp.experts.5.up_proj.weight"]
  write_safetensors(file, t)
  with pytest.raises(CheckpointError, match=r"missing tensors .*layers\.1\.mlp\.experts\.5\."
                                            r"up_proj\.weight"):
    dj.load_target(path, dtype="float32")


@pytest.mark.parametrize("changes,match", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 exceeds num_local_experts=8"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok"),
    (dict(shared_expert_intermediate_size=16), "shared_expert_intermediate_size"),
    (dict(mlp_only_layers=[5]), "mlp_only_layers"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size"),
    (dict(use_sliding_window=True), "use_sliding_window"),
])
def test_bad_moe_config_is_refused_naming_the_field(tmp_path, changes, match):
  path = copy_fixture(tmp_path, "qwen3_moe_top2")
  edit_config(path, **changes)
  with pytest.raises(ValueError, match=match):
    dj.load_target(path, dtype="float32")
