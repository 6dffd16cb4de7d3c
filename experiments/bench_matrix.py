"""Benchmark matrix: methods (ar, chain, ddtree) x budgets x concurrency (batch), one run.

  python -m experiments.bench_matrix --config=configs/bench_smoke.py      # CPU, ~1 min
  python -m experiments.bench_matrix --config=configs/bench_matrix.py     # GPU, Qwen3-8B shape
  python -m experiments.bench_matrix --config=configs/bench_matrix.py --config.budgets=64,256 \
      --config.batches=1 --mesh_tp=8

Per batch, every program of the matrix is compiled first (`compile_threads` at a time: GPU compiles
run on the host and take 10-25 s each). Per cell (batch, method, budget): tokens/s (median of
`repeats` timed runs after one warm-up run; compile, warm-up and prefill seconds reported
separately), tau (mean acceptance length), steps, speed-up vs AR and vs chain of the same batch in
the same run, per-stage step times (draft, tree, verify, accept+commit, each its own program, on a
prefill state of the same prompts: `profile`), and the divergence from AR: for every sequence whose
tokens differ from AR's, the target's top-1 minus top-2 logit gap at the first differing position
(on the AR prefix, dj.forward_logits); a divergence is a near-tie when the gap < near_tie_eps
(expected in bf16 only; in float32 every method must equal AR). Writes bench.csv, bench.json and
PNG plots to out_dir, and each row to rows.jsonl as soon as it is measured
(`--plot_from=OUT/rows.jsonl` prints the table and plots of a run cut short).
The last line printed is one JSON object {"results": [...]}.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import subprocess
import sys
import time

import numpy as np
from absl import flags

from ddtree_jax.checkpoints import files as ddfiles
from experiments import workflow

CSV_FIELDS = ("batch", "method", "budget", "dtype", "attention", "prompt_tokens", "max_new_tokens",
              "tokens_per_second", "tokens_per_second_min", "tokens_per_second_max",
              "speedup_vs_ar", "speedup_vs_chain", "tau", "steps", "new_tokens", "step_ms",
              "draft_ms", "tree_ms", "verify_ms", "accept_commit_ms", "stages_ms",
              "decode_seconds", "prefill_seconds", "compile_seconds", "warmup_seconds",
              "identical_to_ar", "divergent_seqs", "near_tie_divergences", "min_divergence_gap",
              "chosen", "expected_per_drafted_step", "accepted_per_drafted_step")


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def stage_ms(cfg, target, drafter, prompts, method, budget) -> dict:
  """Per-stage times (ms) of one step on the prefill state of `prompts`, each stage compiled on
  its own (ddtree_jax.tools.profiling.stage_seconds), with the loop config `generate` would use."""
  from ddtree_jax import engine
  from ddtree_jax.tools import profiling  # pylint: disable=import-outside-toplevel
  dcfg = drafter.config if method != "ar" else None
  dparams = drafter.params if method != "ar" else None
  state, lc = engine.prefill_state(target, prompts,
                                   **workflow.generate_kwargs(cfg, method, budget, drafter))
  sec = profiling.stage_seconds(target.params, target.config, dparams, dcfg, lc, state,
                                repeats=cfg.profile_repeats)
  out = {f"{k}_ms": v * 1e3 for k, v in sec.items()}
  out["stages_ms"] = sum(out.values())
  return out


def divergences(target, prompts, reference, tokens, eps: float) -> dict:
  """Sequences of `tokens` that differ from `reference` (AR), with the target's top-1 minus top-2
  logit gap at the first differing position, computed on the AR prefix by a plain forward."""
  import ddtree_jax as dj  # pylint: disable=import-outside-toplevel
  gaps, positions = [], []
  for p, ref, out in zip(prompts, reference, tokens):
    n = min(len(ref), len(out))
    first = next((i for i in range(n) if ref[i] != out[i]), None)
    if first is None:
      if len(ref) == len(out):
        continue
      first = n
    prefix = list(p) + list(ref[:first])
    ids = np.zeros((1, _round_up(len(prefix), 128)), np.int32)  # causal: padding is inert
    ids[0, :len(prefix)] = prefix
    logits = np.asarray(dj.forward_logits(target, ids)[0, len(prefix) - 1], np.float64)
    top2 = np.sort(logits)[-2:]
    gaps.append(float(top2[1] - top2[0]))
    positions.append(first)
  return {"divergent_seqs": len(gaps), "near_tie_divergences": sum(g < eps for g in gaps),
          "min_divergence_gap": min(gaps) if gaps else None, "divergence_gaps": gaps,
          "divergence_positions": positions}


def _median_stat(results, key):
  return float(np.median([r.stats[key] for r in results]))


def run(cfg, mesh=None) -> dict:
  """Runs the whole matrix of `cfg`; writes CSV / JSON / PNGs; returns {"rows", "files"}."""
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  import ddtree_jax as dj  # pylint: disable=import-outside-toplevel
  plan = workflow.validate(cfg)
  t_start = time.perf_counter()
  if os.path.exists(os.path.join(cfg.out_dir, "rows.jsonl")):
    os.remove(os.path.join(cfg.out_dir, "rows.jsonl"))
  target, drafter = workflow.load_models(cfg, mesh)
  if cfg.random_target or cfg.random_drafter:
    print(f"note: random weights (target: {cfg.random_target}, drafter: {cfg.random_drafter}); "
          "step times are real, acceptance is not", flush=True)
  rows = []
  bar = tqdm(total=len(plan.batches) * len(plan.runs) * (cfg.repeats + 1), desc="bench",
             unit="run", disable=not cfg.progress, file=sys.stderr, dynamic_ncols=True)
  for batch in plan.batches:
    prompts = workflow.make_prompts(cfg, target, batch)
    bar.set_postfix_str(f"batch {batch}: compiling {len(plan.runs)} programs")
    kws = [workflow.generate_kwargs(cfg, m, b, drafter) for m, b in plan.runs]
    compile_s = dj.compile_many(target, [(prompts, kw) for kw in kws], cfg.compile_threads)
    reference, cell = None, []
    for (method, budget), kw, c_s in zip(plan.runs, kws, compile_s):
      name = workflow.Plan.name(method, budget)
      bar.set_postfix_str(f"batch {batch} {name}")
      t0 = time.perf_counter()
      dj.generate(target, prompts, **kw)  # warm-up; excluded from the timings
      warmup_s = time.perf_counter() - t0
      bar.update()
      timed = []
      for _ in range(cfg.repeats):
        timed.append(dj.generate(target, prompts, **kw))
        bar.update()
      res = timed[-1]
      tps = [r.stats["tokens_per_second"] for r in timed]
      steps = res.stats["steps"]
      decode_s = _median_stat(timed, "decode_seconds")
      row = {
          "batch": batch, "method": method, "budget": budget, "dtype": cfg.dtype,
          "attention": res.stats["attention"],
          "prompt_tokens": float(np.mean([len(p) for p in prompts])),
          "max_new_tokens": cfg.max_new_tokens, "tokens_per_second": float(np.median(tps)),
          "tokens_per_second_min": min(tps), "tokens_per_second_max": max(tps),
          "tau": res.stats["tau"], "steps": steps, "new_tokens": sum(len(t) for t in res.tokens),
          "step_ms": decode_s / steps * 1e3 if steps else None, "decode_seconds": decode_s,
          "prefill_seconds": _median_stat(timed, "prefill_seconds"),
          "compile_seconds": c_s, "compile_threads": cfg.compile_threads,
          "warmup_seconds": warmup_s,
          "acceptance_lengths": [a for seq in res.stats["acceptance_lengths"] for a in seq],
          **workflow.auto_summary(res),
      }
      if method == "ar":
        reference = res.tokens
      elif reference is not None and cfg.temperature == 0:  # sampled runs differ by design
        row["identical_to_ar"] = res.tokens == reference
        row.update(divergences(target, prompts, reference, res.tokens, cfg.near_tie_eps))
      if method in plan.profile and (method == "ar" or drafter is not None):
        bar.set_postfix_str(f"batch {batch} {name} stages")
        row.update(stage_ms(cfg, target, drafter, prompts, method, budget))
      cell.append(row)
      _append_jsonl(cfg.out_dir, row)  # a run cut short keeps what it measured
    rows += add_speedups(cell)
  bar.close()
  meta = _meta(cfg, target, drafter, time.perf_counter() - t_start)
  files = write_outputs(cfg, rows, meta)
  print_table(rows)
  for f in files:
    print(f"wrote {f}")
  return {"rows": rows, "files": files, "meta": meta}


def add_speedups(rows) -> list[dict]:
  """Sets speedup_vs_ar / speedup_vs_chain: tokens/s over the same batch's AR / chain row."""
  for r in rows:
    for m in ("ar", "chain"):
      v = next((b["tokens_per_second"] for b in rows
                if b["batch"] == r["batch"] and b["method"] == m), None)
      r[f"speedup_vs_{m}"] = r["tokens_per_second"] / v if v else None
  return rows


def load_rows(path) -> tuple[list[dict], dict | None]:
  """(rows, meta) of a finished run's bench.json or of a cut run's rows.jsonl (no meta)."""
  with open(path) as f:
    if path.endswith(".jsonl"):
      return add_speedups([json.loads(line) for line in f if line.strip()]), None
    data = json.load(f)
  return data["rows"], data["meta"]


def _meta(cfg, target, drafter, seconds) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  try:
    # "-dirty" when the tree differs from HEAD (e.g. a copy whose git metadata is older)
    commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                            cwd=workflow.REPO, capture_output=True, text=True,
                            timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    commit = ""
  dev = jax.devices()[0]
  return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit,
          "jax": jax.__version__, "platform": dev.platform,
          "device": getattr(dev, "device_kind", str(dev)), "num_devices": jax.device_count(),
          "target": target.path, "drafter": getattr(drafter, "path", None),
          "random_target": bool(cfg.random_target), "random_drafter": bool(cfg.random_drafter),
          "block_size": drafter.config.block_size if drafter else None, "seconds": seconds}


def _append_jsonl(out_dir, row) -> None:
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "rows.jsonl"), "a") as f:
    f.write(json.dumps(row, default=str) + "\n")


def write_outputs(cfg, rows, meta) -> list[str]:
  os.makedirs(cfg.out_dir, exist_ok=True)
  csv_path = os.path.join(cfg.out_dir, "bench.csv")
  with ddfiles.atomic_write(csv_path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
      w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_FIELDS})
  json_path = os.path.join(cfg.out_dir, "bench.json")
  ddfiles.write_json(json_path, {"meta": meta, "config": cfg.to_dict(), "rows": rows}, indent=1,
                     default=str)
  try:
    return [csv_path, json_path] + plot(rows, cfg.out_dir, meta)
  except ImportError as e:  # e.g. a GPU machine without matplotlib: redraw with --plot_from
    print(f"no plots ({e}); redraw later: bench_matrix.py --plot_from={json_path}", flush=True)
    return [csv_path, json_path]


def plot(rows, out_dir, meta=None) -> list[str]:
  """tokens/s vs budget per concurrency, tau vs budget, speed-up vs budget, acceptance histogram."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.ticker  # pylint: disable=import-outside-toplevel
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  batches = sorted({r["batch"] for r in rows})
  title = ""
  if meta:
    title = f"{os.path.basename(str(meta.get('target')))} on {meta.get('device')}"
    rand = [k for k in ("target", "drafter") if meta.get(f"random_{k}")]
    if rand:
      title += f" (random {' + '.join(rand)} weights)"
  ddt = lambda b: sorted((r for r in rows if r["batch"] == b and r["method"] == "ddtree"
                          and r["budget"] != "auto"), key=lambda r: r["budget"])
  base = lambda b, m: next((r for r in rows if r["batch"] == b and (
      r["method"] == m or m == "auto" and r["budget"] == "auto")), None)
  files = []

  def per_batch(key, ylabel, fname):
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.4), squeeze=False)
    for ax, b in zip(axes[0], batches):
      d = ddt(b)
      if d:
        ax.plot([r["budget"] for r in d], [r[key] or 0 for r in d], "o-", label="ddtree")
        ax.set_xscale("log", base=2)
      for m, style, color in (("ar", ":", "gray"), ("chain", "--", "tab:orange"),
                              ("auto", "-.", "tab:green")):
        r = base(b, m)
        if r is not None and r.get(key) is not None:
          ax.axhline(r[key], linestyle=style, color=color, label=m)
      ax.set_title(f"batch {b}")
      ax.set_xlabel("budget (tree nodes)")
      ax.set_ylabel(ylabel)
      ax.grid(alpha=0.3)
      ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, fname)
    ddfiles.save_figure(fig, path, dpi=110)
    plt.close(fig)
    files.append(path)

  per_batch("tokens_per_second", "tokens / s (decode)", "tokens_per_second.png")
  per_batch("speedup_vs_ar", "speed-up vs AR", "speedup.png")

  fig, ax = plt.subplots(figsize=(5, 3.6))
  for b in batches:
    d = ddt(b)
    line = ax.plot([r["budget"] for r in d], [r["tau"] for r in d], "o-", label=f"ddtree, batch {b}")
    ch = base(b, "chain")
    if ch is not None:
      ax.axhline(ch["tau"], linestyle="--", color=line[0].get_color() if line else None,
                 label=f"chain, batch {b}")
  if any(ddt(b) for b in batches):
    ax.set_xscale("log", base=2)
  ax.set_xlabel("budget (tree nodes)")
  ax.set_ylabel("tau (tokens per step)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  path = os.path.join(out_dir, "tau.png")
  ddfiles.save_figure(fig, path, dpi=110)
  plt.close(fig)
  files.append(path)

  b0 = batches[0]
  spec = [r for r in rows if r["batch"] == b0 and r["method"] != "ar" and r["acceptance_lengths"]]
  fig, ax = plt.subplots(figsize=(5.5, 3.6))
  hi = max([max(r["acceptance_lengths"]) for r in spec] + [2])
  bins = np.arange(0.5, hi + 1.5)
  for r in spec:
    ax.hist(r["acceptance_lengths"], bins=bins, histtype="step", density=True, linewidth=1.5,
            label=workflow.Plan.name(r["method"], r["budget"]) + f" (tau {r['tau']:.2f})")
  ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
  ax.set_xlabel("acceptance length per step (root included)")
  ax.set_ylabel("fraction of steps")
  ax.set_title(f"acceptance lengths, batch {b0}", fontsize=9)
  ax.grid(alpha=0.3)
  if spec:
    ax.legend(fontsize=7)
  fig.tight_layout()
  path = os.path.join(out_dir, "acceptance_hist.png")
  ddfiles.save_figure(fig, path, dpi=110)
  plt.close(fig)
  files.append(path)
  return files


def _fmt(v, spec):
  return "-" if v is None else format(v, spec)


def print_table(rows) -> None:
  print(f"\n{'batch':>5} {'run':<12}{'tok/s':>10}{'xAR':>7}{'xchain':>7}{'tau':>7}{'steps':>6}"
        f"{'step ms':>9}{'draft':>8}{'tree':>8}{'verify':>8}{'commit':>8}{'compile s':>10}"
        f"{'div(tie)':>9}")
  for r in rows:
    div = "-" if "divergent_seqs" not in r else f"{r['divergent_seqs']}({r['near_tie_divergences']})"
    print(f"{r['batch']:>5} {workflow.Plan.name(r['method'], r['budget']):<12}"
          f"{r['tokens_per_second']:>10.1f}{_fmt(r.get('speedup_vs_ar'), '.2f'):>7}"
          f"{_fmt(r.get('speedup_vs_chain'), '.2f'):>7}{r['tau']:>7.2f}{r['steps']:>6}"
          f"{_fmt(r.get('step_ms'), '.3f'):>9}{_fmt(r.get('draft_ms'), '.3f'):>8}"
          f"{_fmt(r.get('tree_ms'), '.3f'):>8}{_fmt(r.get('verify_ms'), '.3f'):>8}"
          f"{_fmt(r.get('accept_commit_ms'), '.3f'):>8}{r['compile_seconds']:>10.2f}{div:>9}")
  print("(tok/s: median of the timed runs, compile excluded; stage times: each stage its own "
        "program; div(tie): sequences differing from AR (of which near-ties))")


def main(_):
  from ddtree_jax import sharding  # pylint: disable=import-outside-toplevel
  if _PLOT_FROM.value:  # table + plots of an earlier run (e.g. one from a GPU machine)
    rows, meta = load_rows(_PLOT_FROM.value)
    print_table(rows)
    for path in plot(rows, os.path.dirname(_PLOT_FROM.value), meta):
      print(f"wrote {path}")
    return
  if _CONFIG.value.endpoint:  # any OpenAI-compatible server, measured over HTTP
    from experiments import http_bench  # pylint: disable=import-outside-toplevel
    http_bench.run(_CONFIG.value)
    return
  out = run(_CONFIG.value, sharding.mesh_from_flags())
  keep = ("batch", "method", "budget", "tau", "tokens_per_second", "speedup_vs_ar",
          "speedup_vs_chain", "divergent_seqs", "near_tie_divergences")
  print(json.dumps({"results": [{k: r.get(k) for k in keep} for r in out["rows"]]}))


if __name__ == "__main__":
  from ddtree_jax import sharding as _sharding
  _CONFIG = workflow.define_config("configs/bench_smoke.py")
  _sharding.define_mesh_flags()
  _PLOT_FROM = flags.DEFINE_string("plot_from", "",
                                    "only print the table and draw the plots of this bench.json "
                                    "(or the rows.jsonl of a run cut short)")
  workflow.run_app(main)
