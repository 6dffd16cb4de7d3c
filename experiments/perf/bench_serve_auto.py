"""The slot server's budget="auto" against its fixed budgets at a model shape, under drafts of set
acceptance, at several concurrencies.

  python -m experiments.perf.bench_serve_auto --shape=qwen3-8b --concurrency=1,4,16,32  # GPU
  python -m experiments.perf.bench_serve_auto --smoke                                   # CPU

The models are bench_auto's stand-ins (experiments/perf/planted.py): a random target of the
shape with a planted greedy path and the benchmark drafter (`ddtree_jax/tools/
benchmark_drafter.py`), whose draws need nothing per request, so the server runs it as any
drafter. Per --runs entry (ar, a DDTree budget, auto) and level, one `serving.slots.SlotEngine`
of --slots slots (default: the largest concurrency), started as a server starts (the levels
differ in traced values, so a run's programs compile once), in this process: the server's
scheduling and programs without its HTTP transport. Per concurrency C, C clients each send their
next request as soon as the last one ends, --requests_per_client each, prompts of --prompt_len
random tokens and --max_tokens new tokens; tokens/s is every request's tokens over the wall time
from the first submit to the last token, after an untimed warm-up run. Every request's tokens
are compared with the AR engine's for the same prompt. auto measures its step costs once at
start on a batch of --slots rows, as the server does (--auto_costs=measure), or takes each fixed
engine's step time (wall time over steps) at the largest concurrency (fixed). Prints a table per
level and one JSON line per row.
"""

from __future__ import annotations

import threading
import time

from absl import app, flags
import numpy as np

from ddtree_jax.request import GenerateOptions
from ddtree_jax.serving import slots
from ddtree_jax.tools import benchmark_drafter as bench_drafter
from experiments.perf import common_flags, harness, planted

common_flags.define("small", "smoke", "shape", "json_out", runs="ar,8,16,32,64,auto")
planted.define_levels()
flags.DEFINE_string("concurrency", "1,4,16,32", "clients sending requests at once")
flags.DEFINE_integer("slots", 0, "decode slots of every engine (0: the largest concurrency)")
flags.DEFINE_integer("requests_per_client", 2, "requests each client sends, one after another")
flags.DEFINE_integer("prompt_len", 256, "random prompt tokens per request")
flags.DEFINE_integer("max_tokens", 128, "new tokens per request")
flags.DEFINE_string("auto_budgets", "0,8,16,32,64", "budget='auto''s options (0: AR)")
flags.DEFINE_enum("auto_costs", "measure", ["measure", "fixed"], "auto's seconds per step: "
                  "measured at start as the server does, or the fixed engines' in this run")
flags.DEFINE_string("dtype", "bfloat16", "weights and activations")
flags.DEFINE_integer("seed", 0, "weights, prompts and the drafts' draws")
SMOKE = dict(small=True, runs="ar,4,auto", concurrency="1,2", requests_per_client=1,
             prompt_len=12, max_tokens=12, auto_budgets="0,4")
FLAGS = flags.FLAGS


def engine_for(target, drafter, run: str, args, costs=None) -> slots.SlotEngine:
  """A started SlotEngine for `run` (ar, auto or a budget), compiled and warmed up."""
  n = args.slots or max(harness.ints(args.concurrency))
  capacity = args.prompt_len + args.max_tokens + 1
  method, budget = ("ar", 16) if run == "ar" else ("ddtree", run if run == "auto" else int(run))
  kw = dict(budgets=tuple(harness.ints(args.auto_budgets)), budget_costs=costs) \
      if run == "auto" else {}
  config = slots.SlotConfig(method=method, budget=budget, slots=n, capacity=capacity,
                            prompt_buckets=(args.prompt_len,),
                            max_chunk_steps=min(32, capacity), **kw)
  engine = slots.SlotEngine(target, drafter if method != "ar" else None, config)
  engine.warm_up()
  engine.start()
  return engine


def serve(engine: slots.SlotEngine, prompts: list[list[int]], clients: int, max_tokens: int):
  """(the tokens of each prompt's request, each one's accepted tokens per step, wall seconds, the
  engine's counters over the run): `clients` threads, client c sending prompts c, c + clients,
  ... one after another."""
  got, acceptance = [None] * len(prompts), [None] * len(prompts)
  options = GenerateOptions(max_new_tokens=max_tokens, stop_token_ids=())
  errors = []

  def client(c: int):
    for i in range(c, len(prompts), clients):
      done, toks = threading.Event(), []

      def emit(new, reason):
        toks.extend(new)
        if reason:
          done.set()
      try:
        req = engine.submit(prompts[i], options, emit)
      except Exception as e:  # pylint: disable=broad-except
        errors.append(e)
        return
      if not done.wait(600):
        errors.append(TimeoutError(f"request {i} got no answer in 600 s"))
        return
      got[i], acceptance[i] = toks, req.acceptance

  before = dict(engine.stats)
  threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
  t0 = time.perf_counter()
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  wall = time.perf_counter() - t0
  if errors:
    raise errors[0]
  return got, acceptance, wall, {k: v - before.get(k, 0) for k, v in engine.stats.items()}


def bench(args, rows) -> None:
  target, drafter, successor = planted.models(args.shape, args.small, args.dtype, args.seed)
  levels = planted.parse_levels(args.levels)
  concurrency = harness.ints(args.concurrency)
  rng = np.random.default_rng(args.seed)
  prompts = {c: [rng.integers(0, target.config.vocab_size, args.prompt_len).tolist()
                 for _ in range(c * args.requests_per_client)] for c in concurrency}
  runs = [r.strip() for r in args.runs.split(",") if r.strip()]
  runs = [r for r in runs if r != "auto"] + [r for r in runs if r == "auto"]  # auto last
  reference, step_s, costs = {}, {}, None
  base = dict(shape=args.shape, dtype=args.dtype, prompt_len=args.prompt_len,
              max_tokens=args.max_tokens, drafter="benchmark")
  if "auto" in runs and args.auto_costs == "fixed":
    if not all(str(b) in runs for b in harness.ints(args.auto_budgets) if b) or \
        (0 in harness.ints(args.auto_budgets) and "ar" not in runs):
      raise app.UsageError("--auto_costs=fixed needs every --auto_budgets option among --runs")
  for run in runs:
    if run == "auto" and args.auto_costs == "fixed":
      costs = tuple(step_s["ar" if b == 0 else str(b)] for b in harness.ints(args.auto_budgets))
    # an engine per level: each starts as a server does (the programs compile once per run)
    for level in levels if run != "ar" else levels[:1]:
      d = bench_drafter.benchmark_drafter(drafter, successor, level.accept, level.confidence,
                                          seed=args.seed)
      engine = engine_for(target, d, run, args, costs)
      if run == "auto":
        costs = engine.costs  # measured once, by the first
      try:
        serve(engine, prompts[concurrency[-1]][:concurrency[-1]], concurrency[-1], 4)  # warm
        for c in concurrency:
          got, acceptance, wall, stats = serve(engine, prompts[c], c, args.max_tokens)
          if run == "ar":
            reference[c] = got
          tokens, steps = sum(map(len, got)), max(stats.get("steps", 0), 1)
          if c == concurrency[-1]:
            step_s[run] = wall / steps
          per_step = [n for a in acceptance for n in a]
          row = dict(base, run=run, level="-" if run == "ar" else level.name,
                     accept=None if run == "ar" else level.accept, concurrency=c,
                     slots=engine.config.slots, requests=len(got),
                     tokens_per_second=tokens / wall, steps=steps,
                     tau=float(np.mean(per_step)) if per_step else 0.0,
                     divergent=sum(a != b for a, b in zip(got, reference[c])),
                     planted=planted.on_path(prompts[c], got, successor))
          if run == "auto":
            row["chosen"] = {int(k.rsplit("_", 1)[1]): v for k, v in stats.items()
                             if k.startswith("steps_budget_") and v}
            row["budget_costs_ms"] = [1e3 * x for x in engine.costs]
          common_flags.keep_row(rows, row, args.json_out)
      finally:
        engine.stop()


def print_tables(rows) -> None:
  print(f"\n({planted.NOTE} The slot engine runs in process, without HTTP.)")
  ar = {r["concurrency"]: r for r in rows if r["run"] == "ar"}
  fixed = list(dict.fromkeys(r["run"] for r in rows if r["run"] not in ("ar", "auto")))
  first = rows[0]
  for level in dict.fromkeys(r["level"] for r in rows if r["run"] != "ar"):
    cell = [r for r in rows if r["level"] == level]
    print(f"\n{first['shape']}, {first['dtype']}, {first['slots']} slots, "
          f"{first['prompt_len']}-token prompts, {first['max_tokens']} new tokens, level "
          f"{level} (accept {cell[0]['accept']:.2f}): tokens/s (tau)")
    print(f"{'C':>4}{'AR':>10}" + "".join(f"{'B=' + f:>15}" for f in fixed)
          + f"{'auto':>15}{'auto/best':>10}{'auto/worst':>11}{'auto/AR':>8}{'div':>5}"
          + "  auto's steps")
    for c in sorted(ar):
      by = {r["run"]: r for r in cell if r["concurrency"] == c}
      tps = [by[f]["tokens_per_second"] for f in fixed if f in by]
      line = f"{c:>4}{ar[c]['tokens_per_second']:>10.1f}" + "".join(
          f"{by[f]['tokens_per_second']:>9.1f} ({by[f]['tau']:>4.2f})" if f in by else f"{'':>15}"
          for f in fixed)
      if "auto" in by:
        a = by["auto"]
        line += (f"{a['tokens_per_second']:>9.1f} ({a['tau']:>4.2f})"
                 + (f"{a['tokens_per_second'] / max(tps):>10.2f}"
                    f"{a['tokens_per_second'] / min(tps):>11.2f}" if tps else f"{'':>21}")
                 + f"{a['tokens_per_second'] / ar[c]['tokens_per_second']:>8.2f}"
                 + f"{sum(r['divergent'] for r in by.values()):>5}  "
                 + ", ".join(f"{'AR' if b == 0 else b} x{n}" for b, n in sorted(a['chosen'].items())))
      print(line)
  print("(tokens/s: every request's tokens over the wall time of the clients' run; tau: a "
        "request's tokens per step, over every request's steps; div: requests whose tokens "
        "differ from AR's)")


def main(_):
  args = common_flags.start(SMOKE)
  rows = []
  import jax  # pylint: disable=import-outside-toplevel
  print(f"device: {jax.devices()[0].device_kind}; drafter: benchmark (not trained)", flush=True)
  bench(args, rows)
  print_tables(rows)


if __name__ == "__main__":
  from ddtree_jax import engine as engine_lib
  engine_lib.define_compilation_cache_flags(default=False)
  app.run(main)
