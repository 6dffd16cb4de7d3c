"""budget="auto" against every fixed budget at real model shapes, under drafts of set acceptance.

  python -m experiments.perf.bench_auto --shapes=qwen3-8b,qwen3-30b-a3b --batches=1,8  # H200
  python -m experiments.perf.bench_auto --smoke                                        # CPU

Random weights accept nothing, so both models are stand-ins (`ddtree_jax/tools/
benchmark_drafter.py`): the target is a random one of the shape with a planted greedy path (its
layers compute on random weights; its next token after x is perm(x) by a margin bf16 keeps), and
the drafter is the benchmark drafter: a random DFlash drafter of the usual shape (5 layers, block
16) whose forward runs every step and whose logits are then replaced by a calibrated guess at the
planted path, right at the first candidate with probability ACCEPT per position. Each
--levels entry NAME:ACCEPT[:CONFIDENCE] is one such drafter (CONFIDENCE: what the draft claims,
default ACCEPT; `none:0:0.5` is a drafter that is never right and does not know it).

Per shape and batch: one AR run gives the reference (and checks that the target follows its
planted path: `planted` in the table's title), then per level every fixed budget and
budget="auto" (its options and auto_every as given; its costs measured once per process, as
`generate` does), each timed --repeats times after a warm-up (median decode tokens/s). Every
output is compared with AR's. Prints one table per shape and batch, and each row as a JSON line.
"""

from __future__ import annotations

import collections

from absl import app, flags
import jax
import numpy as np

import ddtree_jax as dj
from ddtree_jax.tools import benchmark_drafter as bench_drafter
from experiments.perf import common_flags, harness, planted

common_flags.define("small", "smoke", "json_out", repeats=3, compile_threads=8)
flags.DEFINE_string("shapes", "qwen3-8b,qwen3-30b-a3b", "target shapes (harness.SHAPES)")
flags.DEFINE_string("batches", "1,8", "batch sizes")
planted.define_levels()
flags.DEFINE_string("budgets", "8,16,32,64", "fixed DDTree budgets")
flags.DEFINE_string("auto_budgets", "0,8,16,32,64", "budget='auto''s options (0: AR)")
flags.DEFINE_integer("auto_every", 1, "budget='auto' chooses every this many steps")
flags.DEFINE_integer("prompt_len", 512, "random prompt tokens per row")
flags.DEFINE_integer("max_new_tokens", 128, "tokens each row emits")
flags.DEFINE_string("dtype", "bfloat16", "weights and activations")
flags.DEFINE_integer("seed", 0, "weights, prompts and the drafts' draws")
FLAGS = flags.FLAGS
SMOKE = dict(small=True, prompt_len=24, max_new_tokens=24, repeats=1, batches="1,2",
             compile_threads=2, budgets="4,16", auto_budgets="0,4,16")


def runs(args) -> list[tuple[str, int | str]]:
  return [("ddtree", b) for b in harness.ints(args.budgets)] + [("ddtree", "auto")]


def kwargs(args, method: str, budget, drafter) -> dict:
  kw = dict(method=method, max_new_tokens=args.max_new_tokens, stop_token_ids=(),
            drafter=drafter if method != "ar" else None)
  if method == "ddtree":
    kw["budget"] = budget
  if budget == "auto":
    kw.update(budgets=tuple(harness.ints(args.auto_budgets)), auto_every=args.auto_every)
  return kw


def timed(target, prompts, kw, repeats: int):
  """(median decode tokens/s, the last result) of `repeats` runs after a warm-up."""
  dj.generate(target, prompts, **kw)
  results = [dj.generate(target, prompts, **kw) for _ in range(repeats)]
  return float(np.median([r.stats["tokens_per_second"] for r in results])), results[-1]


def step_ms(res, tps: float) -> float:
  """A step's median wall time: the run's tokens at the median tokens/s, over its steps."""
  return 1e3 * sum(map(len, res.tokens)) / tps / max(res.stats["steps"], 1)


def overhead_us(by: dict, ar: dict) -> float:
  """auto's step time less what its steps would take at the fixed programs' step times."""
  a = by["auto"]
  fixed = {0: ar["step_ms"], **{int(k[2:]): r["step_ms"] for k, r in by.items() if k != "auto"}}
  n = sum(a["chosen"].values())
  return 1e3 * (a["step_ms"] - sum(fixed[b] * c for b, c in a["chosen"].items()) / n)


def name(budget) -> str:
  return "auto" if budget == "auto" else f"B={budget}"


def bench(args, target, drafter, successor, shape: str, batch: int, levels: list[planted.Level],
          rows) -> None:
  rng = np.random.default_rng(args.seed)
  prompts = [rng.integers(0, target.config.vocab_size, args.prompt_len).tolist()
             for _ in range(batch)]
  ar_kw = kwargs(args, "ar", None, None)
  dj.compile_many(target, [(prompts, ar_kw)])
  ar_tps, ar = timed(target, prompts, ar_kw, args.repeats)
  base = dict(shape=shape, batch=batch, dtype=args.dtype, prompt_len=args.prompt_len,
              max_new_tokens=args.max_new_tokens, drafter="benchmark")
  common_flags.keep_row(rows, dict(base, level="-", accept=None, run="ar",
                                   tokens_per_second=ar_tps, tau=1.0,
                                   step_ms=step_ms(ar, ar_tps),
                                   planted=planted.on_path(prompts, ar.tokens, successor)), args.json_out)
  for i, level in enumerate(levels):
    d = bench_drafter.benchmark_drafter(drafter, successor, level.accept, level.confidence,
                                        seed=args.seed)
    if i == 0:  # one program per run: the levels differ in traced values only
      dj.compile_many(target, [(prompts, kwargs(args, m, b, d)) for m, b in runs(args)],
                      args.compile_threads)
    for method, budget in runs(args):
      tps, res = timed(target, prompts, kwargs(args, method, budget, d), args.repeats)
      row = dict(base, level=level.name, accept=level.accept, confidence=level.confidence,
                 run=name(budget), tokens_per_second=tps, tau=res.stats["tau"],
                 steps=res.stats["steps"], step_ms=step_ms(res, tps), x_ar=tps / ar_tps,
                 divergent_seqs=sum(a != b for a, b in zip(res.tokens, ar.tokens)))
      if budget == "auto":
        chosen = collections.Counter(res.stats["chosen"])
        row["chosen"] = {int(b): chosen[b] for b in sorted(chosen)}
        row["budget_costs_ms"] = [c * 1e3 for c in res.stats["budget_costs"]]
      common_flags.keep_row(rows, row, args.json_out)


def print_tables(args, rows) -> None:
  print(f"\n({planted.NOTE})")
  fixed = [name(b) for m, b in runs(args) if b != "auto"]
  for (shape, batch) in dict.fromkeys((r["shape"], r["batch"]) for r in rows):
    cell = [r for r in rows if r["shape"] == shape and r["batch"] == batch]
    ar = next(r for r in cell if r["run"] == "ar")
    print(f"\n{shape}, batch {batch}, {ar['dtype']}, {ar['prompt_len']}-token prompts, "
          f"{ar['max_new_tokens']} new tokens: tokens/s (tau); AR {ar['tokens_per_second']:.1f}; "
          f"planted {100 * ar['planted']:.0f}%")
    print(f"{'level':<8}{'accept':>7}" + "".join(f"{f:>15}" for f in fixed)
          + f"{'auto':>15}{'auto/best':>10}{'auto/worst':>11}{'auto/AR':>8}{'div':>5}{'over us':>8}"
          + "  auto's steps")
    for level in dict.fromkeys(r["level"] for r in cell if r["run"] != "ar"):
      by = {r["run"]: r for r in cell if r["level"] == level}
      tps = [by[f]["tokens_per_second"] for f in fixed]
      a = by["auto"]
      div = sum(r["divergent_seqs"] for r in by.values())
      print(f"{level:<8}{a['accept']:>7.2f}"
            + "".join(f"{by[f]['tokens_per_second']:>9.1f} ({by[f]['tau']:>4.2f})" for f in fixed)
            + f"{a['tokens_per_second']:>9.1f} ({a['tau']:>4.2f})"
            + f"{a['tokens_per_second'] / max(tps):>10.2f}{a['tokens_per_second'] / min(tps):>11.2f}"
            + f"{a['x_ar']:>8.2f}{div:>5}{overhead_us(by, ar):>8.0f}  "
            + ", ".join(f"{'AR' if b == 0 else b} x{n}" for b, n in a["chosen"].items()))
  print("(tokens/s: median of the timed runs, compile excluded; div: sequences whose tokens "
        "differ from AR's, over every run of the level; over us: auto's step less the fixed "
        "programs' steps of the budgets it chose, the chooser's cost per step; planted: AR's tokens "
        "that follow the planted path, which the drafts follow)")


def main(_):
  args = common_flags.start(SMOKE)
  levels = planted.parse_levels(args.levels)
  rows = []
  print(f"device: {jax.devices()[0].device_kind}; drafter: benchmark (not trained)", flush=True)
  for shape in filter(None, (s.strip() for s in args.shapes.split(","))):
    target, drafter, successor = planted.models(shape, args.small, args.dtype, args.seed)
    for batch in harness.ints(args.batches):
      bench(args, target, drafter, successor, shape, batch, levels, rows)
    del target, drafter  # the next shape's weights need the memory
  print_tables(args, rows)


if __name__ == "__main__":
  from ddtree_jax import engine
  engine.define_compilation_cache_flags(default=False)
  app.run(main)
