"""Tree verification: one target forward over the budget+1 nodes, then walk the accepted path.

Every node sees its sequence's committed prefix plus its ancestors and itself (the tree's
visibility), at position start + depth, so the K/V rows of an accepted path equal those of a
sequential forward and are committed as they are (no re-run).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax import kernels as kernels_lib
from ddtree_jax.models import decoder
from ddtree_jax.speculative.topk import top_k as exact_top_k, top_p_keep


def verify_tree(params, cfg, cache, tokens, depths, visibility, tap_layers=(),
                kernels: kernels_lib.Kernels = kernels_lib.REFERENCE):
  """Target forward over tree nodes.

  tokens/depths: [B, N] int32; visibility: [B, N, N] bool.
  Returns logits [B, N, V] float32, the nodes' `decoder.Pending` rows, taps [B, N, k*H] or None.
  """
  positions = cache.lens[:, None] + depths
  hidden, pending, taps = decoder.forward(params, cfg, tokens, positions, cache, visibility,
                                          tap_layers, kernels)
  return decoder.lm_head(params, hidden), pending, taps


def accept(tokens, parents, depths, visibility, post, max_depth: int):
  """Greedy (or sample-and-match) acceptance, vectorised.

  A node is matched when its token equals the target's choice `post` at its parent; it is accepted
  when it and all its ancestors are matched. The accepted path runs from the root to the deepest
  accepted node (unique: siblings carry distinct tokens).

  Args: tokens/parents/depths/post [B, N] int32 (parents[:, 0] = -1), visibility [B, N, N] bool.
  Returns: path [B, max_depth + 1] node indices by depth (entries past tau are 0), tau [B] int32
  (accepted path length, root included), emitted [B, max_depth + 1] = post along the path: the
  accepted tokens after the root followed by the next bonus.
  """
  post_at_parent = jnp.take_along_axis(post, jnp.maximum(parents, 0), axis=1)
  matched = (tokens == post_at_parent) | (parents < 0)
  accepted = ~jnp.any(visibility & ~matched[:, None, :], axis=-1)  # all ancestors matched
  last = jnp.argmax(jnp.where(accepted, depths, -1), axis=1)        # deepest accepted node
  on_path = jnp.take_along_axis(visibility, last[:, None, None], axis=1)[:, 0]  # [B, N]
  tau = jnp.sum(on_path, axis=1).astype(jnp.int32)
  levels = jnp.arange(max_depth + 1)
  at_level = on_path[:, None, :] & (depths[:, None, :] == levels[None, :, None])  # [B, D+1, N]
  path = jnp.sum(at_level * jnp.arange(tokens.shape[1])[None, None, :], axis=-1).astype(jnp.int32)
  emitted = jnp.take_along_axis(post, path, axis=1)
  return path, tau, emitted


def filter_logits(logits, temperature: float, top_k: int | None = None, top_p: float | None = None):
  """Target sampling distribution as float32 logits: / temperature, then top-k, then top-p
  (smallest set of most likely tokens whose mass reaches top_p); removed tokens get -inf."""
  logits = logits.astype(jnp.float32) / temperature
  if top_k is not None and top_k < logits.shape[-1]:
    kth = exact_top_k(logits, top_k)[0][..., -1:]  # lax.top_k's values, without a vocab sort
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
  if top_p is not None and top_p < 1.0:
    logits = jnp.where(top_p_keep(logits, top_p), logits, -jnp.inf)
  return logits


def pick(logits, temperature: float, key, top_k: int | None = None, top_p: float | None = None):
  """The target's choice per node: argmax at T = 0, else one independent sample per node from
  the filtered distribution (sample-and-match keeps every committed token a target sample)."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  filtered = filter_logits(logits, temperature, top_k, top_p)
  return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)
