"""The serving plot: tokens/s and time to first token (p50) against concurrency, one line per
server (AR, chain, DDTree budgets), from the HTTP rows of run_serve_h200.sh's serve.jsonl.

  python -m experiments.perf.plot_serving \
      --rows=experiments/results/serving-2026-12-01/h200/serve.jsonl --out=docs/serving_h200.png

Rows labelled "MODEL:RUN/SLOTS" (run_serve_h200.sh since 2026-12-02) are kept when MODEL is
--model; plain labels (ar, chain, a budget: the 2026-12-01 rows) always are.
"""

import json

from absl import app, flags
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position

flags.DEFINE_string("rows", None, "http_bench.py --json_out file")
flags.DEFINE_string("out", "docs/serving_h200.png", "PNG to write")
flags.DEFINE_string("title", "bundled pair over HTTP, one H200, 32 slots, 64 tokens a request",
                    "plot title")
flags.DEFINE_string("model", "pair", "the MODEL part of MODEL:RUN/SLOTS labels to plot")
flags.mark_flag_as_required("rows")
FLAGS = flags.FLAGS


def split(label: str) -> tuple[str, str, str]:
  """"pair:16/32" -> ("pair", "16", "32"); "16" -> ("", "16", "")."""
  model, _, rest = label.rpartition(":")
  run, _, slots = rest.partition("/")
  return model, run, slots


def name(label: str) -> str:
  _, run, slots = split(label)
  run = run if run in ("ar", "chain") else f"DDTree B={run}"
  return f"{run}, {slots} slots" if slots else run


def main(_):
  with open(FLAGS.rows) as f:
    rows = [r for r in map(json.loads, f) if r.get("mode") == "http"
            and split(r["label"])[0] in ("", FLAGS.model)]
  if not rows:
    raise app.UsageError(f"{FLAGS.rows} has no HTTP rows of model {FLAGS.model!r}")
  fig, (ax_tps, ax_ttft) = plt.subplots(1, 2, figsize=(10, 4))
  for label in dict.fromkeys(r["label"] for r in rows):
    mine = sorted((r for r in rows if r["label"] == label), key=lambda r: r["concurrency"])
    c = [r["concurrency"] for r in mine]
    ax_tps.plot(c, [r["tokens_per_second"] for r in mine], marker="o", label=name(label))
    ax_ttft.plot(c, [r["ttft_p50_ms"] for r in mine], marker="o", label=name(label))
  for ax, ylabel in ((ax_tps, "tokens / s (all requests)"), (ax_ttft, "time to first token p50, ms")):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
  ax_tps.legend()
  fig.suptitle(FLAGS.title)
  fig.tight_layout()
  fig.savefig(FLAGS.out, dpi=120)
  print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
