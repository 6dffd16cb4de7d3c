"""What the auto benchmarks (bench_auto, bench_serve_auto) share: a random target of a shape with
a planted greedy path, a random DFlash drafter for it, the benchmark drafter's levels of
acceptance (`ddtree_jax/tools/benchmark_drafter.py`), and the note every table of theirs prints.
"""

from __future__ import annotations

import dataclasses

from absl import app, flags
import jax
import numpy as np

from ddtree_jax.checkpoints import dflash, hf
from ddtree_jax.tools import benchmark_drafter as bench_drafter
from experiments.perf import harness

NOTE = ("drafter: the benchmark drafter, a random drafter's forward with its logits replaced by a "
        "calibrated guess at the target's greedy path; target: random weights with a planted "
        "greedy path. These tables time speculation at a set acceptance; they say nothing of a "
        "trained drafter's.")


def define_levels() -> None:
  flags.DEFINE_string("levels", "none:0:0.5,low:0.6,paper:0.9,high:0.95",
                      "benchmark drafters NAME:ACCEPT[:CONFIDENCE]")


@dataclasses.dataclass(frozen=True)
class Level:
  """A benchmark drafter: right at a position's first candidate with probability `accept`,
  claiming `confidence` (`bench_drafter.benchmark_drafter`)."""
  name: str
  accept: float
  confidence: float


def parse_levels(text: str) -> list[Level]:
  """'none:0:0.5,low:0.6' -> the Levels (CONFIDENCE defaults to ACCEPT)."""
  out = []
  for item in filter(None, (s.strip() for s in text.split(","))):
    parts = item.split(":")
    try:
      if len(parts) not in (2, 3):
        raise ValueError("give NAME:ACCEPT or NAME:ACCEPT:CONFIDENCE")
      accept = float(parts[1])
      confidence = float(parts[2]) if len(parts) == 3 else accept
    except ValueError as e:
      raise app.UsageError(f"--levels entry {item!r}: {e}") from e
    if not (0 <= accept <= 1 and 0 <= confidence <= 1):
      raise app.UsageError(f"--levels entry {item!r}: ACCEPT and CONFIDENCE must be in [0, 1]")
    out.append(Level(parts[0], accept, confidence))
  if not out:
    raise app.UsageError("--levels is empty")
  return out


def models(shape: str, small: bool, dtype: str, seed: int):
  """(planted random target, random DFlash drafter, the planted successor [V]) of `shape`."""
  cfg = harness.target_config(small, shape)
  params = harness.random_target(cfg, jax.random.key(seed), dtype=hf.parse_dtype(dtype))
  target = hf.Target(params=params, config=cfg, tokenizer=None, path=f"random:{shape}",
                     mesh=None, rules=None)
  target = bench_drafter.planted_target(target, seed)
  dcfg = harness.drafter_config(cfg, small)
  dparams = harness.random_drafter_params(cfg, dcfg, jax.random.key(seed + 1),
                                          params.embed.dtype)
  drafter = dflash.Drafter(params=dparams, config=dcfg, path="random")
  return target, drafter, bench_drafter.planted_successor(cfg.vocab_size, seed)


def on_path(prompts, outputs, successor) -> float:
  """The fraction of emitted tokens that are the planted successor of the token before."""
  hits = [successor[a] == b for p, o in zip(prompts, outputs)
          for a, b in zip([p[-1], *o], o)]
  return float(np.mean(hits)) if hits else 1.0
