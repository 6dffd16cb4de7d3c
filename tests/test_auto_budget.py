"""budget="auto" (speculative/auto.py, auto_costs.py): the expected acceptance of every budget from
one tree, the choice by expected tokens per second, lossless whatever it chooses (dense, MoE, latent
attention; batch 1 and 3 ragged; T > 0), the back-off to AR for a drafter that is never right,
and measured costs kept on disk."""

import dataclasses
import os
import time

import jax
from jax.experimental.compilation_cache import compilation_cache
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dj
from ddtree_jax import auto_costs, engine
from ddtree_jax.speculative import decode
from ddtree_jax.request import RequestError
from ddtree_jax.speculative import auto
from ddtree_jax.speculative import tree as tree_lib
from helpers import OracleConfig, drafter_and_ar, load_fixture, oracle_counts, oracle_drafter

M = 32
PROMPTS = [[3, 17, 99, 4, 250, 31, 8], [42], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 9]]
BUDGETS = (0, 4, 16, 64)
MIXED = (1.0, 1.3, 2.0, 4.0)  # seconds per step: each option wins somewhere


def test_expected_acceptance_is_the_sum_over_the_trees_nodes():
  """E(B) from the tree at the largest budget equals, for each smaller B, the sum over its first
  B nodes of their paths' probabilities under the draft (walked node by node)."""
  logits = 2.0 * jax.random.normal(jax.random.key(0), (2, 5, 12))
  tree = tree_lib.build_tree(logits, 40)
  got = np.asarray(auto.expected_accepted(tree.scores, (0, 1, 7, 40)))
  q = np.asarray(jax.nn.softmax(logits, axis=-1), np.float64)
  tokens, parents, depths = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.depths))
  for b in range(2):
    prob = []
    for i in range(1, 41):
      p, node = 1.0, i
      while node > 0:
        p *= q[b, depths[b, node] - 1, tokens[b, node]]
        node = parents[b, node]
      prob.append(p)
    want = [sum(prob[:n]) for n in (0, 1, 7, 40)]
    np.testing.assert_allclose(got[b], want, rtol=1e-5)


def test_choose_takes_the_most_expected_tokens_per_second():
  state = auto.AutoState.init(jnp.asarray([1.0, 2.0, 4.0]), 2, 8, 2)
  expected = jnp.asarray([[0.0, 3.0, 5.0], [0.0, 1.0, 9.0]])   # rows x options
  live = jnp.asarray([True, True])
  # values: AR 2 / 1 = 2, B1 (4 + 2) / 2 = 3, B2 (6 + 10) / 4 = 4
  assert int(auto.choose(state, expected, live)) == 2
  assert int(auto.choose(state, expected, jnp.asarray([True, False]))) == 1  # 2, 2, 1.5
  # a row that accepted nothing of 10 expected scales its expectations by 1 / 11
  poor = dataclasses.replace(state, expected=jnp.asarray([10.0, 10.0]))
  assert int(auto.choose(poor, expected, live)) == 0
  assert int(auto.choose(state, expected, jnp.zeros(2, bool))) == 0  # nothing live


@pytest.mark.parametrize("cost,unit", [((1.0, 1.0), 1), ((1.0, 2.5), 3)])
def test_back_off_doubles_while_ar_wins_and_resets_when_it_does_not(cost, unit):
  """A drafted step that AR wins skips backoff x (the cheapest drafted budget's cost in AR
  steps) steps, doubling backoff; one that AR does not win resets it."""
  s = auto.AutoState.init(jnp.asarray(cost), 1, 64, 1)
  drafted, step = [], 0
  for ar_won in [True, True, True, False, True]:
    while int(s.skip) > 0:  # undrafted AR steps
      s = auto.after_step(s, step, jnp.int32(0), jnp.zeros(1), jnp.zeros(1, jnp.int32),
                          jnp.ones(1, bool), False)
      step += 1
    drafted.append(step)
    s = auto.after_step(s, step, jnp.int32(8), jnp.ones(1), jnp.zeros(1, jnp.int32),
                        jnp.ones(1, bool), ar_won)
    step += 1
  gaps = [b - a - 1 for a, b in zip(drafted, drafted[1:])]
  assert gaps == [unit, 2 * unit, 4 * unit, 0]
  assert int(s.skip) == unit and int(s.backoff) == 2
  assert float(s.expected[0]) == 5.0  # the drafted steps' predictions, summed for the ratio
  assert [int(c) for c in s.chosen[:step]] == [8 if i in drafted else 0 for i in range(step)]


# The families' own layers are each family's lossless tests'; here auto composes them: the dense
# target at both batches, MoE and latent attention at batch 3.
@pytest.mark.parametrize("name,taps,batch", [
    ("qwen3_gqa", (0, 1), 1), ("qwen3_gqa", (0, 1), 3), ("qwen3_moe_sparse_step", (1, 3), 3),
    ("dsv3_plain", (0, 2), 3)])
def test_auto_is_lossless_whatever_it_chooses(tmp_path, name, taps, batch):
  """An oracle drafter (accepted on purpose) and costs under which the options take turns (one
  row's acceptance varies more than three rows' together): AR's tokens, multi-token steps."""
  target, _ = load_fixture(name)
  drafter, ar = drafter_and_ar(str(tmp_path), target, PROMPTS[:batch], M, taps)
  oracle = oracle_drafter(drafter, PROMPTS[:batch], ar)
  res = dj.generate(target, PROMPTS[:batch], method="ddtree", drafter=oracle, budget="auto",
                    budgets=BUDGETS, budget_costs=MIXED, max_new_tokens=M, stop_token_ids=())
  assert res.tokens == ar
  multi, _ = oracle_counts(oracle, PROMPTS[:batch], res)
  assert multi > 0 and max(res.stats["chosen"]) > 0
  assert len(set(res.stats["chosen"])) > 1 or batch > 1, res.stats["chosen"]
  assert res.stats["budget"] == "auto" and res.stats["budgets"] == list(BUDGETS)
  assert all(len(p) == len(a) for p, a in zip(res.stats["predicted"],
                                              res.stats["acceptance_lengths"]))


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
  target, _ = load_fixture("qwen3_gqa")
  drafter, ar = drafter_and_ar(str(tmp_path_factory.mktemp("d")), target, PROMPTS, 64, (0, 1))
  return target, drafter, ar


def test_a_budget_that_is_cheapest_per_expected_token_is_taken(dense):
  target, drafter, ar = dense
  oracle = oracle_drafter(drafter, PROMPTS, [a[:M] for a in ar])
  run = lambda costs: dj.generate(target, PROMPTS, method="ddtree", drafter=oracle,
                                  budget="auto", budgets=BUDGETS, budget_costs=costs,
                                  max_new_tokens=M, stop_token_ids=())
  cheap16 = run((1.0, 9.0, 0.5, 9.0))  # the first tree is the largest: every option weighed
  chosen = cheap16.stats["chosen"]
  assert set(chosen) == {16} and cheap16.tokens == [a[:M] for a in ar]
  # AR at a thousandth of a drafted step, the drafted budgets at one cost: the first (largest)
  # tree verifies its most expected budget, then AR wins and it backs off for 1000 steps
  cheap_ar = run((1e-3, 1.0, 1.0, 1.0))
  chosen = cheap_ar.stats["chosen"]
  assert chosen[0] == 64 and set(chosen[1:]) == {0}
  assert cheap_ar.tokens == [a[:M] for a in ar]


@dataclasses.dataclass(frozen=True)
class WrongConfig(OracleConfig):
  """Drafts a confident wrong token at every position (the true one's successor): never right,
  and sure of itself."""

  def draft(self, params, target_params, cache, bonus, kernels=None):
    _, ref = params
    v = self.layers.vocab_size
    pos = cache.lens[:, None] + jnp.arange(1, self.num_drafts + 1)[None]
    y = jnp.take_along_axis(ref, jnp.minimum(pos, ref.shape[1] - 1), axis=1)
    ids = jnp.arange(v)
    return jnp.where(ids == ((y + 1) % v)[..., None], 12.0, 0.0)


def test_a_drafter_that_is_never_right_settles_on_ar(dense):
  """Its first drafted steps expect much and get nothing; within a few steps AR wins and the
  back-off drafts only now and then (each such step verifies the cheapest budget, and backs
  off for twice as long)."""
  target, drafter, ar = dense
  wrong = oracle_drafter(drafter, PROMPTS, ar)
  wrong = dataclasses.replace(wrong, config=WrongConfig(**{
      f.name: getattr(wrong.config, f.name) for f in dataclasses.fields(OracleConfig)}))
  res = dj.generate(target, PROMPTS, method="ddtree", drafter=wrong, budget="auto",
                    budgets=BUDGETS, budget_costs=(1.0, 1.5, 2.0, 4.0), max_new_tokens=64,
                    stop_token_ids=())
  assert res.tokens == ar
  chosen = res.stats["chosen"]
  drafted = [i for i, c in enumerate(chosen) if c > 0]
  assert len(chosen) == 63 and drafted[:2] == [0, 1] and len(drafted) <= 8, chosen
  assert all(b - a > 2 * (a - p) - 2 for p, a, b in zip(drafted[2:], drafted[3:], drafted[4:]))


@pytest.mark.parametrize("batch", [1, 3])
def test_choosing_every_k_steps_runs_blocks_of_one_budget_and_stays_lossless(dense, batch):
  """auto_every=4: the choosing step, then three steps of the budget it ran (recorded as chosen,
  so every aligned block of 4 holds one budget), AR's tokens with multi-token steps; the
  choices still move with the costs, and the ratio learns from the choosing steps alone."""
  target, drafter, ar = dense
  oracle = oracle_drafter(drafter, PROMPTS[:batch], [a[:M] for a in ar[:batch]])
  res = dj.generate(target, PROMPTS[:batch], method="ddtree", drafter=oracle, budget="auto",
                    budgets=BUDGETS, budget_costs=MIXED, auto_every=4, max_new_tokens=M,
                    stop_token_ids=())
  assert res.tokens == [a[:M] for a in ar[:batch]]
  chosen = res.stats["chosen"]
  assert len(chosen) == res.stats["steps"] and max(chosen) > 0
  blocks = [chosen[i:i + 4] for i in range(0, len(chosen), 4)]
  assert all(len(set(b)) == 1 for b in blocks), chosen
  assert len({b[0] for b in blocks}) > 1 or batch > 1, chosen
  multi, _ = oracle_counts(oracle, PROMPTS[:batch], res)
  assert multi > 0
  first_row = res.stats["acceptance_lengths"][0]   # live from the first step: aligned with chosen
  inner = [a for i, a in enumerate(first_row) if i % 4 and chosen[i] > 0]
  assert inner and max(inner) > 1, (chosen, first_row)  # the steps between ran drafted trees
  predicted = [p for row in res.stats["predicted"] for p in row]
  assert 0 < sum(p > 0 for p in predicted) < len(predicted)   # choosing steps only


def test_choosing_every_k_steps_backs_off_for_as_many_steps(dense):
  """A drafter that is never right, choosing every 4 steps: the ratio learns from choosing steps
  only, so the first back-off comes up to 4 times later than when choosing each step; after it a
  choosing step that backs off fills its block with AR steps, and AR steps count down the skip,
  so the probes are lone choosing steps, no more of them than when choosing each step."""
  target, drafter, ar = dense
  wrong = oracle_drafter(drafter, PROMPTS, ar)
  wrong = dataclasses.replace(wrong, config=WrongConfig(**{
      f.name: getattr(wrong.config, f.name) for f in dataclasses.fields(OracleConfig)}))
  kw = dict(method="ddtree", drafter=wrong, budget="auto", budgets=BUDGETS,
            budget_costs=(1.0, 1.5, 2.0, 4.0), max_new_tokens=64, stop_token_ids=())
  each = dj.generate(target, PROMPTS, **kw).stats["chosen"]
  every = dj.generate(target, PROMPTS, auto_every=4, **kw)
  assert every.tokens == ar
  chosen = every.stats["chosen"]
  first, first_each = chosen.index(0), each.index(0)
  probes = [i for i, c in enumerate(chosen) if c > 0 and i > first]
  assert first <= 4 * first_each and all(i % 4 == 0 for i in probes), (chosen, each)
  assert len(probes) <= sum(c > 0 for c in each[first_each:]) + 1, (chosen, each)
  assert chosen[-8:] == [0] * 8


@pytest.fixture
def cache_dir(tmp_path):
  """JAX's compilation cache in tmp_path for one test (off again after)."""
  before = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", str(tmp_path))
  yield tmp_path
  jax.config.update("jax_compilation_cache_dir", before)
  compilation_cache.reset_cache()


def test_measured_costs_are_kept_on_disk_and_reused(dense, cache_dir, monkeypatch):
  """Costs measured with the request's own programs: positive, one per option, written beside
  the compilation cache and read back by the next request of the same shapes."""
  target, drafter, ar = dense
  tmp_path = cache_dir
  monkeypatch.setattr(auto_costs, "_MEMORY", {})
  kw = dict(method="ddtree", drafter=drafter, budget="auto", budgets=(0, 8), max_new_tokens=16,
            stop_token_ids=())
  res = dj.generate(target, PROMPTS[:1], **kw)
  assert res.tokens[0] == ar[0][:16]
  costs = res.stats["budget_costs"]
  assert len(costs) == 2 and all(c > 0 for c in costs)
  assert os.path.exists(tmp_path / auto_costs.FILE)
  monkeypatch.setattr(auto_costs, "_MEMORY", {})
  monkeypatch.setattr(auto_costs, "measure", lambda *a: pytest.fail("measured again"))
  assert dj.budget_costs(target, PROMPTS[:1], **{k: v for k, v in kw.items()
                                                 if k not in ("method", "budget")}) == dict(
                                                     zip((0, 8), costs))


def test_costs_are_measured_once_a_process_and_reported_apart(dense, monkeypatch):
  """The first budget="auto" call of some shapes measures the costs and reports those seconds as
  auto_costs_seconds, outside prefill_seconds; a second identical call measures nothing,
  compiles nothing and gives the same costs and tokens."""
  target, drafter, ar = dense
  before = jax.config.jax_compilation_cache_dir  # (no costs on disk: only this process's)
  jax.config.update("jax_compilation_cache_dir", None)
  monkeypatch.setattr(auto_costs, "_MEMORY", {})
  measured, measure, pause = [], auto_costs.measure, 1.0

  def slow(*a):  # a measurement that takes at least `pause` seconds
    measured.append(a)
    time.sleep(pause)
    return measure(*a)
  monkeypatch.setattr(auto_costs, "measure", slow)
  kw = dict(method="ddtree", drafter=drafter, budget="auto", budgets=(0, 8), max_new_tokens=16,
            stop_token_ids=())
  try:
    first = dj.generate(target, PROMPTS[:1], **kw)
    programs = len(engine._PROGRAMS)  # pylint: disable=protected-access
    second = dj.generate(target, PROMPTS[:1], **kw)
  finally:
    jax.config.update("jax_compilation_cache_dir", before)
  one, two = first.stats, second.stats
  assert len(measured) == 1
  assert len(engine._PROGRAMS) == programs  # pylint: disable=protected-access
  assert one["auto_costs_seconds"] >= pause > one["prefill_seconds"]
  assert two["auto_costs_seconds"] < 0.1 and two["compile_seconds"] < 0.1
  assert two["budget_costs"] == one["budget_costs"]
  assert second.tokens == first.tokens == [ar[0][:16]]


def test_sampling_with_auto_follows_the_targets_distribution():
  """T > 0: the first K tokens follow the target's joint law whichever budgets are chosen."""
  from test_sampling import K, L, N, conditionals, make_target, passes, sample, table_drafter, verdict  # pylint: disable=import-outside-toplevel
  target = make_target()
  conds = conditionals(target, 1.0, depth=K + L - 1)
  counts, res = sample(target, table_drafter(conds), "ddtree", "auto", 1.0, k=K, n=N,
                       budgets=(0, 4, 16), budget_costs=(1.0, 1.1, 1.3))
  assert max(res.stats["chosen"]) > 0
  assert passes(verdict(counts, conds[:K]))


@pytest.mark.parametrize("kw,field", [
    (dict(budget="auto", budgets=(0,)), "budgets"),
    (dict(budget="auto", budgets=(8, 8)), "budgets"),
    (dict(budget="auto", budgets=(0, 8), budget_costs=(1.0,)), "budget_costs"),
    (dict(budget="auto", budgets=(0, 8), budget_costs=(1.0, 0.0)), "budget_costs"),
    (dict(budget=8, budgets=(0, 8)), "budgets"),
    (dict(budget="auto", auto_every=0), "auto_every"),
    (dict(budget=8, auto_every=4), "auto_every"),
    (dict(budget="sometimes"), "budget"),
])
def test_bad_auto_settings_name_the_field(dense, kw, field):
  target, drafter, _ = dense
  with pytest.raises(RequestError) as e:
    dj.generate(target, PROMPTS[:1], method="ddtree", drafter=drafter, max_new_tokens=4, **kw)
  assert e.value.field == field


def test_ar_steps_advance_the_drafters_context(dense):
  """Steps that verify the root alone (backing off without a draft) hold the root's features,
  and the next drafted step commits them to the drafter's cache: after a run of AR steps and
  drafted steps (and the features still held at its end committed), the cache's rows equal
  those of one prefill over the committed tokens."""
  target, drafter, ar = dense
  oracle = oracle_drafter(drafter, PROMPTS, [a[:M] for a in ar])
  kw = dict(method="ddtree", drafter=oracle, budget="auto", budgets=BUDGETS,
            budget_costs=(0.45, 1.3, 2.0, 4.0), max_new_tokens=M, stop_token_ids=(),
            cache_capacity=64)
  state, lc = engine.prefill_state(target, PROMPTS, **kw)
  state = decode.decode_loop(target.params, oracle.params, state, tcfg=target.config,
                             dcfg=oracle.config, lc=lc)
  chosen = np.asarray(state.auto.chosen[:int(state.step)])
  assert state.auto.holds and 0 in chosen and chosen.max() > 0, chosen
  resumed = np.flatnonzero((chosen[:-1] == 0) & (chosen[1:] > 0))
  assert resumed.size, chosen  # a drafted step after undrafted ones committed what they held
  state = decode._commit_held(oracle.params, oracle.config, state)  # what the end still held
  lens = np.asarray(state.cache.lens)
  np.testing.assert_array_equal(np.asarray(state.draft_cache.lens), lens)
  committed = [p + a[:n - len(p)] for p, a, n in zip(PROMPTS, ar, lens)]
  whole, _ = engine.prefill_state(target, committed, method="chain", drafter=oracle,
                                  max_new_tokens=2, stop_token_ids=(), cache_capacity=64)
  for got, want in ((state.draft_cache.k, whole.draft_cache.k),
                    (state.draft_cache.v, whole.draft_cache.v)):
    for s, n in enumerate(lens):
      np.testing.assert_allclose(np.asarray(got[:, s, :, :n]), np.asarray(want[:, s, :, :n]),
                                 rtol=1e-4, atol=1e-5)
