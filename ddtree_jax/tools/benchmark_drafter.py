"""A benchmark drafter of set acceptance, and a random target whose greedy path it knows.

Random weights accept nothing, so the speed of speculation at a real model's shape cannot be
measured with them. `planted_target` gives a random target a greedy path with a wide margin: the
embedding rows scaled up, so that the last hidden state is mostly its token's embedding, and
lm_head's columns the embeddings of a random permutation, so that after x the target picks
perm(x) by a margin bf16 rounding does not close (with random bf16 weights the top two logits
are nearly tied, and a tree's verify and an AR step would part within a position or two:
docs/findings/benchmark-matrix-and-bf16-divergences.md). Its layers still compute on random
weights; a step costs what it did (a MoE's routing stays random per token).

The benchmark drafter runs a real drafter (its block forward and its context rows, so each step
costs what a draft costs) and then replaces its logits with a calibrated guess at that path:

  the true token after bonus x at draft position k is perm^k(x); it sits at rank
  r ~ Geometric(accept) among the RANKS candidates (nowhere when r >= RANKS); the drafter gives
  the candidate at rank k the probability confidence (1 - confidence)^k (confidence = accept:
  a calibrated draft).

A chain is accepted position by position with probability `accept`; a tree's siblings catch the
true token at ranks 1.. . The draws hash (row, position, seed), so every method and budget meets
the same draws at the same positions, and it needs nothing per request: a slot server runs it as
it runs any drafter. Runs with it measure speed at a chosen acceptance, never a drafter's
quality, and say so (`experiments/perf/bench_auto.py`, `experiments/perf/bench_serve_auto.py`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ddtree_jax import kernels as kernels_lib
from ddtree_jax.models.drafter import DrafterConfig

RANKS = 8          # candidates per position that carry the draft's probability
_TIE_BREAK = 1e-3  # the real draft's share of the other logits: it stays computed, ties broken


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BenchmarkDrafterParams:
  drafter: object          # the real drafter's params (DrafterParams)
  successor: jax.Array     # [V] int32: the token the target picks after each token
  accept: jax.Array        # [] float32: P(the true token is a position's first candidate)
  confidence: jax.Array    # [] float32: the first candidate's probability under the draft

  def partition_specs(self, axes) -> BenchmarkDrafterParams:
    return BenchmarkDrafterParams(drafter=self.drafter.partition_specs(axes), successor=P(),
                                  accept=P(), confidence=P())


def true_rank(xp, positions, rows, accept, seed: int):
  """The true token's rank at each drafted position (xp: jnp or np; positions / rows broadcast
  to [B, L]): Geometric(accept) from a uint32 hash of (row, position, seed), RANKS for nowhere."""
  u32 = lambda x: xp.asarray(x).astype(xp.uint32)
  c = lambda n: xp.asarray(n, dtype=xp.uint32)
  h = u32(positions) * c(2654435761) + u32(rows) * c(40503) + c(seed * 7919 + 1)
  h = (h ^ (h >> 15)) * c(2246822519)
  u = ((h >> 8).astype(xp.float32) + 1.0) / float(1 << 24)           # (0, 1]
  a = xp.asarray(accept, dtype=xp.float32)
  safe = xp.clip(a, 1e-6, 1 - 1e-6)
  rank = xp.floor(xp.log(u) / xp.log1p(-safe))
  rank = xp.where(a <= 0, RANKS, xp.where(a >= 1, 0, xp.minimum(rank, RANKS)))
  return rank.astype(xp.int32)


@dataclasses.dataclass(frozen=True)
class BenchmarkDrafterConfig(DrafterConfig):
  """A DrafterConfig whose drafts follow `BenchmarkDrafterParams.successor` at a set rate."""
  seed: int = 0

  def draft(self, params, target_params, cache, bonus,
            kernels: kernels_lib.Kernels = kernels_lib.REFERENCE):
    real = super().draft(params.drafter, target_params, cache, bonus, kernels)   # [B, L, V]
    b, l, v = real.shape
    if params.successor.shape != (v,):
      raise ValueError(f"benchmark drafter: successor covers {params.successor.shape[0]} tokens, "
                       f"the target's vocabulary {v}")
    pos = cache.lens[:, None] + jnp.arange(1, l + 1, dtype=jnp.int32)[None]      # [B, L]
    path = [bonus.astype(jnp.int32)]
    for _ in range(l):
      path.append(params.successor[path[-1]])
    y = jnp.stack(path[1:], axis=1)                                                # [B, L]
    rank = true_rank(jnp, pos, jnp.arange(b)[:, None], params.accept, self.seed)
    k = jnp.arange(RANKS, dtype=jnp.int32)
    offset = jnp.where(k == rank[..., None], 0, k + (k < rank[..., None]))        # distinct
    candidates = (y[..., None] + offset) % v                                      # [B, L, K]
    c = jnp.clip(params.confidence, 1e-4, 1 - 1e-4)
    logp = jnp.log(c) + k.astype(jnp.float32) * jnp.log1p(-c)
    # the other tokens share what is left, each kept below every candidate (at a low
    # confidence over a small vocabulary an even share would outrank them)
    rest = jnp.minimum(RANKS * jnp.log1p(-c) - math.log(v - RANKS), logp[-1] - 1.0)
    base = rest + _TIE_BREAK * jnp.tanh(real)
    rows = jnp.arange(b)[:, None, None]
    cols = jnp.arange(l)[None, :, None]
    return base.at[rows, cols, candidates].set(jnp.broadcast_to(logp, candidates.shape))

  def context(self, params, taps, positions):
    return super().context(params.drafter, taps, positions)

  def vocab(self, params):
    return None  # the drafts cover the whole vocabulary


def benchmark_drafter(drafter, successor, accept: float, confidence: float | None = None,
                      seed: int = 0):
  """A Drafter (dflash.Drafter-like) whose drafts follow the target's greedy path, the token
  successor[x] after each token x (`planted_successor` of a `planted_target`), at rate `accept`,
  claiming `confidence` (default: accept; e.g. accept 0 with confidence 0.5 is a drafter that is
  never right and does not know it)."""
  if not 0.0 <= accept <= 1.0:
    raise ValueError(f"benchmark_drafter: accept must be in [0, 1], got {accept}")
  confidence = accept if confidence is None else confidence
  if not 0.0 <= confidence <= 1.0:
    raise ValueError(f"benchmark_drafter: confidence must be in [0, 1], got {confidence}")
  successor = np.asarray(successor)
  if successor.ndim != 1 or not np.issubdtype(successor.dtype, np.integer) or \
      successor.min(initial=0) < 0 or successor.max(initial=0) >= successor.shape[0]:
    raise ValueError("benchmark_drafter: successor must be one token id in [0, V) per token of "
                     f"a vocabulary of V tokens, got {successor.dtype} of shape {successor.shape}")
  if drafter.config.vocab(drafter.params) is not None:
    raise ValueError("benchmark_drafter: the drafter drafts over a restricted vocabulary; the "
                     "benchmark drafter drafts over the whole one (load it without draft_vocab)")
  cfg = BenchmarkDrafterConfig(**{f.name: getattr(drafter.config, f.name)
                                  for f in dataclasses.fields(DrafterConfig)}, seed=seed)
  params = BenchmarkDrafterParams(drafter=drafter.params,
                                  successor=jnp.asarray(successor, jnp.int32),
                                  accept=jnp.float32(accept), confidence=jnp.float32(confidence))
  return dataclasses.replace(drafter, params=params, config=cfg,
                             path=f"benchmark:accept={accept:g}")


def planted_successor(vocab: int, seed: int = 0) -> np.ndarray:
  """[vocab] int: perm, the greedy successor of each token that `planted_target(seed)` plants."""
  return np.random.default_rng(seed).permutation(vocab)


def planted_target(target, seed: int = 0, scale: float = 1024.0):
  """`target` (a Target of random weights, lm_head untied) with a planted greedy path: embed's
  rows times `scale` and lm_head[:, perm(x)] = embed[x] for a random permutation perm, so the
  target's next token after x is perm(x) = planted_successor(V, seed)[x] by a margin bf16
  rounding does not close."""
  params = target.params
  if params.lm_head is None:
    raise ValueError("planted_target: the target ties lm_head to its embedding; it needs its own")
  v = params.vocab
  perm = planted_successor(v, seed)
  inverse = np.argsort(perm)                  # inverse[y] = x with perm(x) = y
  embed = params.embed
  head = embed[jnp.asarray(inverse)].T.astype(params.lm_head.dtype)    # [H, V]
  pad = params.lm_head.shape[1] - v
  if pad:
    head = jnp.pad(head, ((0, 0), (0, pad)))
  head = jax.device_put(head, params.lm_head.sharding)
  scaled = jax.device_put((embed.astype(jnp.float32) * scale).astype(embed.dtype), embed.sharding)
  return dataclasses.replace(target, params=dataclasses.replace(params, embed=scaled,
                                                                lm_head=head))
