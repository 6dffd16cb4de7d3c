"""run_serve_h200.sh's helpers on made-up rows: the summary pairs each HTTP row at concurrency 1
with its model's in-process row and reads the engine's counters; the plot keeps one model's
servers (and the older plain labels). The script itself is dry-run on CPU with SMALL=1
(experiments/results/serving-2026-12-02/NOTES.md)."""

import json
import os
import subprocess
import sys

import pytest

from experiments.perf import serve_summary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _http(label, conc, tps, ttft=5.0):
  return {"label": label, "mode": "http", "concurrency": conc, "requests": 8,
          "tokens_per_second": tps, "ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft,
          "tpot_ms": 0.5, "acceptance_length": 1.0}


ROWS = [_http("8b:ar/1", 1, 190.0), _http("8b:ar/4", 1, 180.0), _http("8b:ar/4", 4, 700.0),
        _http("pair:16/32", 1, 4000.0), _http("16", 1, 3000.0),
        {"label": "8b:ar", "mode": "in_process", "concurrency": 1, "tokens_per_second": 200.0},
        {"label": "8b:64", "mode": "in_process", "concurrency": 1, "tokens_per_second": 150.0}]


def test_the_summary_sets_each_server_against_its_in_process_run():
  health = [{"label": "8b:ar/1", "chunks": 4, "alone_chunks": 3, "steps": 64, "launch_s": 0.002,
             "wait_s": 1.0, "host_s": 0.004, "tokens": 512}]
  text = serve_summary.tables(ROWS, health)
  goal = text.split("\n\n")[0].splitlines()
  assert goal[2].split() == ["8b:ar/1", "190.0", "200.0", "0.950", "5.0", "0.50", "1.00"]
  assert goal[3].split()[:4] == ["8b:ar/4", "180.0", "200.0", "0.900"]
  assert goal[4].split()[:4] == ["pair:16/32", "4000.0", "-", "-"]  # no in-process row
  assert "(in-process only: 8b:64)" in text
  counters = text.split("\n\n")[2].splitlines()[2].split()
  assert counters == ["8b:ar/1", "4", "3", "16.0", "0.50", "250.00", "1.00", "0.00", "512"]


def test_the_plot_keeps_one_models_servers(tmp_path):
  def plot(rows, model):
    path = tmp_path / "serve.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = tmp_path / f"{model}.png"
    proc = subprocess.run([sys.executable, "-m", "experiments.perf.plot_serving",
                           f"--rows={path}", f"--out={png}", f"--model={model}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr, png
  for model in ("pair", "8b"):
    rc, out, png = plot(ROWS, model)
    assert rc == 0 and png.stat().st_size > 1000, out[-2000:]
  rc, out, _ = plot([r for r in ROWS if ":" in r["label"]], "none")
  assert rc != 0 and "no HTTP rows of model 'none'" in out


def test_the_in_process_runs_name_auto_and_refuse_anything_else():
  from experiments import http_bench  # pylint: disable=import-outside-toplevel
  assert http_bench.parse_runs("ar,chain,16,auto,") == [
      ("ar", 0), ("chain", 0), ("ddtree", 16), ("ddtree", "auto")]
  with pytest.raises(ValueError, match="'b16' is not ar, chain"):
    http_bench.parse_runs("ar,b16")
