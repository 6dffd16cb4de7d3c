"""The benchmark drafter (set acceptance) and the planted target (a greedy path bf16 keeps)."""

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dj
from ddtree_jax.checkpoints import dflash, hf
from ddtree_jax.request import GenerateOptions
from ddtree_jax.serving import slots
from ddtree_jax.tools import benchmark_drafter as bd
from experiments.perf import harness

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


def planted(shape: str, dtype, seed: int = 5):
  """(a random target of `shape` with a planted path, a random drafter, the path's successor)."""
  cfg = harness.target_config(True, shape)
  params = harness.random_target(cfg, jax.random.key(0), dtype=dtype)
  target = bd.planted_target(hf.Target(params=params, config=cfg, tokenizer=None, path="random",
                                       mesh=None, rules=None), seed=seed)
  dcfg = harness.drafter_config(cfg, small=True)
  dparams = harness.random_drafter_params(cfg, dcfg, jax.random.key(1), dtype)
  successor = bd.planted_successor(cfg.vocab_size, seed)
  return target, dflash.Drafter(params=dparams, config=dcfg, path="random"), successor


def prompts_of(vocab: int, lens=(7, 1, 12)):
  return [np.random.default_rng(i).integers(0, vocab, n).tolist() for i, n in enumerate(lens)]


@pytest.fixture(scope="module")
def pair():
  target, drafter, successor = planted("qwen3-8b", jnp.float32)
  prompts = prompts_of(target.config.vocab_size)
  ar = dj.generate(target, prompts, max_new_tokens=M, stop_token_ids=()).tokens
  return target, drafter, successor, prompts, ar


def test_acceptance_follows_the_rate_and_output_stays_the_targets(pair):
  target, drafter, successor, prompts, ar = pair
  run = lambda accept, method="chain", budget=None: dj.generate(
      target, prompts, method=method, budget=budget, max_new_tokens=M, stop_token_ids=(),
      drafter=bd.benchmark_drafter(drafter, successor, accept))
  always = run(1.0)
  assert always.tokens == ar
  for lens in always.stats["acceptance_lengths"]:  # every draft accepted: whole blocks
    assert lens[:-1] == [drafter.config.block_size] * (len(lens) - 1)
  never = run(0.0)
  assert never.tokens == ar and never.stats["tau"] == 1.0
  chain, tree = run(0.7), run(0.7, "ddtree", 16)
  assert chain.tokens == ar and tree.tokens == ar
  assert 1.5 < chain.stats["tau"] < tree.stats["tau"]  # siblings catch second-ranked tokens


def test_the_slot_server_runs_it_per_request(pair):
  """Requests of different lengths through the slot engine's slots: each request's tokens are
  AR's, and whole blocks are accepted at accept 1 (the draws need no per-request state)."""
  target, drafter, successor, prompts, ar = pair
  engine = slots.SlotEngine(target, bd.benchmark_drafter(drafter, successor, 1.0),
                            slots.SlotConfig(method="ddtree", budget=16, slots=2, capacity=64,
                                             prompt_buckets=(16,), chunk_steps=2))
  got = [[] for _ in prompts]
  done = [threading.Event() for _ in prompts]
  reqs = []
  for i, p in enumerate(prompts):
    def emit(toks, reason, i=i):
      got[i].extend(toks)
      if reason:
        done[i].set()
    reqs.append(engine.submit(p, GenerateOptions(max_new_tokens=M, stop_token_ids=()), emit))
  engine.start()
  try:
    assert all(d.wait(120) for d in done)
  finally:
    engine.stop()
  assert got == ar
  for r in reqs:
    assert r.acceptance[:-1] == [drafter.config.block_size] * (len(r.acceptance) - 1)


def test_bad_arguments_are_named(pair):
  target, drafter, successor, prompts, ar = pair
  with pytest.raises(ValueError, match="accept must be in"):
    bd.benchmark_drafter(drafter, successor, 1.5)
  with pytest.raises(ValueError, match="confidence must be in"):
    bd.benchmark_drafter(drafter, successor, 0.5, confidence=-1)
  with pytest.raises(ValueError, match="successor must be one token id"):
    bd.benchmark_drafter(drafter, successor + 1, 0.5)
  short = bd.benchmark_drafter(drafter, successor[:10] % 10, 0.5)
  with pytest.raises(ValueError, match="successor covers 10 tokens"):
    dj.generate(target, prompts, method="chain", drafter=short, max_new_tokens=4)
  restricted = dataclasses.replace(drafter, params=dflash.derive_drafter_params(
      drafter.params, target, draft_vocab=np.arange(64)))
  with pytest.raises(ValueError, match="restricted vocabulary"):
    bd.benchmark_drafter(restricted, successor, 0.5)
  tied = dataclasses.replace(target, params=dataclasses.replace(target.params, lm_head=None))
  with pytest.raises(ValueError, match="ties lm_head"):
    bd.planted_target(tied)


@pytest.mark.parametrize("shape", ["qwen3-8b", "qwen3-30b-a3b"])
def test_a_planted_bf16_target_follows_its_permutation_in_every_method(shape):
  """Random bf16 weights: AR follows the planted successor and a tree's verify agrees with it,
  so the benchmark drafter's path stays the target's."""
  target, drafter, successor = planted(shape, jnp.bfloat16)
  prompts = prompts_of(target.config.vocab_size, (20, 20))
  ar = dj.generate(target, prompts, max_new_tokens=24, stop_token_ids=()).tokens
  for p, out in zip(prompts, ar):
    seq = [int(p[-1])] + out
    assert all(successor[a] == b for a, b in zip(seq, seq[1:]))
  d = bd.benchmark_drafter(drafter, successor, 0.8)
  tree = dj.generate(target, prompts, method="ddtree", budget=16, drafter=d, max_new_tokens=24,
                     stop_token_ids=())
  assert tree.tokens == ar and tree.stats["tau"] > 2
