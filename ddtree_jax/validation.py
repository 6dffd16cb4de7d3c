"""One validation layer for generation requests, shared by the API (`engine.generate`), the
scripts and the server: every value is type- and range-checked, the prompt plus new tokens must
fit the model's positions, and the cache must fit the device's free memory, before anything is
compiled or allocated. A refused request raises `RequestError` naming the value and the valid
range."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Sequence

import jax
import numpy as np

from ddtree_jax.decode import METHODS
from ddtree_jax.kernels import ATTENTIONS, KernelTuning

MAX_BUDGET = 1024
MEMORY_HEADROOM = 0.9  # the share of the free memory a request's caches may take


class RequestError(ValueError):
  """A request the engine refuses; the message names the value and what is valid."""


def integer(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
  """value as an int (an int or numpy integer, not a bool or float) in [lo, hi]."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise RequestError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
  value = int(value)
  if (lo is not None and value < lo) or (hi is not None and value > hi):
    bounds = (f"in [{lo}, {hi}]" if lo is not None and hi is not None else
              f">= {lo}" if lo is not None else f"<= {hi}")
    raise RequestError(f"{name} must be an integer {bounds}, got {value}")
  return value


def number(name: str, value, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False) -> float:
  """value as a finite float (an int or float, not a bool) in [lo, hi] ((lo, hi] if lo_open)."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                   np.floating)):
    raise RequestError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
  value = float(value)
  if not math.isfinite(value):
    raise RequestError(f"{name} must be finite, got {value}")
  if lo is not None and (value <= lo if lo_open else value < lo) or hi is not None and value > hi:
    lo_s = "(" if lo_open else "["
    raise RequestError(f"{name} must be in {lo_s}{lo}, {hi if hi is not None else 'inf'}], "
                       f"got {value}")
  return value


def token_ids(name: str, ids, vocab_size: int) -> list[int]:
  """A sequence of token ids (ints in [0, vocab_size)) as a list; may be empty."""
  if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
    raise RequestError(f"{name} must be a sequence of token ids, got {type(ids).__name__}")
  arr = np.asarray(ids)
  mixed = not isinstance(ids, np.ndarray) and any(isinstance(t, (bool, np.bool_)) for t in ids)
  if arr.ndim != 1 or mixed or (arr.size and (arr.dtype == bool or not np.issubdtype(
      arr.dtype, np.integer))):
    raise RequestError(f"{name} must be a 1-D sequence of integer token ids, got "
                       f"{arr.dtype} of shape {arr.shape}")
  bad = [int(t) for t in arr if not 0 <= int(t) < vocab_size]
  if bad:
    raise RequestError(f"{name} has token ids {bad[:5]} outside [0, {vocab_size})")
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


@dataclasses.dataclass(frozen=True)
class Request:
  """A checked `generate` request, values normalised (ints are ints, floats finite)."""
  prompts: tuple[tuple[int, ...], ...]
  method: str
  max_new_tokens: int
  temperature: float
  top_k: int | None
  top_p: float | None
  seed: int
  stop_ids: tuple[int, ...]
  budget: int | None
  topk_cap: int | None
  attention: str
  steps_per_check: int
  capacity: int                   # cache rows per sequence


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def cache_bytes(cfg, batch: int, capacity: int, itemsize: int, dcfg=None) -> int:
  """Bytes of the target's (and the drafter's) K/V caches for `batch` sequences."""
  heads, k_dim, v_dim = cfg.cache_layout
  per_row = cfg.num_layers * heads * (k_dim + v_dim)
  if dcfg is not None:
    per_row += 2 * dcfg.layers.num_layers * dcfg.layers.num_kv_heads * dcfg.layers.head_dim
  return per_row * batch * capacity * itemsize


def check_generate(target, prompts: Sequence[Sequence[int]], *, method, max_new_tokens,
                   temperature, seed, stop_token_ids, drafter, budget, topk_cap,
                   cache_capacity, attention, top_k, top_p, steps_per_check,
                   kernel_tuning=None, default_attention: str = "xla") -> Request:
  """Checks every argument of `engine.generate`; returns the normalised Request."""
  from ddtree_jax.checkpoint import Drafter  # pylint: disable=import-outside-toplevel
  cfg = target.config
  if method not in METHODS:
    raise RequestError(f"unknown method {method!r}; choose one of {METHODS}")
  attention = attention or default_attention
  if attention not in ATTENTIONS:
    raise RequestError(f"unknown attention {attention!r}; choose one of {ATTENTIONS}")
  if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or not len(prompts):
    raise RequestError("prompts is empty: give a non-empty list of token-id sequences")
  checked = tuple(tuple(token_ids(f"prompt {i}", p, cfg.vocab_size))
                  for i, p in enumerate(prompts))
  for i, p in enumerate(checked):
    if not p:
      raise RequestError(f"prompt {i} is empty")
  max_new_tokens = integer("max_new_tokens", max_new_tokens, 1)
  steps_per_check = integer("steps_per_check", steps_per_check, 1, max_new_tokens)
  temperature = number("temperature", temperature, 0.0)
  seed = integer("seed", seed)
  top_k = None if top_k is None else integer("top_k", top_k, 1)
  top_p = None if top_p is None else number("top_p", top_p, 0.0, 1.0, lo_open=True)
  if method != "ar":
    if drafter is None:
      raise RequestError(f"method {method!r} needs a drafter (drafter=load_drafter(...))")
    if not isinstance(drafter, Drafter):
      raise RequestError(f"drafter must be a Drafter (ddtree_jax.load_drafter), got "
                         f"{type(drafter).__name__}")
  if method == "ddtree":
    if budget is None:
      raise RequestError(f"method 'ddtree' needs a budget: an integer in [1, {MAX_BUDGET}]")
    budget = integer("budget", budget, 1, MAX_BUDGET)
    topk_cap = None if topk_cap is None else integer("topk_cap", topk_cap, 1)
  else:
    if budget is not None:
      raise RequestError(f"budget is only used by method='ddtree', not {method!r}")
    if topk_cap is not None:
      raise RequestError(f"topk_cap is only used by method='ddtree', not {method!r}")
  stop = cfg.eos_token_ids if stop_token_ids is None else stop_token_ids
  stop = tuple(token_ids("stop_token_ids", list(stop), cfg.vocab_size))
  if kernel_tuning is not None and not isinstance(kernel_tuning, KernelTuning):
    raise RequestError(f"kernel_tuning must be a kernels.KernelTuning, got "
                       f"{type(kernel_tuning).__name__}")
  longest = max(len(p) for p in checked)
  need = longest + max_new_tokens - 1  # the last token is emitted, never cached
  if need > cfg.max_position_embeddings:
    raise RequestError(f"a prompt of {longest} tokens + max_new_tokens {max_new_tokens} needs "
                       f"{need} positions; the model has {cfg.max_position_embeddings}")
  if cache_capacity is None:
    capacity = _round_up(need, 128)
  else:
    capacity = integer("cache_capacity", cache_capacity, 1)
    if need > capacity:
      raise RequestError(f"a prompt of {longest} tokens + max_new_tokens {max_new_tokens} "
                         f"needs {need} cache rows; cache_capacity is {capacity}")
  itemsize = np.dtype(target.params.embed.dtype).itemsize
  dcfg = drafter.config if method != "ar" else None
  shards = 1 if target.mesh is None else target.mesh.size  # caches split over the mesh
  check_memory(cache_bytes(cfg, len(checked), capacity, itemsize, dcfg) // shards,
               f"the KV caches of {len(checked)} sequences x {capacity} rows")
  return Request(prompts=checked, method=method, max_new_tokens=max_new_tokens,
                 temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop_ids=stop,
                 budget=budget, topk_cap=topk_cap, attention=attention,
                 steps_per_check=steps_per_check, capacity=capacity)
