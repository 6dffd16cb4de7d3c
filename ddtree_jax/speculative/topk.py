"""Exact top-k and top-p over the vocabulary, shared by the tree builder, verification and the
per-row sampling (a leaf)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def vocab_top_k(logits, k: int):
  """The tree's reductions over the vocabulary: logits [..., V] -> (top-k values [..., k] and
  ids, as `top_k`, and the log normaliser logsumexp [..., 1]), in float32.
  `kernels.shard_vocab_top_k` computes the same per vocabulary shard on a mesh."""
  x = logits.astype(jnp.float32)
  vals, ids = top_k(x, k)
  return vals, ids, jax.nn.logsumexp(x, axis=-1, keepdims=True)


def top_k(x, k: int, chunk: int | None = None):
  """Exactly lax.top_k(x, k) over the last axis (same values, same indices, ties to the lower
  index), as two small top-ks instead of one over the whole row.

  The row is cut into chunks of `chunk` entries (the last padded with -inf). The k chunks with the
  largest maxima hold the top k entries (an entry outside them is beaten by k chunk maxima), so a
  top-k over the n / chunk maxima, then one over those k chunks' k * chunk entries (kept in index
  order, so ties still go to the lower index) gives the answer. XLA:GPU lowers a top-k with k > 16
  to a full sort of the row, slow over a 152K vocab (docs/findings/tree-builder.md).
  Default chunk: the power of two near sqrt(n / k), where both top-ks are smallest; plain
  lax.top_k when chunking saves nothing."""
  n = x.shape[-1]
  if chunk is None:
    chunk = 1 << max(4, round(np.log2(max(n / k, 1.0)) / 2))
  n_chunks = -(-n // chunk)
  if n_chunks <= k or k * chunk >= n:
    return jax.lax.top_k(x, k)
  lead = x.shape[:-1]
  padded = jnp.pad(x, [(0, 0)] * len(lead) + [(0, n_chunks * chunk - n)], constant_values=-jnp.inf)
  blocks = padded.reshape(lead + (n_chunks, chunk))
  _, best = jax.lax.top_k(blocks.max(axis=-1), k)  # [..., k] chunk ids, ties to the lower id
  best = jnp.sort(best, axis=-1)
  cand = jnp.take_along_axis(blocks, best[..., None], axis=-2).reshape(lead + (k * chunk,))
  vals, pos = jax.lax.top_k(cand, k)
  return vals, jnp.take_along_axis(best, pos // chunk, axis=-1) * chunk + pos % chunk


def top_p_keep(x, top_p):
  """x [..., V] float32 logits, top_p broadcastable to [..., 1] -> bool [..., V]: the smallest
  set of most likely tokens whose mass reaches top_p (the top token always stays)."""
  order = jnp.argsort(-x, axis=-1)
  probs = jax.nn.softmax(jnp.take_along_axis(x, order, axis=-1), axis=-1)
  keep_sorted = jnp.cumsum(probs, axis=-1) - probs < top_p
  return jnp.zeros_like(keep_sorted).at[
      tuple(jnp.indices(order.shape)[:-1]) + (order,)].set(keep_sorted)
