"""The README's plot: step and round time by method, from bench_step.py's JSON lines.

  python -m experiments.perf.plot_results --rows=experiments/results/X/results.jsonl \
      --out=docs/step_round_h200.png --title="Qwen3-8B shape, one H200, batch 1"

One bar pair per row (AR, chain, DDTree by budget) at the first batch and prefix: the step (a
16-step call's wall time over its steps) and the round (the slope between --steps and
--marginal_steps), and each round's ratio to AR's round printed above its bars.
"""

import json

from absl import app, flags
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position

flags.DEFINE_string("rows", None, "bench_step.py --json_out file (run with --marginal_steps)")
flags.DEFINE_string("out", "docs/step_round_h200.png", "PNG to write")
flags.DEFINE_string("title", "", "plot title")
flags.mark_flag_as_required("rows")
FLAGS = flags.FLAGS


def bars(rows):
  """[(label, step ms, round ms)] of the ar / spec rows that have a round, AR first."""
  timed = [r for r in rows if r.get("section") in ("ar", "spec") and "round_ms" in r]
  if not timed:
    raise app.UsageError(f"{FLAGS.rows}: no ar/spec rows with round_ms (run bench_step.py with "
                         "--marginal_steps)")
  first = timed[0]
  same = [r for r in timed if (r["batch"], r["prefix"]) == (first["batch"], first["prefix"])]
  label = lambda r: ("AR" if r["section"] == "ar" else "chain" if r["method"] == "chain"
                     else f"DDTree B={r['budget']}")
  order = lambda r: (r["section"] != "ar", r.get("method") != "chain", r.get("budget", 0))
  return [(label(r), r["step_ms"], r["round_ms"]) for r in sorted(same, key=order)]


def main(_):
  with open(FLAGS.rows) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  data = bars(rows)
  ar_round = data[0][2]
  fig, ax = plt.subplots(figsize=(8, 4))
  xs = range(len(data))
  ax.bar([x - 0.2 for x in xs], [d[1] for d in data], 0.4, label="step (16-step call / 16)")
  ax.bar([x + 0.2 for x in xs], [d[2] for d in data], 0.4, label="round (per extra step)")
  for x, (_, step, rnd) in zip(xs, data):
    ax.text(x + 0.2, rnd, f"{rnd / ar_round:.2f}x", ha="center", va="bottom", fontsize=8)
  ax.set_xticks(list(xs), [d[0] for d in data])
  ax.set_ylabel("ms")
  ax.set_title(FLAGS.title or "step and round time (x AR's round above the bars)")
  ax.legend(loc="upper left")
  ax.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  fig.savefig(FLAGS.out, dpi=120)
  print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
