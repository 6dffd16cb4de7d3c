"""The one request schema: `GenerateOptions`, the options of a generation request, used by the API
(`engine.generate`'s keywords), the scripts (their config defaults are its defaults), the server
and the slot engine (a served request's own fields, `SLOT_FIELDS`), and checked in one place
(`GenerateOptions.check`): every value is type- and range-checked, the prompt plus new tokens must
fit the model's positions, and the cache must fit the device's free memory, before anything is
compiled or allocated. A refused request raises `RequestError` naming the field and the valid
range."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Sequence

import jax
import numpy as np

from ddtree_jax.checkpoints.dflash import Drafter
from ddtree_jax.kernels import ATTENTIONS, Kernels, KernelTuning
from ddtree_jax.speculative.decode import METHODS, LoopConfig

MAX_BUDGET = 1024
DEFAULT_BUDGETS = (0, 8, 16, 32, 64)  # budget="auto"'s options (0: AR)
MAX_TEMPERATURE = 2.0  # the highest temperature, served or not (the OpenAI API's range)
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1  # any 64-bit integer, signed or not
MEMORY_HEADROOM = 0.9  # the share of the free memory a request's caches may take
# The options a served request sets; the others are the server's (`slots.SlotConfig`).
SLOT_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids")


@dataclasses.dataclass(frozen=True)
class ServedLimits:
  """What a server takes of a request (`slots.SlotConfig.limits`): prompt + new tokens per slot
  (capacity), the longest prompt, the largest top_k, and sampling (False: greedy only)."""
  capacity: int
  longest_prompt: int
  max_top_k: int
  sampling: bool


class RequestError(ValueError):
  """A request the engine refuses: the message names the value and what is valid, `field` the
  option (or request field) at fault, None when no single one is."""

  def __init__(self, message: str, field: str | None = None):
    super().__init__(message)
    self.field = field


def default_attention() -> str:
  """The attention of a request that names none: Pallas on a GPU, XLA elsewhere."""
  return "pallas" if jax.default_backend() == "gpu" else "xla"


def integer(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
  """value as an int (an int or numpy integer, not a bool or float) in [lo, hi]."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise RequestError(f"{name} must be an integer, got {value!r} ({type(value).__name__})", name)
  value = int(value)
  if (lo is not None and value < lo) or (hi is not None and value > hi):
    bounds = (f"in [{lo}, {hi}]" if lo is not None and hi is not None else
              f">= {lo}" if lo is not None else f"<= {hi}")
    raise RequestError(f"{name} must be an integer {bounds}, got {value}", name)
  return value


def number(name: str, value, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False) -> float:
  """value as a finite float (an int or float, not a bool) in [lo, hi] ((lo, hi] if lo_open)."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                   np.floating)):
    raise RequestError(f"{name} must be a number, got {value!r} ({type(value).__name__})", name)
  value = float(value)
  if not math.isfinite(value):
    raise RequestError(f"{name} must be finite, got {value}", name)
  if lo is not None and (value <= lo if lo_open else value < lo) or hi is not None and value > hi:
    lo_s = "(" if lo_open else "["
    raise RequestError(f"{name} must be in {lo_s}{lo}, {hi if hi is not None else 'inf'}], "
                       f"got {value}", name)
  return value


def auto_options(budgets, costs) -> tuple[tuple[int, ...], tuple[float, ...] | None]:
  """budget="auto"'s options checked: distinct budgets in [0, MAX_BUDGET] (0: AR), at least one
  above 0, ascending; costs None or one positive number (seconds per step) each, reordered with
  them."""
  if isinstance(budgets, (str, bytes)) or not hasattr(budgets, "__len__") or not budgets:
    raise RequestError(f"budgets must be a non-empty list of budgets, got {budgets!r}", "budgets")
  ints = [integer("budgets", b, 0, MAX_BUDGET) for b in budgets]
  if len(set(ints)) != len(ints) or max(ints) == 0:
    raise RequestError(f"budgets must be distinct, with one above 0 (0 is AR), got {ints}",
                       "budgets")
  order = sorted(range(len(ints)), key=ints.__getitem__)
  if costs is None:
    return tuple(ints[i] for i in order), None
  if isinstance(costs, (str, bytes)) or not hasattr(costs, "__len__") or len(costs) != len(ints):
    raise RequestError(f"budget_costs must give one number per budget ({len(ints)}), got "
                       f"{costs!r}", "budget_costs")
  costs = [number("budget_costs", c, 0.0, lo_open=True) for c in costs]
  return tuple(ints[i] for i in order), tuple(costs[i] for i in order)


def token_ids(name: str, ids, vocab_size: int, field: str | None = None) -> list[int]:
  """A sequence of token ids (ints in [0, vocab_size)) as a list; may be empty. `field` (default:
  name) is the RequestError's."""
  field = field or name
  if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
    raise RequestError(f"{name} must be a sequence of token ids, got {type(ids).__name__}", field)
  arr = np.asarray(ids)
  mixed = not isinstance(ids, np.ndarray) and any(isinstance(t, (bool, np.bool_)) for t in ids)
  if arr.ndim != 1 or mixed or (arr.size and (arr.dtype == bool or not np.issubdtype(
      arr.dtype, np.integer))):
    raise RequestError(f"{name} must be a 1-D sequence of integer token ids, got "
                       f"{arr.dtype} of shape {arr.shape}", field)
  bad = [int(t) for t in arr if not 0 <= int(t) < vocab_size]
  if bad:
    raise RequestError(f"{name} has token ids {bad[:5]} outside [0, {vocab_size})", field)
  return [int(t) for t in arr]


def free_memory_bytes() -> int | None:
  """Free memory of the default device: the GPU allocator's headroom, else the host's available
  memory (/proc/meminfo); None when unknown."""
  try:
    stats = jax.local_devices()[0].memory_stats()
  except Exception:  # pylint: disable=broad-except  (backends without stats)
    stats = None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError):
    return None


def check_memory(needed: int, what: str, free: int | None = None) -> None:
  """Refuses a request whose `needed` bytes exceed MEMORY_HEADROOM of the free memory."""
  free = free_memory_bytes() if free is None else free
  if free is not None and needed > MEMORY_HEADROOM * free:
    raise RequestError(f"{what} needs {needed / 2**30:.2f} GiB, but the device has "
                       f"{free / 2**30:.2f} GiB free: ask for fewer tokens or prompts")


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def cache_bytes(cfg, batch: int, capacity: int, itemsize: int, dcfg=None) -> int:
  """Bytes of the target's (and the drafter's) K/V caches for `batch` sequences."""
  heads, k_dim, v_dim = cfg.cache_layout
  per_row = cfg.num_layers * heads * (k_dim + v_dim)
  if dcfg is not None:
    per_row += 2 * dcfg.layers.num_layers * dcfg.layers.num_kv_heads * dcfg.layers.head_dim
  return per_row * batch * capacity * itemsize


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateOptions:
  """The options of a generation request: `engine.generate`'s keywords (but the drafter).

  method: "ar", "chain" (DFlash) or "ddtree"; budget: DDTree's tree nodes (ddtree only, needed),
  or "auto": each step chooses one of `budgets` (0: AR) by expected tokens per second
  (`speculative/auto.py`), with `budget_costs` the seconds per step of each (None: measured on this
  machine, `engine.budget_costs`), every `auto_every` steps (`decode.auto_steps`); topk_cap:
  DDTree's tokens per depth (ddtree only; None: the budget). temperature > 0 samples
  from the target's distribution, filtered by top_k / top_p (None: off), with draws keyed by seed
  (a 64-bit integer); 0 is greedy. stop_token_ids: None = the target's eos ids. cache_capacity:
  cache rows per sequence (None: the longest prompt plus max_new_tokens, rounded up to 128).
  attention: "xla" or "pallas" (None: `default_attention()`). steps_per_check: decode steps per
  check of the stop condition (`decode.decode_loop`). kernel_tuning: the Pallas kernels' tuning
  (None: the defaults). `check` gives them checked, the defaults that depend on the model filled.
  """
  max_new_tokens: int | None = None  # required (None: refused, naming it)
  method: str = "ar"
  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None
  seed: int = 0
  stop_token_ids: Sequence[int] | None = None
  budget: int | str | None = None
  budgets: Sequence[int] = DEFAULT_BUDGETS
  budget_costs: Sequence[float] | None = None
  auto_every: int = 1
  topk_cap: int | None = None
  cache_capacity: int | None = None
  attention: str | None = None
  steps_per_check: int = 1
  kernel_tuning: KernelTuning | None = None

  def kwargs(self) -> dict:
    """The options as `engine.generate`'s keyword arguments."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  def check_values(self, server: ServedLimits | None = None) -> GenerateOptions:
    """The options with every value type- and range-checked on its own (RequestError naming the
    field): ints are ints, floats finite floats. With `server`, as a request to a server: only
    SLOT_FIELDS may differ from the defaults (temperature 0 for a greedy-only server). A
    temperature is at most MAX_TEMPERATURE, served or not."""
    if server is not None:
      for f in dataclasses.fields(self):
        if f.name not in SLOT_FIELDS and getattr(self, f.name) != f.default:
          raise RequestError(f"{f.name} is the server's (SlotConfig), not a request's: leave it "
                             f"at {f.default!r}", f.name)
    method, attention = self.method, self.attention
    if method not in METHODS:
      raise RequestError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}",
                         "method")
    if attention is not None and attention not in ATTENTIONS:
      raise RequestError(f"unknown attention {attention!r}; choose one of "
                         f"{', '.join(ATTENTIONS)}", "attention")
    if self.max_new_tokens is None:
      raise RequestError("max_new_tokens is required: how many tokens to generate per prompt "
                         "(an integer >= 1)", "max_new_tokens")
    max_new_tokens = integer("max_new_tokens", self.max_new_tokens, 1)
    steps_per_check = integer("steps_per_check", self.steps_per_check, 1, max_new_tokens)
    temperature = number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
    if server is not None and temperature > 0 and not server.sampling:
      raise RequestError("this server decodes greedily (SlotConfig.sampling=False): temperature "
                         "must be 0", "temperature")
    seed = integer("seed", self.seed, MIN_SEED, MAX_SEED)
    top_k = None if self.top_k is None else integer("top_k", self.top_k, 1)
    top_p = None if self.top_p is None else number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
    budget, topk_cap = self.budget, self.topk_cap
    budgets, costs = tuple(self.budgets), self.budget_costs
    if method == "ddtree":
      if budget is None:
        raise RequestError(f"method 'ddtree' needs a budget: an integer in [1, {MAX_BUDGET}] or "
                           "'auto'", "budget")
      if budget == "auto":
        budgets, costs = auto_options(budgets, costs)
      elif isinstance(budget, str):
        raise RequestError(f"budget must be an integer in [1, {MAX_BUDGET}] or 'auto', got "
                           f"{budget!r}", "budget")
      else:
        budget = integer("budget", budget, 1, MAX_BUDGET)
      topk_cap = None if topk_cap is None else integer("topk_cap", topk_cap, 1)
    else:
      if budget is not None:
        raise RequestError(f"budget is only used by method='ddtree', not {method!r}", "budget")
      if topk_cap is not None:
        raise RequestError(f"topk_cap is only used by method='ddtree', not {method!r}",
                           "topk_cap")
    auto_every = integer("auto_every", self.auto_every, 1, max_new_tokens)
    if budget != "auto":
      for name, default in (("budgets", DEFAULT_BUDGETS), ("budget_costs", None)):
        if getattr(self, name) != default and tuple(getattr(self, name) or ()) != default:
          raise RequestError(f"{name} is only used by budget='auto'", name)
      if auto_every != 1:
        raise RequestError("auto_every is only used by budget='auto'", "auto_every")
    cache_capacity = (None if self.cache_capacity is None else
                      integer("cache_capacity", self.cache_capacity, 1))
    if self.kernel_tuning is not None and not isinstance(self.kernel_tuning, KernelTuning):
      raise RequestError(f"kernel_tuning must be a kernels.KernelTuning, got "
                         f"{type(self.kernel_tuning).__name__}", "kernel_tuning")
    return dataclasses.replace(
        self, max_new_tokens=max_new_tokens, steps_per_check=steps_per_check,
        temperature=temperature, seed=seed, top_k=top_k, top_p=top_p, budget=budget,
        budgets=budgets, budget_costs=costs, auto_every=auto_every, topk_cap=topk_cap,
        cache_capacity=cache_capacity)

  def check(self, target, drafter, prompts: Sequence[Sequence[int]],
            server: ServedLimits | None = None
            ) -> tuple[tuple[tuple[int, ...], ...], GenerateOptions]:
    """Checks a request of these options for `prompts` on `target` (with `drafter`, None for AR):
    the values (`check_values`), the prompts, the positions, the cache rows and memory. Returns
    (the prompts as tuples, the options with stop_token_ids, cache_capacity and top_k resolved
    for the model: a top_k of the whole vocabulary is None). With `server`, as a request to a
    server whose decode state holds the caches: a prompt fits its longest_prompt, the prompt plus
    max_new_tokens its capacity, top_k its max_top_k."""
    cfg = target.config
    if server is None and self.method in METHODS and self.method != "ar":
      if drafter is None:
        raise RequestError(f"method {self.method!r} needs a drafter "
                           "(drafter=load_drafter(...))", "drafter")
      if not isinstance(drafter, Drafter):
        raise RequestError(f"drafter must be a Drafter (ddtree_jax.load_drafter), got "
                           f"{type(drafter).__name__}", "drafter")
    opts = self.check_values(server)
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or not len(prompts):
      raise RequestError("prompts is empty: give a non-empty list of token-id sequences",
                         "prompts")
    checked = tuple(tuple(token_ids(f"prompt {i}", p, cfg.vocab_size, "prompts"))
                    for i, p in enumerate(prompts))
    for i, p in enumerate(checked):
      if not p:
        raise RequestError(f"prompt {i} is empty", "prompts")
      if server is not None and len(p) > server.longest_prompt:
        raise RequestError(f"prompt {i} has {len(p)} tokens; this server takes at most "
                           f"{server.longest_prompt}", "prompts")
    top_k = opts.top_k
    if top_k is not None and top_k >= cfg.vocab_size:
      top_k = None
    if server is not None and top_k is not None and top_k > server.max_top_k:
      raise RequestError(f"top_k must be an integer in [1, {server.max_top_k}] (or off: at least "
                         f"the vocabulary, {cfg.vocab_size}), got {top_k}", "top_k")
    stop = cfg.eos_token_ids if opts.stop_token_ids is None else opts.stop_token_ids
    stop = tuple(token_ids("stop_token_ids", stop, cfg.vocab_size))
    longest, new = max(len(p) for p in checked), opts.max_new_tokens
    need = longest + new - 1  # the last token is emitted, never cached
    if need > cfg.max_position_embeddings:
      raise RequestError(f"a prompt of {longest} tokens + max_new_tokens {new} needs {need} "
                         f"positions; the model has {cfg.max_position_embeddings}",
                         "max_new_tokens")
    capacity = opts.cache_capacity
    if server is not None:
      if longest + new > server.capacity:
        raise RequestError(f"a prompt of {longest} tokens + max_new_tokens {new} exceeds the "
                           f"server's {server.capacity} tokens per slot", "max_new_tokens")
    elif capacity is None:
      capacity = _round_up(need, 128)
    elif need > capacity:
      raise RequestError(f"a prompt of {longest} tokens + max_new_tokens {new} needs {need} "
                         f"cache rows; cache_capacity is {capacity}", "max_new_tokens")
    if server is None:
      itemsize = np.dtype(target.params.embed.dtype).itemsize
      dcfg = drafter.config if opts.method != "ar" else None
      shards = 1 if target.mesh is None else target.mesh.size  # caches split over the mesh
      check_memory(cache_bytes(cfg, len(checked), capacity, itemsize, dcfg) // shards,
                   f"the KV caches of {len(checked)} sequences x {capacity} rows")
    return checked, dataclasses.replace(opts, top_k=top_k, stop_token_ids=stop,
                                        cache_capacity=capacity)

  def loop_config(self, dcfg, mesh=None, rules=None) -> LoopConfig:
    """The decode programs' static settings for these options (as `check` gives them, or with
    stop_token_ids set); dcfg: the drafter's config (None for AR); top_k and top_p only when
    sampling."""
    sample = self.temperature > 0
    auto = self.budget == "auto"
    return LoopConfig(
        method=self.method, max_new_tokens=self.max_new_tokens,
        num_drafts=0 if dcfg is None else dcfg.num_drafts,
        budget=max(self.budgets) if auto else self.budget or 0,
        budgets=tuple(self.budgets) if auto else (), auto_every=self.auto_every if auto else 1,
        topk_cap=self.topk_cap, temperature=self.temperature,
        top_k=self.top_k if sample else None, top_p=self.top_p if sample else None,
        stop_ids=tuple(self.stop_token_ids), steps_per_check=self.steps_per_check,
        kernels=Kernels(self.attention or default_attention(), mesh, rules,
                        self.kernel_tuning or KernelTuning()))
