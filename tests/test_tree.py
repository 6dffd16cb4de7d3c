"""Tests of ddtree_jax.speculative.tree against a NumPy port of the published best-first heap."""

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.speculative import tree as tree_lib
from ddtree_jax.speculative import topk
from ddtree_jax.speculative.tree import build_tree

build_jit = jax.jit(build_tree, static_argnums=(1, 2))


@pytest.fixture(autouse=True, scope="module", params=["ranks", "sort"])
def selection(request):
  """Every test runs with both ways of taking a top-B: the all-pairs ranks a GPU uses up to
  2048 candidates, and the stable sort every other platform uses (`tree.rank_select_max`).
  The threshold is read at trace time, so JAX's caches are cleared around each."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(tree_lib, "RANK_SELECT_MAX",
               {jax.default_backend(): 2048} if request.param == "ranks" else {})
    jax.clear_caches()
    yield request.param
  jax.clear_caches()


def log_softmax(logits):
  x = np.asarray(logits, np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def heap_tree(logits, budget, topk_cap=None):
  """NumPy port of github.com/liranringel/ddtree build_ddtree_tree (best-first heap).

  Returns (prefixes, scores): the token-prefix tuples of the B popped nodes and their scores.
  """
  logq = log_softmax(logits)
  depth_limit, vocab = logq.shape
  k = min(budget, topk_cap or budget, vocab)
  order = np.argsort(-logq, axis=-1, kind="stable")[:, :k]
  top_logq = np.take_along_axis(logq, order, -1)
  heap = [(-top_logq[0, 0], (0,), 1, 0)]  # (-score, ranks, depth, rank)
  prefixes, scores = [], []
  while heap and len(prefixes) < budget:
    neg, ranks, depth, rank = heapq.heappop(heap)
    prefixes.append(tuple(int(order[d, r]) for d, r in enumerate(ranks)))
    scores.append(-neg)
    if rank + 1 < k:  # next sibling: same parent, next-ranked token at this depth
      sib = ranks[:-1] + (rank + 1,)
      heapq.heappush(heap, (neg + top_logq[depth - 1, rank] - top_logq[depth - 1, rank + 1],
                            sib, depth, rank + 1))
    if depth < depth_limit:  # first child: best token at the next depth
      heapq.heappush(heap, (neg - top_logq[depth, 0], ranks + (0,), depth + 1, 0))
  return prefixes, np.asarray(scores)


def to_numpy(tree):
  return jax.tree_util.tree_map(np.asarray, tree)


def prefixes_of(tree):
  """Token-prefix tuple of every non-root node."""
  t = to_numpy(tree)
  out = [()]
  for i in range(1, len(t.tokens)):
    out.append(out[t.parents[i]] + (int(t.tokens[i]),))
  return out[1:]


def check_invariants(tree, logits, budget, root_token=-1):
  t = to_numpy(tree)
  n = budget + 1
  logq = log_softmax(logits)
  depth_limit, vocab = logq.shape
  assert t.tokens.shape == t.parents.shape == t.depths.shape == t.scores.shape == (n,)
  assert t.visibility.shape == (n, n)
  assert t.tokens.dtype == t.parents.dtype == t.depths.dtype == np.int32
  assert t.scores.dtype == np.float32 and t.visibility.dtype == np.bool_
  assert t.tokens[0] == root_token and t.parents[0] == -1 and t.depths[0] == 0 and t.scores[0] == 0
  idx = np.arange(1, n)
  par = t.parents[1:]
  assert np.all((par >= 0) & (par < idx)), "parents precede children"
  assert np.all((t.tokens[1:] >= 0) & (t.tokens[1:] < vocab))
  assert np.all(t.depths[1:] == t.depths[par] + 1)
  assert np.all(t.depths <= depth_limit)
  expect = t.scores[par] + logq[t.depths[1:] - 1, t.tokens[1:]]
  np.testing.assert_allclose(t.scores[1:], expect, rtol=1e-5, atol=1e-4)
  assert np.all(np.diff(t.scores[1:]) <= 0), "nodes come in descending score order"
  sib = set(zip(par.tolist(), t.tokens[1:].tolist()))
  assert len(sib) == budget, "siblings carry distinct tokens"
  vis = np.zeros((n, n), bool)
  for i in range(n):
    j = i
    while j >= 0:
      vis[i, j] = True
      j = t.parents[j]
  np.testing.assert_array_equal(t.visibility, vis)


# (L, V) -> budgets; every budget respects sum_d min(B, V)^d >= B. The full list of required
# budgets runs on (3, 7) and (15, 1000); (5, 300) adds a random subset of 5..200.
REQUIRED = [1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 64, 128, 200]
CASES = {
    (1, 50): [1, 2, 3, 7, 16, 50],
    (3, 7): REQUIRED + [399],
    (5, 300): [1, 4, 31, 128] + sorted(
        int(b) for b in np.random.default_rng(0).choice(np.arange(5, 200), 5, replace=False)),
    (15, 1000): REQUIRED,
}


@pytest.mark.parametrize("shape", list(CASES))
def test_matches_heap_tie_free(shape):
  rng = np.random.default_rng(shape[0] * 1000 + shape[1])
  logits = (rng.standard_normal(shape) * 3).astype(np.float32)
  for budget in CASES[shape]:
    tree = build_jit(jnp.asarray(logits), budget, None)
    check_invariants(tree, logits, budget)
    ref, ref_scores = heap_tree(logits, budget)
    got = prefixes_of(tree)
    assert set(got) == set(ref), (shape, budget)
    # Same pop order too (no ties): descending score.
    assert got == ref, (shape, budget)
    np.testing.assert_allclose(np.asarray(tree.scores[1:]), ref_scores, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape,budgets", [((4, 6), [1, 5, 13, 40, 100]),
                                           ((6, 40), [3, 16, 128]),
                                           ((15, 500), [32, 200])])
def test_objective_with_ties(shape, budgets):
  rng = np.random.default_rng(7)
  logits = np.round(rng.standard_normal(shape), 1).astype(np.float32)
  logits[:, ::3] = logits[:, :1]  # many exactly repeated values, including the max
  for budget in budgets:
    tree = build_jit(jnp.asarray(logits), budget, None)
    check_invariants(tree, logits, budget)
    _, ref_scores = heap_tree(logits, budget)
    objective = np.exp(np.asarray(tree.scores[1:], np.float64)).sum()
    assert abs(objective - np.exp(ref_scores).sum()) < 1e-6, (shape, budget)


def test_zero_logq_child_follows_parent():
  # Depth 2 puts (numerically) all mass on one token: children tie their parents' scores.
  logits = np.zeros((3, 5), np.float32)
  logits[0] = [3.0, 2.0, 1.0, 0.0, -1.0]
  logits[1, 2] = 200.0
  logits[2] = [0.0, 0.5, 0.25, 0.1, 0.3]
  for budget in [2, 3, 6]:
    tree = build_jit(jnp.asarray(logits), budget, None)
    check_invariants(tree, logits, budget)
    _, ref_scores = heap_tree(logits, budget)
    assert abs(np.exp(np.asarray(tree.scores[1:], np.float64)).sum() - np.exp(ref_scores).sum()) < 1e-6


def test_full_tree_and_bf16_input():
  logits = np.random.default_rng(3).standard_normal((2, 3)).astype(np.float32)
  tree = build_jit(jnp.asarray(logits), 12, None)  # all 3 + 9 prefixes
  check_invariants(tree, logits, 12)
  assert set(prefixes_of(tree)) == {(a,) for a in range(3)} | {(a, b) for a in range(3) for b in range(3)}
  x16 = jnp.asarray(logits, jnp.bfloat16)
  tree16 = build_jit(x16, 5, None)
  check_invariants(tree16, np.asarray(x16.astype(jnp.float32)), 5)


def test_batched_equals_rows():
  rng = np.random.default_rng(11)
  logits = rng.standard_normal((3, 5, 40)).astype(np.float32)
  roots = np.array([4, 9, 17], np.int32)
  batched = to_numpy(build_jit(jnp.asarray(logits), 24, None, jnp.asarray(roots)))
  assert batched.visibility.shape == (3, 25, 25)
  for b in range(3):
    row = to_numpy(build_jit(jnp.asarray(logits[b]), 24, None, int(roots[b])))
    check_invariants(row, logits[b], 24, root_token=roots[b])
    for name in ("tokens", "parents", "depths", "scores", "visibility"):
      np.testing.assert_array_equal(getattr(batched, name)[b], getattr(row, name))
  scalar_root = to_numpy(build_jit(jnp.asarray(logits), 24, None, 5))
  np.testing.assert_array_equal(scalar_root.tokens[:, 0], 5)
  vm = to_numpy(jax.jit(jax.vmap(lambda x: build_tree(x, 24)))(jnp.asarray(logits)))
  np.testing.assert_array_equal(vm.tokens, np.where(np.arange(25) == 0, -1, batched.tokens))


@pytest.mark.parametrize("budget", [1, 4, 6])
def test_topk1_is_greedy_chain(budget):
  logits = np.random.default_rng(5).standard_normal((6, 30)).astype(np.float32)
  tree = to_numpy(build_jit(jnp.asarray(logits), budget, 1))
  check_invariants(tree, logits, budget)
  np.testing.assert_array_equal(tree.tokens[1:], logits.argmax(-1)[:budget])
  np.testing.assert_array_equal(tree.parents, np.arange(-1, budget))
  np.testing.assert_array_equal(tree.depths, np.arange(budget + 1))
  np.testing.assert_array_equal(tree.visibility, np.tril(np.ones((budget + 1,) * 2, bool)))


def test_value_errors():
  x = jnp.zeros((4, 10))
  with pytest.raises(ValueError, match="budget"):
    build_tree(x, 0)
  with pytest.raises(ValueError, match="prefixes"):
    build_tree(x, 5, 1)  # chain of 4 depths
  with pytest.raises(ValueError, match="prefixes"):
    build_tree(jnp.zeros((2, 3)), 13)  # only 3 + 9 prefixes
  with pytest.raises(ValueError, match="draft_logits"):
    build_tree(jnp.zeros((10,)), 2)
  with pytest.raises(ValueError, match="draft_logits"):
    build_tree(jnp.zeros((1, 2, 4, 10)), 2)
  with pytest.raises(ValueError, match="topk_cap"):
    build_tree(x, 2, 0)


@pytest.mark.parametrize("budget", [256, 512])
def test_large_budget_jit(budget):
  """With ranks, B=256 ranks its 1466 pairs per depth; B=512's 3280 pairs exceed the threshold and
  take a stable top-k instead of [P, P] matrices (with sort: both). Both equal the heap's tree."""
  logits = np.random.default_rng(budget).standard_normal((15, 2000)).astype(np.float32) * 4
  tree = build_jit(jnp.asarray(logits), budget, None, jnp.int32(42))
  check_invariants(tree, logits, budget, root_token=42)
  ref, _ = heap_tree(logits, budget)
  assert prefixes_of(tree) == ref
  p = len(tree_lib._pairs(budget, budget)[0])  # pylint: disable=protected-access
  hlo = jax.jit(lambda x: build_tree(x, budget)).lower(jnp.asarray(logits)).as_text()
  assert (f"<{p}x{p}x" in hlo) == (p <= tree_lib.rank_select_max()), p


@pytest.mark.parametrize("counts", [(6, 3, 2, 5), (1, 12, 1, 12), (16, 1, 16, 2)])
def test_matches_heap_flat_heads(counts):
  # counts[d] near-equal dominant tokens at depth d: the beams fill up to the pruning bound.
  rng = np.random.default_rng(sum(counts))
  logits = rng.uniform(0, 0.05, (4, 64)).astype(np.float32)
  for d, c in enumerate(counts):
    logits[d, rng.permutation(64)[:c]] += 12.0
  for budget in [5, 18, 30, 48, 96]:
    tree = build_jit(jnp.asarray(logits), budget, None)
    check_invariants(tree, logits, budget)
    ref, _ = heap_tree(logits, budget)
    assert prefixes_of(tree) == ref, (counts, budget)


def test_gather_count_does_not_grow_with_depth():
  """The ancestor matrix is a transitive closure, not a chain of L dependent parent gathers: XLA's
  GPU emitter fuses such a chain and re-emits each index per use (compile time ~3^L, minutes at
  L=15 on the H200). The closure lowers without gathers; the beam, unrolled over the depths, adds
  the same gathers per depth (each depth's feed a reduction, not the next depth's gathers)."""
  closure = jax.jit(lambda p: tree_lib.ancestor_closure(p, 15))
  assert closure.lower(jnp.zeros((33,), jnp.int32)).as_text().count("gather") == 0
  def gathers(depth):
    f = jax.jit(lambda x: build_tree(x, 32))
    return f.lower(jnp.zeros((2, depth, 64), jnp.float32)).as_text().count("gather")
  per_depth = gathers(4) - gathers(3)
  assert 0 < per_depth and gathers(15) - gathers(3) == 12 * per_depth


@pytest.mark.parametrize("n,k,chunk", [(5000, 32, None), (5000, 7, 16), (4096, 64, 8), (1000, 3, 64),
                                       (151, 5, 4), (300, 1, 16), (64, 32, None)])
def test_chunked_top_k_equals_lax_top_k(n, k, chunk):
  """Same values and indices as lax.top_k, ties included (to the lower index), any batch dims."""
  rng = np.random.default_rng(n + k)
  x = rng.standard_normal((2, 3, n)).astype(np.float32)
  x[0] = np.round(x[0] * 2) / 2  # heavy ties
  x[1, 0, : n // 2] = -np.inf  # -inf entries next to the -inf padding
  x[1, 1] = 0.0  # a constant row: the answer is the k lowest indices
  vals, idx = topk.top_k(jnp.asarray(x), k, chunk)
  ref_vals, ref_idx = jax.lax.top_k(jnp.asarray(x), k)
  np.testing.assert_array_equal(np.asarray(vals), np.asarray(ref_vals))
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))


@pytest.mark.parametrize("p,k", [(1, 1), (7, 7), (130, 32), (280, 64), (3000, 64)])
def test_select_top_equals_stable_top_k(p, k):
  """Ranks (P <= the threshold) or the sort (3000, or any P with sort): lax.top_k(is_stable=True)'s
  values and order, ties and -inf beam padding included, with the payloads carried along."""
  rng = np.random.default_rng(p + k)
  x = np.round(rng.standard_normal(p) * 2) / 2  # heavy ties
  x[rng.permutation(p)[: p // 3]] = -np.inf
  x = jnp.asarray(x, jnp.float32)
  payload = jnp.asarray(rng.integers(-5, 1000, p), jnp.int32)
  vals, (got,) = jax.jit(tree_lib.select_top, static_argnums=1)(x, k, (payload,))
  ref_vals, ref_idx = jax.lax.top_k(x, k, is_stable=True)
  np.testing.assert_array_equal(np.asarray(vals), np.asarray(ref_vals))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(payload)[np.asarray(ref_idx)])
