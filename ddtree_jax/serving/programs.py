"""The slot engine's device programs (`slots.py`): a request's prefill, its insertion into a slot,
and a chunk of decode steps for every slot, which hands back only each slot's new tokens.

Every shape is static per (method, budget, slots, capacity, max_steps): one prefill program per
prompt bucket, one insert, one chunk. The chunk's step counts are traced arguments, so a chunk of
any length up to max_steps runs the same compiled program.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.speculative import decode
from ddtree_jax.speculative.sampling import Settings, pick


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "lc", "capacity", "sampling",
                                             "max_top_k"))
def prefill(tparams, dparams, tokens, lens, seed, settings: Settings, *, tcfg, dcfg, lc,
            capacity: int, sampling: bool, max_top_k: int):
  """A request's prompt [1, T] -> its batch-1 DecodeState; the first token (state.bonus [1]) is
  picked with its settings (rows [1]) and the key of `seed` (key data [2] uint32)."""
  first = lambda logits, key: pick(logits[:, None], settings, key[None], sampling,
                                   max_top_k)[:, 0]
  return decode.prefill_with(first, tparams, dparams, tokens, lens,
                             jax.random.wrap_key_data(seed), tcfg=tcfg, dcfg=dcfg, lc=lc,
                             capacity=capacity)


@functools.partial(jax.jit, donate_argnames=("state",))
def insert(state: decode.DecodeState, one: decode.DecodeState, slot):
  """Row 0 of the batch-1 state `one` written into row `slot` of `state` (caches, tokens, key)."""
  def put(big, small, axis):
    return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot, axis)

  def cache(big, small):
    rec = lambda b, s: None if b is None else put(b, s, 1)  # (Gated DeltaNet state, window)
    return dataclasses.replace(big, k=put(big.k, small.k, 1), v=put(big.v, small.v, 1),
                               lens=put(big.lens, small.lens, 0),
                               state=rec(big.state, small.state), window=rec(big.window, small.window))
  auto = state.auto
  if auto is not None:  # the row's ratio starts afresh; the choices stay the batch's
    auto = dataclasses.replace(auto, expected=put(auto.expected, one.auto.expected, 0),
                               accepted=put(auto.accepted, one.auto.accepted, 0),
                               predicted=put(auto.predicted, one.auto.predicted, 1),
                               held=put(auto.held, one.auto.held, 0))  # the old row's: dropped
  return dataclasses.replace(
      state, cache=cache(state.cache, one.cache), auto=auto,
      draft_cache=None if state.draft_cache is None else cache(state.draft_cache,
                                                               one.draft_cache),
      bonus=put(state.bonus, one.bonus, 0), out=put(state.out, one.out, 0),
      n_out=put(state.n_out, one.n_out, 0), done=put(state.done, one.done, 0),
      accepted=put(state.accepted, one.accepted, 1), key=state.key.at[slot].set(one.key))


def step(tparams, tcfg, dparams, dcfg, lc, state, settings: Settings, sampling: bool = True,
         max_top_k: int = 64):
  """`decode.step` with each row's settings and key (state.key [B]); a row is done once it has
  emitted settings.limit tokens or one of its stop ids."""
  s = decode.step(tparams, tcfg, dparams, dcfg, lc, state,
                  pick=lambda logits, keys: pick(logits, settings, keys, sampling, max_top_k))
  at = state.n_out[:, None] + jnp.arange(lc.num_drafts + 1)  # where this step's tokens went
  toks = jnp.take_along_axis(s.out, jnp.minimum(at, s.out.shape[1] - 1), axis=1)
  is_stop = (toks[..., None] == settings.stop[:, None, :]).any(-1) & (at < s.n_out[:, None])
  return dataclasses.replace(s, done=s.done | is_stop.any(-1) | (s.n_out >= settings.limit))


def window(lc: decode.LoopConfig, max_steps: int) -> int:
  """Tokens a slot can emit in a chunk of max_steps steps: the chunk's copy-back width."""
  return min(max_steps * (lc.num_drafts + 1), lc.max_new_tokens)


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "lc", "max_steps", "sampling",
                                             "max_top_k"),
                   donate_argnames=("state",), compiler_options=decode.LOOP_COMPILER_OPTIONS)
def chunk(tparams, dparams, state, settings: Settings, steps, *, tcfg, dcfg, lc, max_steps: int,
          sampling: bool = True, max_top_k: int = 64):
  """Up to `steps` (traced, clipped to max_steps) steps of every slot, ending early once every
  slot is done; finished slots commit nothing. Returns (state, new [B, 3 + 2 max_steps + window]
  int32), each row in `Chunk`'s layout: the slot's tokens emitted before and after the chunk,
  the steps run, the tokens each step committed, the budget each step chose (budget="auto"; else
  0), then its new tokens."""
  start = state.n_out
  state = dataclasses.replace(state, step=jnp.zeros((), jnp.int32),
                              accepted=jnp.zeros_like(state.accepted),
                              done=state.done | (state.n_out >= settings.limit))
  steps = jnp.minimum(steps, max_steps)

  def one(carry):
    i, s = carry
    return i + 1, step(tparams, tcfg, dparams, dcfg, lc, s, settings, sampling, max_top_k)
  ran, state = jax.lax.while_loop(lambda c: (c[0] < steps) & ~jnp.all(c[1].done), one,
                                  (jnp.zeros((), jnp.int32), state))
  at = jnp.minimum(start[:, None] + jnp.arange(window(lc, max_steps)), state.out.shape[1] - 1)
  b = start.shape[0]
  chosen = (jnp.zeros((max_steps,), jnp.int32) if state.auto is None
            else state.auto.chosen[:max_steps])
  new = jnp.concatenate([start[:, None], state.n_out[:, None], jnp.full((b, 1), ran),
                         state.accepted[:max_steps].T, jnp.broadcast_to(chosen, (b, max_steps)),
                         jnp.take_along_axis(state.out, at, axis=1)], axis=1)
  return state, new.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Chunk:
  """One slot's row of a chunk's `new` (host ints): tokens emitted before (`start`) and after
  (`end`) the chunk, the steps it ran, the tokens each step committed (`accepted`), the tokens
  start..end (`tokens`) and the budget each step chose (`chosen`, budget="auto")."""
  start: int
  end: int
  steps: int
  accepted: list[int]
  tokens: list[int]
  chosen: list[int] = dataclasses.field(default_factory=list)

  @classmethod
  def of(cls, row: np.ndarray, max_steps: int) -> "Chunk":
    start, end, steps = (int(x) for x in row[:3])
    first = 3 + 2 * max_steps
    return cls(start, end, steps, row[3:3 + steps].tolist(),
               row[first:first + end - start].tolist(),
               row[3 + max_steps:3 + max_steps + steps].tolist())

  def acceptance(self, sent: int, max_tokens: int) -> list[int]:
    """The tokens each step of the chunk committed for a request that had sent `sent` of its
    max_tokens, up to its end (steps past it, whose tokens are dropped, are not counted)."""
    counts = []
    for c in self.accepted:
      if c > 0 and sent >= max_tokens:
        break
      if c > 0:
        counts.append(c)
        sent += c
    return counts

