"""The MoE plot: decode-loop step time and distinct experts per layer vs budget, from
bench_moe.py's loop rows (one line per batch; AR and chain at the left).

  python -m experiments.perf.plot_moe --rows=experiments/results/moe-2026-12-01/moe_46b8ec1.jsonl \
      --out=docs/moe_step_h200.png
"""

import json

from absl import app, flags
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position

flags.DEFINE_string("rows", None, "bench_moe.py --json_out file")
flags.DEFINE_string("out", "docs/moe_step_h200.png", "PNG to write")
flags.DEFINE_string("title", "Qwen3-30B-A3B shape, one H200, random bf16", "plot title")
flags.mark_flag_as_required("rows")
FLAGS = flags.FLAGS


def order(run: str) -> float:
  """x position: AR, chain, then budgets by size."""
  return {"ar": -2, "chain": -1}[run] if run in ("ar", "chain") else int(run)


def main(_):
  with open(FLAGS.rows) as f:
    rows = [r for r in map(json.loads, f) if r.get("section") == "loop"]
  if not rows:
    raise app.UsageError(f"{FLAGS.rows}: no loop rows (bench_moe.py --sections=loop)")
  labels = sorted({r["run"] for r in rows}, key=order)
  x = {run: i for i, run in enumerate(labels)}
  fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(11, 4))
  for b in sorted({r["batch"] for r in rows}):
    mine = sorted((r for r in rows if r["batch"] == b), key=lambda r: order(r["run"]))
    xs = [x[r["run"]] for r in mine]
    ax_t.plot(xs, [r["step_ms"] for r in mine], "o-", label=f"batch {b}: step")
    ax_t.plot(xs, [r["target_floor_ms"] for r in mine], "x--", label=f"batch {b}: floor")
    ax_e.plot(xs, [r["distinct_per_layer"] for r in mine], "o-", label=f"batch {b}")
  for ax, name in ((ax_t, "ms per step"), (ax_e, "distinct experts per layer (of 128)")):
    ax.set_xticks(range(len(labels)), [f"B={v}" if v not in ("ar", "chain") else v
                                       for v in labels])
    ax.set_ylabel(name)
    ax.grid(alpha=0.3)
    ax.legend()
  ax_t.set_ylim(bottom=0)
  ax_e.set_ylim(0, 132)
  fig.suptitle(FLAGS.title)
  fig.tight_layout()
  fig.savefig(FLAGS.out, dpi=120)
  print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
