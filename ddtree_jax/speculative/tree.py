"""The optimal DDTree draft tree, built on device with static shapes (docs/design.md §3).

The score of a prefix u = (u_1..u_d) is sum_i log q_i(u_i). The optimal tree with budget B is the
set of the B highest-scoring prefixes; it is prefix-closed. The published builder is a CPU heap
(pop the best prefix, push its next sibling and its first child). Here the same set (up to ties)
is built with a per-depth beam:

  * keep the top-K tokens of every depth, K = min(B, topk_cap, V);
  * beam_1 = top-K tokens of depth 1; beam_d = top-B of beam_{d-1} x top-K(depth d), where only
    (parent rank j, token rank r) pairs with (j+1)(r+1) <= B are built (any other pair is beaten
    by at least B prefixes of its depth);
  * the tree = top-B over all beams, ties broken by depth ascending (stable top-k over the beams
    laid out depth by depth), so a parent always precedes its child.

Output order is that top-B order: descending score (the heap's pop order), which is topological.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.speculative import topk

LOGQ_FLOOR = -1e30  # finite floor for log q, so real prefixes always beat the -inf beam padding


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftTree:
  """A flattened draft tree of N = budget + 1 nodes; index 0 is the root (pending bonus token).

  tokens:     [..., N] int32, tokens[..., 0] = root token (or -1).
  parents:    [..., N] int32, parents[..., 0] = -1, parents[i] < i.
  depths:     [..., N] int32, depth 0 = root; node i drafts position start + depths[i].
  scores:     [..., N] float32, sum of log q along the prefix (root 0.0).
  visibility: [..., N, N] bool, visibility[i, j] = j is an ancestor-or-self of i.
  """
  tokens: jax.Array
  parents: jax.Array
  depths: jax.Array
  scores: jax.Array
  visibility: jax.Array


def num_prefixes(depth: int, k: int, cap: int) -> int:
  """sum_{d=1..depth} k^d, saturated just above cap."""
  total, power = 0, 1
  for _ in range(depth):
    power *= k
    total += power
    if total > cap:
      break
  return total


def _pairs(budget: int, k: int) -> tuple[np.ndarray, np.ndarray]:
  """Static (parent rank j, token rank r) pairs with (j+1)(r+1) <= budget, r < k."""
  pj = [j for j in range(budget) for _ in range(min(k, budget // (j + 1)))]
  pr = [r for j in range(budget) for r in range(min(k, budget // (j + 1)))]
  return np.asarray(pj, np.int32), np.asarray(pr, np.int32)



def _build_one(top_vals, top_toks, lse, root_token, budget: int, k: int) -> DraftTree:
  """Unbatched build from `vocab_top_k`'s [L, K], [L, K], [L, 1]; root_token scalar int32."""
  depth, n = top_vals.shape[0], budget + 1
  logq = jnp.maximum(top_vals - lse, LOGQ_FLOOR)
  pad = budget - k
  # Depth-1 beam: the top-K tokens, padded to B with invalid (-inf) entries.
  score1 = jnp.pad(logq[0], (0, pad), constant_values=-jnp.inf)
  tok1 = jnp.pad(top_toks[0], (0, pad), constant_values=-1)
  par1 = jnp.zeros((budget,), jnp.int32)
  pj, pr = map(jnp.asarray, _pairs(budget, k))
  p = pj.shape[0]
  iota_p = jnp.arange(p, dtype=jnp.int32)

  # Depth by depth (unrolled): the candidates of depth d are ranked (one kernel), then one
  # multi-output reduce over the same [P, P] one-hot picks beam_d (entries of rank < B, padded to
  # P so that every reduce has one shape) and builds depth d+1's candidates straight from
  # beam_d's ranks: 2 kernels per depth, where XLA made 3 of rank, pick and gather.
  # (Unrolled because as a scan XLA copied each depth's rows and the carry every depth:
  # docs/findings/tree-builder.md.)
  # Past rank_select_max() pairs (B > ~300 on a GPU, always on a CPU) the [P, P] matrices cost
  # more than a sort: select_top.
  cand = score1[pj] + logq[1][pr] if depth > 1 else None  # [P]
  beams = [(score1, tok1, par1)]
  for d in range(1, depth):
    if p > rank_select_max():
      score, (tok, par) = select_top(cand, budget, (top_toks[d][pr], pj))
      beams.append((score, tok, par))
      if d + 1 < depth:
        cand = score[pj] + logq[d + 1][pr]
      continue
    rank = ranks(cand)
    pick = rank[None, :] == iota_p[:, None]  # [P, P]: row i picks the candidate of rank i

    def picked(x, sel=pick):
      return jnp.sum(jnp.where(sel, x[None, :], 0), axis=1, dtype=x.dtype)[:budget]

    beams.append((picked(cand), picked(top_toks[d][pr]), picked(pj)))
    if d + 1 < depth:  # candidate p's parent is beam_d's entry pj[p]: the one of rank pj[p].
      # The add sits inside the sum (one nonzero term: the same float add) so that XLA keeps it
      # in this kernel; after the sum it went into the next rank's kernel, which then wrote
      # its [P, P] compare out first (one more kernel).
      cand = jnp.sum(jnp.where(rank[None, :] == pj[:, None],
                               cand[None, :] + logq[d + 1][pr][:, None], 0.0), axis=1)
  # [L, B] each; beam_par is the parent's rank in beam_{d-1}
  beam_score, beam_tok, beam_par = (jnp.stack(x) for x in zip(*beams))

  # Global top-B; ties to the lower index of the depth-major layout, i.e. by depth ascending.
  flat_ids = jnp.arange(depth * budget, dtype=jnp.int32)
  scores, (flat,) = select_top(beam_score.reshape(-1), budget, (flat_ids,))
  node_depth = flat // budget  # 0-based, = tree depth - 1
  # Output index of every selected beam entry (0 = unselected / root), then parents by gather.
  out_index = jnp.zeros((depth * budget,), jnp.int32).at[flat].set(jnp.arange(1, n, dtype=jnp.int32))
  parent_flat = (node_depth - 1) * budget + beam_par.reshape(-1)[flat]
  node_parent = jnp.where(node_depth == 0, 0, out_index[jnp.maximum(parent_flat, 0)])

  tokens = jnp.concatenate([jnp.reshape(root_token, (1,)).astype(jnp.int32),
                            beam_tok.reshape(-1)[flat]])
  parents = jnp.concatenate([jnp.full((1,), -1, jnp.int32), node_parent.astype(jnp.int32)])
  depths = jnp.concatenate([jnp.zeros((1,), jnp.int32), (node_depth + 1).astype(jnp.int32)])
  scores = jnp.concatenate([jnp.zeros((1,), jnp.float32), scores])
  return DraftTree(tokens=tokens, parents=parents, depths=depths, scores=scores,
                   visibility=ancestor_closure(parents, depth))


# Per platform, the candidates up to which select_top compares all pairs; beyond, and on any
# platform not listed, a stable sort: XLA:CPU sorts a row faster than it fills the [P, P] matrices
# (docs/findings/tree-builder.md).
RANK_SELECT_MAX = {"gpu": 2048}


def rank_select_max() -> int:
  """select_top's rank-or-sort threshold on the default backend (0: always sort)."""
  return RANK_SELECT_MAX.get(jax.default_backend(), 0)


def select_top(x, k: int, payloads=()):
  """The k largest entries of x [P] in descending order, ties to the lower index (a stable
  top-k), and the payloads [P] (int arrays) at them: (values [k], tuple of payloads [k]).

  Up to rank_select_max() candidates by ranks instead of a sort: rank i = #{j beating i}, then
  entry r of the output is the candidate of rank r (a one-hot reduction): XLA:GPU sorts the whole
  row for a top-k with k > 16 (docs/findings/tree-builder.md)."""
  p = x.shape[-1]
  if p > rank_select_max():
    vals, idx = jax.lax.top_k(x, k, is_stable=True)
    return vals, tuple(pl[idx] for pl in payloads)
  pick = ranks(x)[None, :] == jnp.arange(k, dtype=jnp.int32)[:, None]  # [k, P], one True per row
  vals = jnp.sum(jnp.where(pick, x[None, :], 0.0), axis=1)  # exact: one term per row
  return vals, tuple(jnp.sum(jnp.where(pick, pl[None, :], 0), axis=1, dtype=pl.dtype)
                     for pl in payloads)


def ranks(x):
  """x [P] -> rank [P] int32, a permutation of 0..P-1: #{j beating i}, where j beats i if x[j] >
  x[i], or they are equal and j < i (the order of a stable descending sort)."""
  i = jnp.arange(x.shape[-1], dtype=jnp.int32)
  beats = (x[None, :] > x[:, None]) | ((x[None, :] == x[:, None]) & (i[None, :] < i[:, None]))
  return jnp.sum(beats, axis=1, dtype=jnp.int32)



def ancestor_closure(parents, depth: int):
  """parents [N] (-1 = none), tree depth <= `depth` -> [N, N] bool: [i, j] = j is an
  ancestor-or-self of i.

  Transitive closure by repeated squaring: ceil(log2(depth)) small matmuls (0/1 entries in bf16,
  counts accumulated in float32: exact). Not a chain of `depth` dependent parent gathers: XLA's
  GPU emitter fuses such a chain into one loop fusion and re-emits every gather index at each
  use, so its compile time grows ~3^depth (minutes at depth 15, found 2026-11-29)."""
  n = parents.shape[0]
  idx = jnp.arange(n, dtype=jnp.int32)
  reach = (idx[:, None] == idx[None, :]) | (parents[:, None] == idx[None, :])
  span = 1  # reach holds every ancestor at distance <= span
  while span < depth:
    r = reach.astype(jnp.bfloat16)
    reach = jnp.dot(r, r, preferred_element_type=jnp.float32) > 0.5
    span *= 2
  return reach


def build_tree(draft_logits, budget: int, topk_cap: int | None = None, root_token=None,
               vocab_top=topk.vocab_top_k) -> DraftTree:
  """Builds the optimal draft tree of `budget` non-root nodes.

  Args:
    draft_logits: [L, V] or [Bt, L, V] drafter logits; row d-1 is the distribution of depth d.
    budget: static int B >= 1, number of non-root nodes (N = B + 1).
    topk_cap: optional static cap on the tokens kept per depth (1 = greedy chain).
    root_token: None (-> -1), a scalar, or [Bt] int array placed at tokens[..., 0].
    vocab_top: `vocab_top_k` or a function of its contract (on a mesh `Kernels.vocab_top_k`).
  Returns:
    DraftTree with leading batch dims matching draft_logits[..., 0, 0].
  """
  if draft_logits.ndim not in (2, 3):
    raise ValueError(f"draft_logits must be [L, V] or [batch, L, V], got shape {draft_logits.shape}")
  budget = int(budget)
  if budget < 1:
    raise ValueError(f"budget must be >= 1, got {budget}")
  if topk_cap is not None and topk_cap < 1:
    raise ValueError(f"topk_cap must be >= 1 or None, got {topk_cap}")
  depth, vocab = draft_logits.shape[-2:]
  if depth < 1:
    raise ValueError(f"draft_logits needs at least one depth, got shape {draft_logits.shape}")
  k = min(budget, topk_cap or budget, vocab)
  if num_prefixes(depth, k, budget) < budget:
    raise ValueError(f"budget {budget} exceeds the {num_prefixes(depth, k, budget)} distinct prefixes "
                     f"of depth <= {depth} with {k} tokens per depth")
  batch = draft_logits.shape[:-2]
  root = jnp.broadcast_to(jnp.asarray(-1 if root_token is None else root_token, jnp.int32), batch)
  top = vocab_top(draft_logits, k)
  if not batch:
    return _build_one(*top, root, budget, k)
  return jax.vmap(lambda v, i, l, t: _build_one(v, i, l, t, budget, k))(*top, root)


def prefix(tree: DraftTree, n: int) -> DraftTree:
  """The first n nodes of a best-first tree (parents come first): the tree of budget n - 1."""
  return DraftTree(tokens=tree.tokens[..., :n], parents=tree.parents[..., :n],
                   depths=tree.depths[..., :n], scores=tree.scores[..., :n],
                   visibility=tree.visibility[..., :n, :n])


def chain_tree(draft_logits, root_token) -> DraftTree:
  """Plain DFlash: the root followed by the greedy draft of every depth, verified causally.

  draft_logits [Bt, L, V], root_token [Bt] -> a DraftTree of N = L + 1 nodes (equal to
  build_tree(..., budget=L, topk_cap=1) without the top-k machinery)."""
  bt, depth, _ = draft_logits.shape
  n = depth + 1
  logq = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
  drafts = jnp.argmax(logq, axis=-1).astype(jnp.int32)
  steps = jnp.take_along_axis(logq, drafts[..., None], axis=-1)[..., 0]
  idx = jnp.arange(n, dtype=jnp.int32)
  shape = lambda x: jnp.broadcast_to(x, (bt,) + x.shape)
  return DraftTree(
      tokens=jnp.concatenate([jnp.asarray(root_token, jnp.int32)[:, None], drafts], axis=1),
      parents=shape(idx - 1), depths=shape(idx),
      scores=jnp.concatenate([jnp.zeros((bt, 1)), jnp.cumsum(steps, axis=1)], axis=1),
      visibility=shape(idx[:, None] >= idx[None, :]))
