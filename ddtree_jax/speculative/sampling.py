"""Sampling settings per batch row, as arrays (the slot engine's, `slots.py`): one compiled
program serves every mix of greedy and sampled requests. Each row draws as `verify.pick` draws
for a batch of one, with the row's own key; rows of temperature 0 take the argmax.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.speculative.topk import top_k as exact_top_k, top_p_keep


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Settings:
  """Per-slot request settings, one row per slot: limit [B] (max_tokens; 0 = a free slot),
  temperature [B] (0 = greedy), top_k [B] (0 = off), top_p [B] (1 = off), stop [B, S] ids (-1 =
  none)."""
  limit: Any
  temperature: Any
  top_k: Any
  top_p: Any
  stop: Any

  @classmethod
  def free(cls, b: int, s: int) -> "Settings":
    """Host (numpy) settings of b free slots with room for s stop ids each."""
    return cls(np.zeros(b, np.int32), np.zeros(b, np.float32), np.zeros(b, np.int32),
               np.ones(b, np.float32), np.full((b, s), -1, np.int32))

  def set_row(self, i: int, options) -> None:
    """Row i <- a request's settings (its checked `request.GenerateOptions`; None: a free slot);
    top_k / top_p are off in greedy rows."""
    sample = options is not None and options.temperature > 0
    self.limit[i] = 0 if options is None else options.max_new_tokens
    self.temperature[i] = options.temperature if sample else 0.0
    self.top_k[i] = (options.top_k or 0) if sample else 0
    self.top_p[i] = (options.top_p or 1.0) if sample else 1.0
    stop = sorted(options.stop_token_ids)[:self.stop.shape[1]] if options is not None else []
    self.stop[i] = -1
    self.stop[i, :len(stop)] = stop


def filter_rows(x, s: Settings, max_top_k: int):
  """`verify.filter_logits` with each row's settings: x [B, N, V] float32 / temperature, then
  top-k, then top-p (each skipped when no row asks for it; a row with it off keeps every token)."""
  x = x / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None, None]
  cap = min(max_top_k, x.shape[-1])

  def top_k(x):
    vals = exact_top_k(x, cap)[0]  # [B, N, cap], descending
    kth = jnp.take_along_axis(vals, jnp.clip(s.top_k - 1, 0, cap - 1)[:, None, None], axis=-1)
    return jnp.where((s.top_k[:, None, None] <= 0) | (x >= kth), x, -jnp.inf)

  def top_p(x):
    keep = top_p_keep(x, s.top_p[:, None, None]) | (s.top_p >= 1)[:, None, None]
    return jnp.where(keep, x, -jnp.inf)
  x = jax.lax.cond(jnp.any(s.top_k > 0), top_k, lambda x: x, x)
  return jax.lax.cond(jnp.any(s.top_p < 1), top_p, lambda x: x, x)


def pick(logits, s: Settings, keys, sampling: bool = True, max_top_k: int = 64):
  """The target's choice per node, logits [B, N, V] -> [B, N] int32: the argmax in rows of
  temperature 0, else a draw from the row's filtered distribution with the row's key (keys [B]),
  drawn as `verify.pick` draws it for a batch of one. The draw runs only when a row samples."""
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if not sampling:
    return greedy

  def draw(_):
    x = filter_rows(logits.astype(jnp.float32), s, max_top_k)
    return jax.vmap(lambda k, r: jax.random.categorical(k, r, axis=-1))(keys, x).astype(jnp.int32)
  drawn = jax.lax.cond(jnp.any(s.temperature > 0), draw, lambda _: greedy, None)
  return jnp.where(s.temperature[:, None] > 0, drawn, greedy)


def seed_key_data(seed: int) -> np.ndarray:
  """A 64-bit seed -> threefry key data [2] uint32 (jax.random.key(seed)'s for 0 <= seed < 2^32)."""
  seed %= 1 << 64
  return np.asarray([seed >> 32, seed & 0xFFFFFFFF], np.uint32)
