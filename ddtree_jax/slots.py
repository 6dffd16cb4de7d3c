"""Continuous batching over fixed decode slots (the JAX serving pattern): prefill a request alone
(its prompt padded to a length bucket) -> insert it into a free slot -> generate up to K steps for
all slots on device -> stream each slot's new tokens -> evict finished slots -> admit the next.

Every shape is static per (method, budget, slots, capacity, K): one prefill program per bucket,
one insert, one chunk of K steps. A free slot is a finished ("done") row, which the step skips.
Each request's settings are rows of arrays (`Settings`: max_tokens, temperature, top_k, top_p,
stop ids), so one compiled program serves every mix of requests. A request samples with its own
PRNG key (from its seed), split once per step of its own, and each row reads its own cache rows
(the experts route per row): its tokens depend on its prompt, settings and seed only, never on
its slot or on the requests beside it. Temperature-0 rows take the argmax: the greedy outputs.
The chunk marks a slot done at its max_tokens or at one of its first `max_stop_ids` stop ids
and ends early once every slot is done; the host cuts each request at all its stop ids and its
max_tokens (tokens a slot computes past its end are dropped).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import secrets
import threading
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import decode
from ddtree_jax import kernels as kernels_lib
from ddtree_jax.checkpoint import Drafter, Target
from ddtree_jax.row_sampling import Settings, pick, seed_key_data


@dataclasses.dataclass(frozen=True)
class SlotConfig:
  """The server's static shapes: method and budget, decode slots, cache rows per slot (prompt +
  generated tokens), steps per chunk K, prompt length buckets, queue length, attention; sampling
  (False: a greedy-only program that refuses temperature > 0), the largest top_k, and how many
  of a request's stop ids the chunk checks on device."""
  method: str = "ddtree"
  budget: int = 16
  slots: int = 8
  capacity: int = 1024
  chunk_steps: int = 8
  prompt_buckets: tuple[int, ...] = (64, 256, 1024)
  max_queue: int = 256
  attention: str | None = None
  sampling: bool = True
  max_top_k: int = 64
  max_stop_ids: int = 8

  def __post_init__(self):
    if self.method not in decode.METHODS:
      raise ValueError(f"SlotConfig.method must be one of {decode.METHODS}, got {self.method!r}")
    if self.method == "ddtree" and not 1 <= self.budget <= 1024:
      raise ValueError(f"SlotConfig.budget must be in [1, 1024], got {self.budget}")
    for name in ("slots", "capacity", "chunk_steps", "max_queue", "max_top_k", "max_stop_ids"):
      if getattr(self, name) < 1:
        raise ValueError(f"SlotConfig.{name} must be >= 1, got {getattr(self, name)}")
    if not self.prompt_buckets or sorted(self.prompt_buckets) != list(self.prompt_buckets):
      raise ValueError(f"SlotConfig.prompt_buckets must be increasing, got {self.prompt_buckets}")
    if self.prompt_buckets[-1] >= self.capacity:
      raise ValueError(f"SlotConfig.prompt_buckets {self.prompt_buckets} must stay below "
                       f"capacity={self.capacity}")


class RequestError(ValueError):
  """A request the engine cannot serve; `field` names the parameter at fault."""

  def __init__(self, field: str, message: str):
    super().__init__(message)
    self.field = field


class QueueFull(RuntimeError):
  """The engine's queue holds max_queue requests already."""


@dataclasses.dataclass
class Request:
  """One generation: `emit(tokens, finish_reason)` is called from the engine's thread with each
  chunk's new tokens (finish_reason None until the last call: "stop" or "length"). Sampling:
  temperature 0 = greedy, top_k 0 = off, top_p 1 = off, seed (64-bit) keys the request's draws."""
  prompt: list[int]
  max_tokens: int
  stop_ids: frozenset[int]
  emit: Callable[[list[int], str | None], None]
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  sent: int = 0                       # tokens emitted so far
  acceptance: list[int] = dataclasses.field(default_factory=list)
  cancelled: bool = False
  slot: int | None = None
  submitted: float = dataclasses.field(default_factory=time.perf_counter)

  def cancel(self):
    """Frees the request's slot at the next chunk (a client that went away)."""
    self.cancelled = True


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "lc", "capacity", "sampling",
                                             "max_top_k"))
def prefill(tparams, dparams, tokens, lens, seed, settings: Settings, *, tcfg, dcfg, lc,
            capacity: int, sampling: bool, max_top_k: int):
  """A request's prompt [1, T] -> its batch-1 DecodeState; the first token is picked with its
  settings (rows [1]) and the key of `seed` (key data [2] uint32), the state keeps the rest."""
  first = lambda logits, key: pick(logits[:, None], settings, key[None], sampling,
                                   max_top_k)[:, 0]
  return decode.prefill_with(first, tparams, dparams, tokens, lens,
                             jax.random.wrap_key_data(seed), tcfg=tcfg, dcfg=dcfg, lc=lc,
                             capacity=capacity)


@functools.partial(jax.jit, donate_argnames=("state",))
def _insert(state: decode.DecodeState, one: decode.DecodeState, slot):
  """Row 0 of the batch-1 state `one` written into row `slot` of `state` (caches, tokens, key)."""
  def put(big, small, axis):
    return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot, axis)

  def cache(big, small):
    return dataclasses.replace(big, k=put(big.k, small.k, 1), v=put(big.v, small.v, 1),
                               lens=put(big.lens, small.lens, 0))
  return dataclasses.replace(
      state, cache=cache(state.cache, one.cache),
      draft_cache=None if state.draft_cache is None else cache(state.draft_cache,
                                                               one.draft_cache),
      bonus=put(state.bonus, one.bonus, 0), out=put(state.out, one.out, 0),
      n_out=put(state.n_out, one.n_out, 0), done=put(state.done, one.done, 0),
      accepted=put(state.accepted, one.accepted, 1), key=state.key.at[slot].set(one.key))


@functools.partial(jax.jit, donate_argnames=("state",))
def _evict(state: decode.DecodeState, slot):
  return dataclasses.replace(state, done=state.done.at[slot].set(True))


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


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "lc", "steps", "sampling",
                                             "max_top_k"),
                   donate_argnames=("state",), compiler_options=decode.LOOP_COMPILER_OPTIONS)
def chunk(tparams, dparams, state, settings: Settings, *, tcfg, dcfg, lc, steps: int,
          sampling: bool = True, max_top_k: int = 64):
  """Up to `steps` steps of every slot (finished slots commit nothing), ending early once every
  slot is done. `accepted` restarts at row 0."""
  state = dataclasses.replace(state, step=jnp.zeros((), jnp.int32),
                              accepted=jnp.zeros_like(state.accepted),
                              done=state.done | (state.n_out >= settings.limit))

  def one(carry):
    i, s = carry
    return i + 1, step(tparams, tcfg, dparams, dcfg, lc, s, settings, sampling, max_top_k)
  return jax.lax.while_loop(lambda c: (c[0] < steps) & ~jnp.all(c[1].done), one,
                            (jnp.zeros((), jnp.int32), state))[1]


def loop_config(config: SlotConfig, dcfg) -> decode.LoopConfig:
  """The decode program's static settings for `config` (dcfg None for AR)."""
  attention = config.attention or ("pallas" if jax.default_backend() == "gpu" else "xla")
  return decode.LoopConfig(
      method=config.method, max_new_tokens=config.capacity,
      num_drafts=0 if dcfg is None else dcfg.num_drafts,
      budget=config.budget if config.method == "ddtree" else 0,
      kernels=kernels_lib.Kernels(attention))


class SlotEngine:
  """Serves generation requests over `config.slots` decode slots in a background thread
  (`start`). `submit` queues a request; its tokens arrive through its `emit` callback."""

  def __init__(self, target: Target, drafter: Drafter | None, config: SlotConfig):
    if config.method != "ar" and drafter is None:
      raise ValueError(f"method {config.method!r} needs a drafter")
    if target.mesh is not None:
      raise ValueError("SlotEngine serves a target on one device")
    self.target, self.config = target, config
    self.drafter = drafter if config.method != "ar" else None
    self.dcfg = None if self.drafter is None else self.drafter.config
    self.dparams = None if self.drafter is None else self.drafter.params
    self.lc = loop_config(config, self.dcfg)
    self._static = dict(tcfg=target.config, dcfg=self.dcfg, lc=self.lc,
                        sampling=config.sampling, max_top_k=config.max_top_k)
    self.queue: collections.deque[Request] = collections.deque()
    self.active: dict[int, Request] = {}
    self.lock = threading.Condition()
    self.stats = collections.Counter()
    self._thread: threading.Thread | None = None
    self._stop = False
    self.state = self._empty_state()
    self.settings = Settings.free(config.slots, config.max_stop_ids)  # host copy, per slot
    self._device_settings = None  # its device copy, None once a row changed

  # -- device programs ----------------------------------------------------------------------
  def _prefill(self, req: Request):
    bucket = next(b for b in self.config.prompt_buckets if b >= len(req.prompt))
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, :len(req.prompt)] = req.prompt
    row = Settings.free(1, self.config.max_stop_ids)
    row.set_row(0, req)
    return prefill(self.target.params, self.dparams, tokens, np.asarray([len(req.prompt)],
                   np.int32), seed_key_data(req.seed), row, capacity=self.config.capacity,
                   **self._static)

  def _empty_state(self):
    """Every slot free: a prefill of one-token prompts, marked done, a key per row."""
    b = self.config.slots
    state = decode.prefill(self.target.params, self.dparams, jnp.zeros((b, 16), jnp.int32),
                           jnp.ones((b,), jnp.int32), jax.random.key(0),
                           tcfg=self.target.config, dcfg=self.dcfg, lc=self.lc,
                           capacity=self.config.capacity)
    return dataclasses.replace(state, done=jnp.ones((b,), bool),
                               key=jax.random.split(jax.random.key(0), b))

  def warm_up(self) -> float:
    """Compiles (or loads from the persistent cache) every program: one prefill per bucket,
    insert, evict, the chunk. Returns the seconds it took."""
    t0 = time.perf_counter()
    for bucket in self.config.prompt_buckets:
      one = self._prefill(Request([0] * bucket, 1, frozenset(), lambda *_: None))
    self.state = _insert(self.state, one, 0)
    self.state = _evict(self.state, 0)
    self.state = self._run_chunk()
    jax.block_until_ready(self.state)
    return time.perf_counter() - t0

  def _run_chunk(self):
    if self._device_settings is None:
      self._device_settings = jax.tree.map(jnp.array, self.settings)  # copies
    return chunk(self.target.params, self.dparams, self.state, self._device_settings,
                 steps=self.config.chunk_steps, **self._static)

  def _set_slot(self, slot: int, req: Request | None) -> None:
    self.settings.set_row(slot, req)
    self._device_settings = None

  # -- requests ------------------------------------------------------------------------------
  def check(self, prompt: Sequence[int], max_tokens: int, temperature=0.0, top_k=0, top_p=1.0,
            seed=None) -> None:
    """Raises RequestError naming the field when the request cannot be served."""
    v = self.target.config.vocab_size
    if not prompt:
      raise RequestError("prompt", "prompt is empty")
    if any(not isinstance(t, (int, np.integer)) or not 0 <= t < v for t in prompt):
      raise RequestError("prompt", f"prompt token ids must be in [0, {v})")
    if len(prompt) > self.config.prompt_buckets[-1]:
      raise RequestError("prompt", f"prompt has {len(prompt)} tokens; this server takes at most "
                                   f"{self.config.prompt_buckets[-1]}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
      raise RequestError("max_tokens", f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if len(prompt) + max_tokens > self.config.capacity:
      raise RequestError("max_tokens", f"prompt ({len(prompt)} tokens) + max_tokens "
                                       f"({max_tokens}) exceeds the context of "
                                       f"{self.config.capacity} tokens")
    bad = lambda x, kinds: isinstance(x, bool) or not isinstance(x, kinds)
    cap = self.config.max_top_k
    for field, value, ok, want in (
        ("temperature", temperature, not bad(temperature, (int, float)) and 0 <= temperature <= 2,
         "a number in [0, 2]"),
        ("top_p", top_p, not bad(top_p, (int, float)) and 0 < top_p <= 1, "a number in (0, 1]"),
        ("top_k", top_k, not bad(top_k, int) and (-1 <= top_k <= cap or top_k >= v),
         f"-1 or 0 (off) or an integer in [1, {cap}]"),
        ("seed", seed, seed is None or not bad(seed, int) and -(1 << 63) <= seed < 1 << 64,
         "a 64-bit integer")):
      if not ok:
        raise RequestError(field, f"{field} must be {want}, got {value!r}")
    if temperature > 0 and not self.config.sampling:
      raise RequestError("temperature", "this server decodes greedily (SlotConfig.sampling="
                                        "False): temperature must be 0")

  def submit(self, prompt: Sequence[int], max_tokens: int, stop_ids: Sequence[int],
             emit: Callable[[list[int], str | None], None], *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> Request:
    """Queues a request (RequestError for a bad one, QueueFull when the queue is full). seed
    None: a random one."""
    self.check(prompt, max_tokens, temperature, top_k, top_p, seed)
    req = Request(prompt=[int(t) for t in prompt], max_tokens=max_tokens,
                  stop_ids=frozenset(stop_ids), emit=emit, temperature=float(temperature),
                  top_k=0 if top_k < 0 or top_k >= self.target.config.vocab_size else top_k,
                  top_p=float(top_p), seed=secrets.randbits(64) if seed is None else seed)
    with self.lock:
      if len(self.queue) >= self.config.max_queue:
        self.stats["rejected"] += 1
        raise QueueFull(f"the queue holds {self.config.max_queue} requests")
      self.queue.append(req)
      self.lock.notify()
    return req

  # -- the loop ------------------------------------------------------------------------------
  def start(self) -> None:
    self._stop = False
    self._thread = threading.Thread(target=self._serve, name="slot-engine", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    with self.lock:
      self._stop = True
      self.lock.notify()
    if self._thread is not None:
      self._thread.join()

  def _admit(self) -> None:
    free = [s for s in range(self.config.slots) if s not in self.active]
    while free:
      with self.lock:
        req = self.queue.popleft() if self.queue else None
      if req is None:
        return
      if req.cancelled:
        continue
      slot = free.pop(0)
      one = self._prefill(req)
      first = int(one.out[0, 0])
      self.state = _insert(self.state, one, slot)
      req.slot, req.sent = slot, 0
      self._set_slot(slot, req)
      self.active[slot] = req
      self.stats["prefilled"] += 1
      self._deliver(req, [first])

  def _deliver(self, req: Request, tokens: list[int]) -> None:
    """Sends `tokens` (cut at a stop id or max_tokens) and evicts a finished request."""
    keep, reason = [], None
    for t in tokens:
      if req.sent + len(keep) >= req.max_tokens:
        reason = "length"
        break
      keep.append(t)
      if t in req.stop_ids:
        reason = "stop"
        break
    if reason is None and req.sent + len(keep) >= req.max_tokens:
      reason = "length"
    req.sent += len(keep)
    self.stats["tokens"] += len(keep)
    if req.cancelled:
      reason = "cancelled"
    else:
      req.emit(keep, reason)
    if reason is not None:
      self.state = _evict(self.state, req.slot)
      self._set_slot(req.slot, None)
      del self.active[req.slot]
      self.stats["finished"] += 1

  def _serve(self) -> None:
    while True:
      with self.lock:
        while not self._stop and not self.queue and not self.active:
          self.lock.wait()
        if self._stop:
          return
      self._admit()
      if not self.active:
        continue
      self.state = self._run_chunk()
      out, n_out, accepted = jax.device_get((self.state.out, self.state.n_out,
                                             self.state.accepted))
      self.stats["chunks"] += 1
      for slot, req in list(self.active.items()):
        have = req.sent  # tokens sent before this chunk
        for c in (int(c) for c in accepted[:, slot] if c > 0):
          if have >= req.max_tokens:  # steps past the request's end (dropped) are not counted
            break
          req.acceptance.append(c)
          have += c
        done_before = req.sent  # tokens [sent, n_out) are new (the first came with the prefill)
        self._deliver(req, [int(t) for t in out[slot, done_before:n_out[slot]]])

  def metrics(self) -> dict:
    """Queue depth, active slots and the counters since start."""
    with self.lock:
      queued = len(self.queue)
    return dict(queue_depth=queued, active_slots=len(self.active), slots=self.config.slots,
                **self.stats)
