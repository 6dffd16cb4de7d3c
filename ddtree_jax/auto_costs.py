"""budget="auto"'s costs: the seconds per step of each of its options, measured on this machine
with the very programs a request runs, and kept on disk beside JAX's compilation cache.

Each option is forced in turn (`auto.forced`: the chooser then picks it whatever the draft) on a
state prefilled from the request's own prompts, its loop started near its last step so that it
runs a given number of steps. The time of a short and a long run gives the step's slope: what a
step costs without the call's fixed part (dispatch, the first condition check, the sync), which
would otherwise flatten the differences between budgets. AR is timed on steps that draft
nothing (the state starts backing off for longer than the run), as the loop's AR steps are, and
a drafted budget with the tree one budget above it, as the loop builds it after choosing it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from ddtree_jax.speculative import auto as auto_lib

SHORT, LONG, REPEATS = 2, 8, 3
FILE = "ddtree_budget_costs.json"


def measure(prefill, loop, args, lc, dparams) -> tuple[float, ...]:
  """Seconds per step of each of lc.budgets: prefill / loop the compiled programs, args
  prefill's arguments but the cost (`engine._prepare`'s)."""
  max_steps = max(lc.max_new_tokens - 1, 1)
  long = min(LONG, max_steps)
  short = min(SHORT, long - 1)
  costs = []
  for j in range(len(lc.budgets)):
    cost = jax.device_put(auto_lib.forced(len(lc.budgets), j), args[-1].sharding)

    def run(steps):
      """(seconds, steps run): rows that stop early can end the loop before `steps`."""
      state = prefill(*args[:-1], cost)
      start = max_steps - steps
      put = lambda x, like: jax.device_put(jnp.int32(x), like.sharding)
      state = dataclasses.replace(state, step=put(start, state.step))
      if lc.budgets[j] == 0:  # AR: no draft on any step of the run
        state = dataclasses.replace(state, auto=dataclasses.replace(
            state.auto, skip=put(max_steps + 1, state.auto.skip)))
      else:  # the tree it gets when chosen: one budget above it
        drafted = [b for b in lc.budgets if b > 0]
        tier = min(drafted.index(lc.budgets[j]) + 1, len(drafted) - 1)
        state = dataclasses.replace(state, auto=dataclasses.replace(
            state.auto, tier=put(tier, state.auto.tier)))
      t0 = time.perf_counter()
      state = jax.block_until_ready(loop(args[0], dparams, state))
      return time.perf_counter() - t0, max(int(state.step) - start, 1)

    run(1)  # the first call of a program pays for loading it
    timed = {n: [run(n) for _ in range(REPEATS)] for n in {short, long}}
    secs = {n: statistics.median(t for t, _ in runs) for n, runs in timed.items()}
    ran = {n: runs[0][1] for n, runs in timed.items()}
    slope = ((secs[long] - secs[short]) / (ran[long] - ran[short])
             if short > 0 and ran[long] > ran[short] else 0.0)
    costs.append(slope if slope > 0 else secs[long] / ran[long])
  return tuple(costs)


@functools.lru_cache(maxsize=1)
def code_version() -> str:
  """A hash of this package's sources: costs measured by other code are not reused."""
  h = hashlib.sha256()
  root = os.path.dirname(__file__)
  for dirpath, _, names in sorted(os.walk(root)):
    for name in sorted(n for n in names if n.endswith(".py")):
      with open(os.path.join(dirpath, name), "rb") as f:
        h.update(name.encode() + f.read())
  return h.hexdigest()[:16]


def cache_key(statics: dict, args) -> str:
  """The device, JAX, this code and every static and shape of the programs."""
  shapes = [(x.shape, str(x.dtype)) for x in jax.tree.leaves(args)]
  what = (jax.devices()[0].device_kind, jax.device_count(), jax.__version__, code_version(),
          sorted((k, repr(v)) for k, v in statics.items()), repr(shapes))
  return hashlib.sha256(repr(what).encode()).hexdigest()


def cached(key: str, compute) -> tuple[float, ...]:
  """compute() once per key, kept in FILE under JAX's compilation cache directory (when one is
  set; in memory otherwise)."""
  folder = jax.config.jax_compilation_cache_dir
  path = os.path.join(folder, FILE) if folder else None
  table = _MEMORY
  if path and os.path.exists(path):
    try:
      with open(path) as f:
        table = {**json.load(f), **_MEMORY}
    except (OSError, ValueError):
      pass
  if key not in table:
    table[key] = list(compute())
    _MEMORY[key] = table[key]
    if path:
      os.makedirs(folder, exist_ok=True)
      tmp = f"{path}.{os.getpid()}"
      with open(tmp, "w") as f:
        json.dump(table, f)
      os.replace(tmp, path)
  return tuple(table[key])


_MEMORY: dict = {}
