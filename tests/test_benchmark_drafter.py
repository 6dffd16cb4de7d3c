"""The benchmark drafter (set acceptance) and the planted target (a greedy path bf16 keeps)."""

import dataclasses

import jax
import numpy as np
import pytest

import ddtree_jax as dj
from ddtree_jax.checkpoints import dflash, hf
from ddtree_jax.tools import benchmark_drafter as bd
from experiments.perf import harness
from helpers import drafter_and_ar, load_fixture

PROMPTS = [[3, 17, 99, 4, 250, 31, 8], [42], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 9]]
M = 32


@pytest.mark.parametrize("accept", [0.3, 0.6, 0.9])
def test_the_true_token_ranks_geometrically(accept):
  pos = np.arange(20000)
  rank = bd.true_rank(np, pos, np.zeros_like(pos), accept, seed=3)
  for k in range(3):
    assert abs(np.mean(rank == k) - accept * (1 - accept) ** k) < 0.015, k
  assert np.mean(rank == bd.RANKS) == pytest.approx((1 - accept) ** bd.RANKS, abs=0.01)
  np.testing.assert_array_equal(rank, np.asarray(bd.true_rank(
      jax.numpy, pos, np.zeros_like(pos), accept, seed=3)))  # the device draws the same
  assert np.all(bd.true_rank(np, pos, pos, 0.0, 0) == bd.RANKS)
  assert np.all(bd.true_rank(np, pos, pos, 1.0, 0) == 0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  target, _ = load_fixture("qwen3_gqa")
  drafter, ar = drafter_and_ar(str(tmp_path_factory.mktemp("d")), target, PROMPTS, M, (0, 1))
  return target, drafter, ar


def test_acceptance_follows_the_rate_and_output_stays_the_targets(pair):
  target, drafter, ar = pair
  run = lambda accept, method="chain", budget=None: dj.generate(
      target, PROMPTS, method=method, budget=budget, max_new_tokens=M, stop_token_ids=(),
      drafter=bd.benchmark_drafter(drafter, PROMPTS, ar, accept))
  always = run(1.0)
  assert always.tokens == ar
  for lens in always.stats["acceptance_lengths"]:  # every draft accepted: whole blocks
    assert lens[:-1] == [drafter.config.block_size] * (len(lens) - 1)
  never = run(0.0)
  assert never.tokens == ar and never.stats["tau"] == 1.0
  chain, tree = run(0.7), run(0.7, "ddtree", 16)
  assert chain.tokens == ar and tree.tokens == ar
  assert 1.5 < chain.stats["tau"] < tree.stats["tau"]  # siblings catch second-ranked tokens


def test_bad_arguments_are_named(pair):
  target, drafter, ar = pair
  with pytest.raises(ValueError, match="accept must be in"):
    bd.benchmark_drafter(drafter, PROMPTS, ar, 1.5)
  with pytest.raises(ValueError, match="confidence must be in"):
    bd.benchmark_drafter(drafter, PROMPTS, ar, 0.5, confidence=-1)
  with pytest.raises(ValueError, match="one continuation per prompt"):
    bd.benchmark_drafter(drafter, PROMPTS, ar[:1], 0.5)
  restricted = dataclasses.replace(drafter, params=dflash.derive_drafter_params(
      drafter.params, target, draft_vocab=np.arange(64)))
  with pytest.raises(ValueError, match="restricted vocabulary"):
    bd.benchmark_drafter(restricted, PROMPTS, ar, 0.5)
  tied = dataclasses.replace(target, params=dataclasses.replace(target.params, lm_head=None))
  with pytest.raises(ValueError, match="ties lm_head"):
    bd.planted_target(tied)


@pytest.mark.parametrize("shape", ["qwen3-8b", "qwen3-30b-a3b"])
def test_a_planted_bf16_target_follows_its_permutation_in_every_method(shape):
  """Random bf16 weights: AR follows perm (the planted path) and a tree's verify agrees with it,
  so the benchmark drafter's reference stays the target's."""
  cfg = harness.target_config(True, shape)
  target = hf.Target(params=harness.random_target(cfg, jax.random.key(0)), config=cfg,
                     tokenizer=None, path="random", mesh=None, rules=None)
  target = bd.planted_target(target, seed=5)
  perm = np.random.default_rng(5).permutation(cfg.vocab_size)
  dparams, dcfg = harness.random_drafter(cfg, jax.random.key(1), small=True)
  drafter = dflash.Drafter(params=dparams, config=dcfg, path="random")
  prompts = [list(np.random.default_rng(i).integers(0, cfg.vocab_size, 20)) for i in range(2)]
  ar = dj.generate(target, prompts, max_new_tokens=24, stop_token_ids=()).tokens
  for p, out in zip(prompts, ar):
    seq = [int(p[-1])] + out
    assert all(perm[a] == b for a, b in zip(seq, seq[1:]))
  d = bd.benchmark_drafter(drafter, prompts, ar, 0.8)
  tree = dj.generate(target, prompts, method="ddtree", budget=16, drafter=d, max_new_tokens=24,
                     stop_token_ids=())
  assert tree.tokens == ar and tree.stats["tau"] > 2
