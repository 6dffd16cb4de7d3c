"""Lossless decoding: chain and DDTree tokens equal AR greedy tokens (float32), edges, errors."""

import os

import jax
from jax.experimental.compilation_cache import compilation_cache
import pytest

import ddtree_jax as dj
from ddtree_jax import engine
from conftest import FIXTURES
from helpers import assert_accepted, oracle_drafter, write_drafter

M = 40
PROMPTS = [[3, 17, 99, 4, 250, 31, 8], [42], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 9],
           [200, 1, 0, 3], [15, 16], [101] * 30, [5, 6, 7], [88, 77, 66, 55, 44, 33, 22]]


@pytest.fixture(scope="module", autouse=True)
def _shared_compiles(tmp_path_factory):
  """JAX's persistent compilation cache, for this module only: the engine keys a program by every
  static of the request, but many of this module's requests lower to the same XLA program (the
  prefill does not depend on the method, the budget, the oracle's seed or steps_per_check), and
  such a program is then compiled once and read back. The process's settings are put back
  after, the cache off if it was."""
  before = (jax.config.jax_compilation_cache_dir,
            jax.config.jax_persistent_cache_min_compile_time_secs,
            jax.config.jax_persistent_cache_min_entry_size_bytes)
  engine.enable_compilation_cache(str(tmp_path_factory.mktemp("xla_cache")))
  yield
  if before[0]:
    engine.enable_compilation_cache(before[0], before[1])
  else:
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", before[2])


@pytest.fixture(scope="module")
def target():
  return dj.load_target(os.path.join(FIXTURES, "qwen3_gqa"), dtype="float32")


@pytest.fixture(scope="module")
def drafter(target, tmp_path_factory):
  path = write_drafter(str(tmp_path_factory.mktemp("drafter")), target.config, block_size=8)
  return dj.load_drafter(path, target)


@pytest.fixture(scope="module")
def ar(target):
  # also the request of test_steps_per_check_changes_no_token_and_no_stat[ar]'s K = 1 runs
  return dj.generate(target, PROMPTS, max_new_tokens=M, stop_token_ids=()).tokens


def _batch(n):
  return {1: [0], 3: [0, 1, 2], 8: list(range(8))}[n]


def _oracle(drafter, ar, idx, corruption=0.3, seed=0, over_real=False):
  return oracle_drafter(drafter, [PROMPTS[i] for i in idx], [ar[i] for i in idx],
                        corruption=corruption, seed=seed, over_real=over_real)


def test_ragged_batch_equals_each_prompt_alone(target, ar):
  for i in (0, 1, 5):
    alone = dj.generate(target, [PROMPTS[i]], max_new_tokens=M, stop_token_ids=()).tokens[0]
    assert alone == ar[i]


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_chain_is_lossless_with_full_partial_and_zero_acceptance(target, drafter, ar, batch):
  idx = _batch(batch)
  d = _oracle(drafter, ar, idx)
  res = dj.generate(target, [PROMPTS[i] for i in idx], method="chain", drafter=d,
                    max_new_tokens=M, stop_token_ids=())
  assert res.tokens == [ar[i] for i in idx]
  lens = [a for seq in res.stats["acceptance_lengths"] for a in seq]
  block = drafter.config.block_size
  assert 1 in lens and block in lens and any(1 < a < block for a in lens), lens
  # tau is the mean committed tokens per step, counted independently.
  steps = sum(len(s) for s in res.stats["acceptance_lengths"])
  assert res.stats["tau"] == pytest.approx((sum(len(t) for t in res.tokens) - batch) / steps)
  assert_accepted(d, [PROMPTS[i] for i in idx], res, "chain")


@pytest.mark.parametrize("method,budget", [("chain", None), ("ddtree", 32)])
def test_real_drafter_under_the_oracle_is_lossless(target, drafter, ar, method, budget):
  """The drafter's own forward in the loop, giving every logit but the oracle's two picks, so its
  drafts shape trees whose paths get accepted."""
  idx = _batch(3)
  prompts = [PROMPTS[i] for i in idx]
  d = _oracle(drafter, ar, idx, over_real=True)
  res = dj.generate(target, prompts, method=method, drafter=d, budget=budget, max_new_tokens=M,
                    stop_token_ids=())
  assert res.tokens == ar[:3]
  assert_accepted(d, prompts, res, method, budget)


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 64, 128, 256])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_ddtree_is_lossless(target, drafter, ar, budget, batch):
  idx = _batch(batch)
  d = _oracle(drafter, ar, idx, seed=budget)
  res = dj.generate(target, [PROMPTS[i] for i in idx], method="ddtree", drafter=d, budget=budget,
                    max_new_tokens=M, stop_token_ids=())
  assert res.tokens == [ar[i] for i in idx]
  lens = [a for seq in res.stats["acceptance_lengths"] for a in seq]
  assert max(lens) <= drafter.config.block_size
  assert_accepted(d, [PROMPTS[i] for i in idx], res, "ddtree", budget)
  if batch == 8 and budget >= 32:
    assert 1 in lens and drafter.config.block_size in lens, lens


def test_topk1_tree_reproduces_chain(target, drafter, ar):
  idx = _batch(3)
  d = _oracle(drafter, ar, idx)
  prompts = [PROMPTS[i] for i in idx]
  chain = dj.generate(target, prompts, method="chain", drafter=d, max_new_tokens=M,
                      stop_token_ids=())
  tree = dj.generate(target, prompts, method="ddtree", drafter=d, max_new_tokens=M,
                     budget=drafter.config.num_drafts, topk_cap=1, stop_token_ids=())
  assert tree.tokens == chain.tokens
  assert tree.stats["acceptance_lengths"] == chain.stats["acceptance_lengths"]
  assert_accepted(d, prompts, chain, "chain")


def test_budget_switching_in_one_process(target, drafter, ar):
  """The seed's scenario: 8 -> 16 -> 32 -> 64 -> 8 in one process stays lossless."""
  idx = _batch(3)
  for budget in (8, 16, 32, 64, 8):
    # test_ddtree_is_lossless's oracle (seed = budget), so its batch-3 programs serve these runs
    d = _oracle(drafter, ar, idx, seed=budget)
    res = dj.generate(target, [PROMPTS[i] for i in idx], method="ddtree", drafter=d,
                      budget=budget, max_new_tokens=M, stop_token_ids=())
    assert res.tokens == [ar[i] for i in idx], budget


@pytest.mark.parametrize("method,budget", [("ar", None), ("ddtree", 16)])
def test_steps_per_check_changes_no_token_and_no_stat(target, drafter, ar, method, budget):
  """K steps per check of the loop's stop condition (`decode.decode_loop`): K = 4 and K =
  max_new_tokens (the largest allowed: one group for the whole request) run idle steps after
  every sequence is done. Tokens, acceptance lengths and step counts equal K = 1's, with and
  without a stop token."""
  # K = 1 without a stop token is the `ar` fixture's request (AR) and test_ddtree_is_lossless's
  # batch-3 B=16 one (DDTree, its oracle: seed = budget), so their programs serve it.
  idx = _batch(8 if method == "ar" else 3)
  d = _oracle(drafter, ar, idx, seed=budget) if method != "ar" else None
  prompts = [PROMPTS[i] for i in idx]
  for stop in ((), (ar[0][12],)) if method == "ddtree" else ((),):
    runs = [dj.generate(target, prompts, method=method, drafter=d, budget=budget,
                        max_new_tokens=M, stop_token_ids=stop, steps_per_check=k)
            for k in (1, 4, M)]
    assert runs[0].stats["steps"] < M  # so K = M ran idle steps
    for r in runs[1:]:
      assert r.tokens == runs[0].tokens
      assert r.stats["acceptance_lengths"] == runs[0].stats["acceptance_lengths"]
      assert r.stats["steps"] == runs[0].stats["steps"]
    if not stop:
      assert runs[0].tokens == [ar[i] for i in idx]
