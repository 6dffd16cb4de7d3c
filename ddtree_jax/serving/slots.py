"""Continuous batching over fixed decode slots (the JAX serving pattern): prefill a request alone
(its prompt padded to a length bucket) -> insert it into a free slot -> generate up to K steps for
all slots on device -> stream each slot's new tokens -> free finished slots -> admit the next.

The device programs are in `programs.py`: one prefill per bucket, one insert, one chunk,
whatever the request mix. A free slot is a finished ("done") row, which the step skips. A request
is a prompt and its `request.GenerateOptions` (the per-request fields, `request.SLOT_FIELDS`,
checked by `GenerateOptions.check` against this server's limits); its settings are rows of arrays
(`Settings`: max_new_tokens, temperature, top_k, top_p, stop ids). A request samples with its own
PRNG key (from its seed), split once per step of its own, and each row reads its own cache rows
(the experts route per row): its tokens depend on its prompt, settings and seed only, never on its
slot, the chunk lengths or the requests beside it. Temperature-0 rows take the argmax: the greedy
outputs. The chunk marks a slot done at its max_new_tokens or one of its first `max_stop_ids` stop
ids; the host cuts each request at all its stop ids and its max_new_tokens (tokens a slot computes
past its end are dropped).

Chunk length by load: while a streaming request decodes, a chunk runs `stream_steps` steps (1:
each step's tokens are sent as the step commits them; a chunk's tokens reach the host only when
it ends). Else, while requests come one at a time (`_alone`), a chunk runs up to
`max_chunk_steps` steps (it ends when the request does); with `pipeline` the next one is then
dispatched before the host reads the last one's tokens (off by default: on a GPU a chunk's
dispatch returns when its while loop ends, so nothing overlaps and the last chunk's tokens wait
a chunk). Any other mix runs chunks of `chunk_steps`, each read before the next admission, as a
longer or pipelined chunk would keep finished slots idle while waiting requests wait longer;
after a chunk that ended requests, while slots are free, the engine waits up to `refill_wait` of
its time for new ones (clients that send the next request on an answer). A chunk's tokens go
only to the requests that held its slots when it was dispatched and still do.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import engine
from ddtree_jax.speculative import decode
from ddtree_jax.serving import programs
from ddtree_jax.checkpoints.dflash import Drafter
from ddtree_jax.checkpoints.hf import Target
from ddtree_jax.request import (DEFAULT_BUDGETS, MAX_BUDGET, GenerateOptions, ServedLimits,
                                auto_options)
from ddtree_jax.speculative.sampling import Settings, seed_key_data


@dataclasses.dataclass(frozen=True)
class SlotConfig:
  """The server's static shapes and its scheduling: method and budget, decode slots, cache rows
  per slot (prompt + generated tokens), prompt length buckets, queue length, attention; steps
  per chunk (stream_steps while a streaming request decodes, else up to max_chunk_steps for a
  request alone, else chunk_steps), pipeline (for a request
  alone, dispatch the next chunk before reading the last), refill_wait (after a chunk that ended
  requests, while slots are free and none wait, wait up to this fraction of its time for new
  ones); sampling (False: a greedy-only program that refuses temperature > 0), the largest top_k,
  and how many of a request's stop ids the chunk checks on device. budget="auto": every step
  chooses among `budgets` (0: AR) for the rows decoding then (`speculative/auto.py`), with
  `budget_costs` the seconds per step of each (None: measured at start on a batch of `slots`)."""
  method: str = "ddtree"
  budget: int | str = 16
  budgets: tuple[int, ...] = DEFAULT_BUDGETS
  budget_costs: tuple[float, ...] | None = None
  slots: int = 8
  capacity: int = 1024
  chunk_steps: int = 8
  max_chunk_steps: int = 32
  stream_steps: int = 1
  pipeline: bool = False
  refill_wait: float = 0.1
  prompt_buckets: tuple[int, ...] = (16, 64, 256)
  max_queue: int = 256
  attention: str | None = None
  sampling: bool = True
  max_top_k: int = 64
  max_stop_ids: int = 8

  def __post_init__(self):
    if self.method not in decode.METHODS:
      raise ValueError(f"SlotConfig.method must be one of {decode.METHODS}, got {self.method!r}")
    if self.method == "ddtree" and self.budget == "auto":
      budgets, costs = auto_options(self.budgets, self.budget_costs)  # RequestError: a ValueError
      object.__setattr__(self, "budgets", budgets)
      object.__setattr__(self, "budget_costs", costs)
    elif self.method == "ddtree" and (isinstance(self.budget, (bool, str))
                                      or not 1 <= self.budget <= MAX_BUDGET):
      raise ValueError(f"SlotConfig.budget must be in [1, {MAX_BUDGET}] or 'auto', got "
                       f"{self.budget!r}")
    for name in ("slots", "capacity", "chunk_steps", "max_chunk_steps", "stream_steps",
                 "max_queue", "max_top_k", "max_stop_ids"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"SlotConfig.{name} must be an integer >= 1, got {value!r}")
    if not self.chunk_steps <= self.max_chunk_steps <= self.capacity:
      raise ValueError(f"SlotConfig.max_chunk_steps must be in [chunk_steps, capacity] = "
                       f"[{self.chunk_steps}, {self.capacity}], got {self.max_chunk_steps}")
    if self.stream_steps > self.max_chunk_steps:
      raise ValueError(f"SlotConfig.stream_steps must be in [1, max_chunk_steps] = "
                       f"[1, {self.max_chunk_steps}], got {self.stream_steps}")
    if isinstance(self.refill_wait, bool) or not isinstance(self.refill_wait, (int, float)) \
        or not 0 <= self.refill_wait <= 1:
      raise ValueError(f"SlotConfig.refill_wait must be a number in [0, 1], got "
                       f"{self.refill_wait!r}")
    for name in ("pipeline", "sampling"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"SlotConfig.{name} must be True or False, got {getattr(self, name)!r}")
    if not self.prompt_buckets or sorted(self.prompt_buckets) != list(self.prompt_buckets):
      raise ValueError(f"SlotConfig.prompt_buckets must be increasing, got {self.prompt_buckets}")
    if self.prompt_buckets[-1] >= self.capacity:
      raise ValueError(f"SlotConfig.prompt_buckets {self.prompt_buckets} must stay below "
                       f"capacity={self.capacity}")

  @property
  def options(self) -> GenerateOptions:
    """The options every slot decodes with (its program's `LoopConfig`): the method, budget and
    attention, up to `capacity` tokens; sampling and stop ids are each request's (`Settings`)."""
    auto = self.method == "ddtree" and self.budget == "auto"
    return GenerateOptions(method=self.method,
                           budget=self.budget if self.method == "ddtree" else None,
                           max_new_tokens=self.capacity, attention=self.attention,
                           stop_token_ids=(), **(dict(budgets=self.budgets) if auto else {}))

  def limits(self) -> ServedLimits:
    """What this server takes of a request (`GenerateOptions.check`'s `server`)."""
    return ServedLimits(self.capacity, self.prompt_buckets[-1], self.max_top_k, self.sampling)


class QueueFull(RuntimeError):
  """The engine's queue holds max_queue requests already."""


@dataclasses.dataclass
class SlotRequest:
  """A queued or decoding request of the slot engine: its prompt and checked options;
  `emit(tokens, finish_reason)` is called from the engine's thread with each chunk's new tokens
  (finish_reason None until the last call: "stop" or "length"); `stream`: its client reads the
  tokens as they come (the chunks run `stream_steps` while it decodes)."""
  prompt: tuple[int, ...]
  options: GenerateOptions
  emit: Callable[[list[int], str | None], None]
  stream: bool = False
  sent: int = 0                       # tokens emitted so far
  acceptance: list[int] = dataclasses.field(default_factory=list)
  cancelled: bool = False
  slot: int | None = None

  def cancel(self):
    """Frees the request's slot at the next chunk (a client that went away)."""
    self.cancelled = True


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
    self.lc = config.options.loop_config(self.dcfg)
    self._static = dict(tcfg=target.config, dcfg=self.dcfg, lc=self.lc,
                        sampling=config.sampling, max_top_k=config.max_top_k)
    self.queue: collections.deque[SlotRequest] = collections.deque()
    self.active: dict[int, SlotRequest] = {}
    self.lock = threading.Condition()
    self.stats = collections.Counter()
    self._thread: threading.Thread | None = None
    self._stop = False
    self.costs = self._costs()
    self.state = self._empty_state()
    self.settings = Settings.free(config.slots, config.max_stop_ids)  # host copy, per slot
    self._device_settings = None  # its device copy, None once a row changed
    self._steps = {n: jax.device_put(np.int32(n))  # the chunk's step counts, on device once
                   for n in (config.chunk_steps, config.max_chunk_steps, config.stream_steps)}
    self._company = collections.deque(maxlen=4)  # requests in the engine at the last admissions

  # -- device programs ----------------------------------------------------------------------
  def _prefill(self, prompt: Sequence[int], options: GenerateOptions):
    bucket = next(b for b in self.config.prompt_buckets if b >= len(prompt))
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, :len(prompt)] = prompt
    row = Settings.free(1, self.config.max_stop_ids)
    row.set_row(0, options)
    return programs.prefill(self.target.params, self.dparams, tokens,
                            np.asarray([len(prompt)], np.int32), seed_key_data(options.seed),
                            row, capacity=self.config.capacity, **self._static)

  def _costs(self):
    """budget="auto"'s seconds per step: the config's, or measured with `generate`'s loop on a
    batch of `slots` and this server's cache rows (None for a fixed budget)."""
    cfg = self.config
    if not self.lc.budgets or cfg.budget_costs is not None:
      return cfg.budget_costs
    n = max(1, min(16, (cfg.capacity + 1) // 2))  # prompt and new tokens within capacity
    costs = engine.budget_costs(
        self.target, [[0] * n] * cfg.slots, drafter=self.drafter, budgets=cfg.budgets,
        max_new_tokens=n, cache_capacity=cfg.capacity, attention=cfg.attention,
        stop_token_ids=())
    return tuple(costs[b] for b in cfg.budgets)

  def _empty_state(self):
    """Every slot free: a prefill of one-token prompts, marked done, a key per row."""
    b = self.config.slots
    state = decode.prefill(self.target.params, self.dparams, jnp.zeros((b, 16), jnp.int32),
                           jnp.ones((b,), jnp.int32), jax.random.key(0),
                           None if self.costs is None else jnp.asarray(self.costs, jnp.float32),
                           tcfg=self.target.config, dcfg=self.dcfg, lc=self.lc,
                           capacity=self.config.capacity)
    return dataclasses.replace(state, done=jnp.ones((b,), bool),
                               key=jax.random.split(jax.random.key(0), b))

  def warm_up(self) -> float:
    """Compiles (or loads from the persistent cache) every program: one prefill per bucket,
    insert, the chunk. Returns the seconds it took."""
    t0 = time.perf_counter()
    for bucket in self.config.prompt_buckets:
      one = self._prefill([0] * bucket, GenerateOptions(max_new_tokens=1, stop_token_ids=()))
    self.state = programs.insert(self.state, one, 0)  # (slot 0 stays free: its limit is 0)
    jax.block_until_ready(self._launch()[0])
    self.stats.clear()
    return time.perf_counter() - t0

  def _alone(self) -> bool:
    """Requests come one at a time: one active, none queued, and each of the last 4 admissions
    found the engine empty (after a burst, the next lone requests run short chunks a while)."""
    return len(self.active) <= 1 and not self.queue and max(self._company, default=1) <= 1

  def _launch(self):
    """Dispatches the next chunk: stream_steps while a request streams, else up to
    max_chunk_steps for a request alone, else chunk_steps.
    Returns (its new tokens [slots, ...] on device, {slot: request} as it was dispatched, the
    time it was dispatched)."""
    if self._device_settings is None:
      self._device_settings = jax.tree.map(jnp.array, self.settings)  # copies
    cfg, alone = self.config, self._alone()
    streams = any(r.stream for r in self.active.values())
    t0 = time.perf_counter()
    self.state, new = programs.chunk(
        self.target.params, self.dparams, self.state, self._device_settings,
        self._steps[cfg.stream_steps if streams else cfg.max_chunk_steps if alone
                    else cfg.chunk_steps],
        max_steps=cfg.max_chunk_steps, **self._static)
    new.copy_to_host_async()
    self.stats["chunks"] += 1
    self.stats["alone_chunks"] += alone
    self.stats["stream_chunks"] += streams
    self.stats["launch_s"] += time.perf_counter() - t0
    return new, dict(self.active), t0

  def _set_slot(self, slot: int, options: GenerateOptions | None) -> None:
    self.settings.set_row(slot, options)
    self._device_settings = None

  # -- requests ------------------------------------------------------------------------------
  def submit(self, prompt: Sequence[int], options: GenerateOptions,
             emit: Callable[[list[int], str | None], None],
             stream: bool = False) -> SlotRequest:
    """Queues a request (`stream`: see SlotRequest): RequestError for one this server cannot
    serve (`GenerateOptions.check` with its limits: only the per-request fields set), QueueFull
    when the queue is full."""
    prompts, options = options.check(self.target, self.drafter, [prompt],
                                      server=self.config.limits())
    req = SlotRequest(prompt=prompts[0], options=options, emit=emit, stream=stream)
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

  def _admit(self) -> list:
    """Prefills queued requests into free slots (dispatched, not awaited); returns [(request,
    its first token [1] on device)]."""
    free = [s for s in range(self.config.slots) if s not in self.active]
    firsts = []
    while free:
      with self.lock:
        req = self.queue.popleft() if self.queue else None
      if req is None:
        break
      if req.cancelled:
        continue
      slot = free.pop(0)
      one = self._prefill(req.prompt, req.options)
      one.bonus.copy_to_host_async()
      self.state = programs.insert(self.state, one, slot)
      req.slot, req.sent = slot, 0
      self._set_slot(slot, req.options)
      self.active[slot] = req
      self._company.append(len(self.active) + len(self.queue))
      self.stats["prefilled"] += 1
      firsts.append((req, one.bonus))
    return firsts

  def _send_firsts(self, firsts) -> None:
    for req, first in firsts:
      self._deliver(req, [int(self._wait(first)[0])])

  def _wait(self, x) -> np.ndarray:
    t0 = time.perf_counter()
    x = np.asarray(x)
    self.stats["wait_s"] += time.perf_counter() - t0
    return x

  def _finish(self, launched) -> tuple[float, int]:
    """Streams a chunk's new tokens to the requests that held its slots and still do. Returns
    (seconds from its dispatch to its tokens, the requests it ended)."""
    new, holders, dispatched = launched
    rows = self._wait(new)
    t0 = time.perf_counter()
    finished = self.stats["finished"]
    self.stats["steps"] += int(rows[0, 2])
    if self.lc.budgets:  # budget="auto": the steps of each budget (every row holds them)
      self.stats.update(f"steps_budget_{b}"
                        for b in programs.Chunk.of(rows[0], self.config.max_chunk_steps).chosen)
    for slot, req in holders.items():
      if self.active.get(slot) is not req:  # finished or cancelled since: its tokens are dropped
        continue
      got = programs.Chunk.of(rows[slot], self.config.max_chunk_steps)
      req.acceptance += got.acceptance(req.sent, req.options.max_new_tokens)
      # (sent == start: a request's first token is sent before its first chunk is read)
      self._deliver(req, got.tokens[req.sent - got.start:])
    self.stats["host_s"] += time.perf_counter() - t0
    return t0 - dispatched, self.stats["finished"] - finished

  def _refill(self, chunk_s: float, ended: int) -> None:
    """After a chunk of chunk_s seconds ended requests, while slots are free: waits up to
    refill_wait of that for as many new requests (clients that send the next request on an
    answer come back within milliseconds and join the next chunk, not the one after)."""
    wait = self.config.refill_wait * chunk_s
    if ended and wait > 0 and len(self.active) < self.config.slots:
      t0 = time.perf_counter()
      with self.lock:
        self.lock.wait_for(lambda: len(self.queue) >= ended or self._stop, timeout=wait)
      self.stats["refill_s"] += time.perf_counter() - t0

  def _deliver(self, req: SlotRequest, tokens: list[int]) -> None:
    """Sends `tokens` (cut at a stop id or max_new_tokens) and frees the slot of a finished
    request (the next chunk marks a slot of limit 0 done)."""
    limit, stop_ids = req.options.max_new_tokens, req.options.stop_token_ids
    keep, reason = [], None
    for t in tokens:
      if req.sent + len(keep) >= limit:
        reason = "length"
        break
      keep.append(t)
      if t in stop_ids:
        reason = "stop"
        break
    if reason is None and req.sent + len(keep) >= limit:
      reason = "length"
    req.sent += len(keep)
    if req.cancelled:
      reason = "cancelled"
    else:
      self.stats["tokens"] += len(keep)
      req.emit(keep, reason)
    if reason is not None:
      self._set_slot(req.slot, None)
      del self.active[req.slot]
      self.stats["finished"] += 1

  def _serve(self) -> None:
    """Admit, launch a chunk, then stream the chunk launched before it (pipelined, for a request
    alone) or this one (else: the chunk is read before the next admission, so its finished
    slots take waiting requests at once). A request's first token is read before the launch
    when nothing is in flight."""
    launched = None  # the chunk in flight, not yet read
    while True:
      with self.lock:
        while not self._stop and not self.queue and not self.active and launched is None:
          self.lock.wait()
        if self._stop:
          return
      if launched is not None and not (self.config.pipeline and self._alone()):
        self._refill(*self._finish(launched))
        launched = None
      firsts = self._admit()
      if launched is None:
        self._send_firsts(firsts)
        firsts = []
      nxt = self._launch() if self.active else None
      if launched is not None:
        self._finish(launched)
      self._send_firsts(firsts)
      launched = nxt

  def metrics(self) -> dict:
    """Queue depth, active slots and the counters since start (chunks, those of a request alone
    and those run while a request streams, steps, tokens; host seconds launching chunks, waiting
    for results, handling them and waiting for requests to refill slots; budget="auto":
    steps_budget_B, the steps that chose B)."""
    with self.lock:
      queued = len(self.queue)
    return dict(queue_depth=queued, active_slots=len(self.active), slots=self.config.slots,
                **self.stats)
