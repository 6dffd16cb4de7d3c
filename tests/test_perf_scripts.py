"""The performance scripts of experiments/perf/ on their tiny CPU settings, each run as its own
process from the repository root (`python -m experiments.perf.NAME`, as documented)."""

import json
import os
import subprocess
import sys

import pytest

from experiments.perf import kimi_paper

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(name, *args, ok=True):
  """Runs experiments/perf/NAME.py with args; returns (returncode, stdout + stderr)."""
  proc = subprocess.run([sys.executable, "-m", f"experiments.perf.{name}", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=900)
  out = proc.stdout + proc.stderr
  if ok:
    assert proc.returncode == 0, out[-3000:]
  return proc.returncode, out


def read_rows(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def assert_floored(rows, prefix=""):
  """Each row carries its floors, at the measured bandwidth and at the spec's (None on a CPU),
  and none is below its floor (a run with one would have failed)."""
  for r in rows:
    assert r[prefix + "floor_ms"] > 0 and r[prefix + "below_floor"] is False, r
    assert r[prefix + "ratio_to_floor"] >= 1 and r[prefix + "ratio_to_spec_floor"] is None, r


def assert_bandwidth_row(row):
  """The floors' bandwidth row: the best of the probes this run measured."""
  assert row["section"] == "bandwidth" and row["spec_GBps"] is None and row["device"] == "cpu"
  assert row["bandwidth_GBps"] == max(row["probes_GBps"].values()) > 0


def test_bench_step_small_rows(tmp_path):
  """AR and chain / DDTree rows with their round (slope) and per-call cost, the int8 drafter
  over a draft vocabulary, stage times of one run."""
  out = tmp_path / "step.jsonl"
  _, text = run_script("bench_step", "--small", "--sections=copy,ar,spec", "--batches=1",
             "--prefixes=64", "--spec_prefixes=64", "--budgets=chain,8", "--stage_runs=8",
             "--steps=4", "--marginal_steps=8", "--repeats=1", "--drafters=int8:v256",
             "--attention=xla", f"--json_out={out}")
  rows = read_rows(out)
  assert [r["section"] for r in rows] == ["bandwidth", "ar", "spec", "spec"]  # copy: its old name
  assert_bandwidth_row(rows[0])
  ar, chain, tree = rows[1:]
  assert_floored([ar])
  assert {"round_ms", "per_call_ms"} <= set(ar)  # (noisy on CPU)
  assert "floor bandwidth " in text and "x spec" in text
  assert (chain["method"], tree["method"], tree["budget"]) == ("chain", "ddtree", 8)
  assert tree["drafter"] == "int8:v256" and "vs_ar_round" in tree
  assert "verify_ms" in tree and "verify_ms" not in chain  # --stage_runs=8 only
  png = tmp_path / "rounds.png"
  run_script("plot_results", f"--rows={out}", f"--out={png}")
  assert png.stat().st_size > 1000
  code, text = run_script("bench_step", "--small", "--steps=8", "--marginal_steps=8", ok=False)
  assert code != 0 and "must exceed" in text


def test_bench_gdn_and_a_hybrid_step_small_rows(tmp_path):
  """The tree's recurrent part per budget on each rule (one Gated DeltaNet layer, its floor the
  weights and the state in and out), and a hybrid shape's AR step against a floor that counts
  the states."""
  out = tmp_path / "gdn.jsonl"
  # At these widths a layer sits in the CPU's caches, within noise of a floor at the CPU's probed
  # bandwidth: a given one far above it (floors near 0: a slope <= 0 still fails), and a slope
  # over 32 layers, medians of 3, that a loaded CPU does not push under it
  run_script("bench_gdn", "--small", "--budgets=0,8", "--batches=1", "--repeats=3", "--stack=32",
             "--floor_bandwidth=1e14", f"--json_out={out}")
  bandwidth, *rows = read_rows(out)
  assert (bandwidth["section"], bandwidth["bandwidth_GBps"]) == ("bandwidth", 1e5)
  assert bandwidth["probes_GBps"] == {}  # given: no probes
  assert [(r["budget"], r["nodes"], r["rule"]) for r in rows] == [
      (0, 1, "xla"), (0, 1, "pallas"), (8, 9, "xla"), (8, 9, "pallas")]
  assert all(r["layers"] == 3 for r in rows)
  assert_floored(rows)
  code, text = run_script("bench_gdn", "--small", "--shape=qwen3-8b", ok=False)
  assert code != 0 and "no Gated DeltaNet layers" in text
  code, text = run_script("bench_gdn", "--small", "--rules=xla,mosaic", ok=False)
  assert code != 0 and "unknown ['mosaic']" in text
  step = tmp_path / "step.jsonl"
  run_script("bench_step", "--small", "--shape=qwen3.5-9b", "--sections=ar", "--batches=1",
             "--prefixes=64", "--steps=4", "--repeats=1", "--attention=xla",
             f"--json_out={step}")
  (ar,) = [r for r in read_rows(step) if r["section"] == "ar"]
  assert ar["shape"] == "qwen3.5-9b"
  assert_floored([ar])


def test_bench_moe_small_rows_and_plot(tmp_path):
  """The MoE benchmark's sections on the tiny MoE shape, its loop rows with distinct experts,
  and the plot drawn from them."""
  out = tmp_path / "moe.jsonl"
  run_script("bench_moe", "--small", "--attention=xla", "--repeats=1", "--steps=2", "--tokens=1,9",
             "--impls=xla,pairs:16x16x16", "--verify_tokens=3", "--loop_runs=1:ar,4",
             "--compile_threads=2", f"--json_out={out}")
  rows = read_rows(out)
  assert [r["section"] for r in rows] == ["bandwidth", "verify"] + ["experts"] * 4 + ["loop"] * 2
  assert_bandwidth_row(rows[0])
  assert_floored(rows[1:6])
  ar, tree = rows[-2:]
  assert (ar["run"], ar["verify_tokens"], tree["run"], tree["verify_tokens"]) == ("ar", 1, "4", 5)
  assert 1 <= ar["distinct_per_layer"] <= tree["distinct_per_layer"]
  assert_floored([ar, tree], prefix="target_")
  assert tree["step_ms"] > 0
  png = tmp_path / "moe.png"
  run_script("plot_moe", f"--rows={out}", f"--out={png}")
  assert png.stat().st_size > 1000


def test_kimi_paper_extrapolates_the_slice_rows(tmp_path):
  """The Kimi-K2 slice's 4- and 2-layer forwards give one row per T, AR first (x AR 1), at the
  rows' bandwidth row where they have one (and refused with a row below its floor); the
  busiest device's share of d random experts is d when one device holds all, the whole layer's
  48 when all 384 are touched, at least d / 8 otherwise."""
  rows = os.path.join(REPO, "experiments/results/mla-2026-12-02/kimi.jsonl")
  measured = tmp_path / "kimi.jsonl"
  head = {"section": "bandwidth", "bandwidth_GBps": 4300.0, "spec_GBps": 4800.0}
  measured.write_text(json.dumps(head) + "\n" + open(rows).read())
  _, text = run_script("kimi_paper", f"--rows={measured}")
  assert "floors at 4300 GB/s, the rows' bandwidth row; spec 4800 GB/s" in text
  first = next(l.split() for l in text.splitlines() if l.split()[:1] == ["1"])
  assert float(first[4]) == pytest.approx(float(first[3]) * 4800 / 4300, abs=0.01)  # x spec
  below = dict(json.loads(open(rows).readline()), below_floor=True, ratio_to_floor=0.9)
  measured.write_text(json.dumps(below) + "\n" + open(rows).read())
  code, text = run_script("kimi_paper", f"--rows={measured}", ok=False)
  assert code == 1 and "BELOW FLOOR" in text
  _, text = run_script("kimi_paper", f"--rows={rows}")
  assert "--bandwidth (the rows have no bandwidth row)" in text  # rows of before floors.py
  lines = [l.split() for l in text.splitlines() if l.strip() and l.split()[0].isdigit()]
  assert [int(l[0]) for l in lines] == [1, 9, 17, 33, 65]
  assert all(l[4] == "-" for l in lines)  # x spec: no spec bandwidth in those rows
  assert lines[0][6] == "1.00" and lines[0][9] == "1.00"
  assert all(float(l[8]) < float(l[5]) for l in lines)  # 8 GPUs beat one at every T
  assert kimi_paper.busiest_share(5, 384, 1, draws=10) == 5
  assert kimi_paper.busiest_share(384, 384, 8, draws=10) == 48
  assert 40 / 8 <= kimi_paper.busiest_share(40, 384, 8, draws=200) < 40


def test_bench_kimi_share_small_rows(tmp_path):
  """One GPU's Kimi K2.6 share on the tiny shape (XLA's kernels): AR and B=8 at two layer counts,
  their fit to the whole model's 61 layers, and the 8-GPU deployment on paper with the winner."""
  out = tmp_path / "share.jsonl"
  _, text = run_script("bench_kimi_share", "--small", "--attention=xla", "--batches=1",
                       f"--json_out={out}")
  rows = read_rows(out)
  assert [r["section"] for r in rows] == ["bandwidth"] + ["share"] * 4 + ["fit"] * 2 + ["paper"] * 2
  assert_bandwidth_row(rows[0])
  share = rows[1:5]
  assert_floored(share)
  assert [(r["layers"], r["run"]) for r in share] == [(2, "ar"), (2, "B=8"), (3, "ar"),
                                                      (3, "B=8")]
  for r in share:  # 3 of the tiny shape's 24 experts held, top-8
    assert 0 < r["experts_router"] <= 3 and 0 < r["experts_uniform"] <= 3 and r["step_ms"] > 0
  assert share[1]["bytes_GB"] > share[0]["bytes_GB"] and share[3]["bytes_GB"] > share[1]["bytes_GB"]
  fit, paper = rows[5:7], rows[7:]
  assert all(r["layers"] == 61 and r["bytes_GB"] > share[3]["bytes_GB"] for r in fit)
  ar, tree = paper
  assert (ar["tau_lo"], tree["tau_lo"], tree["tau_assumed"]) == (1.0, 4.48, False)
  assert tree["comm_ms"] > ar["comm_ms"] > 0 and tree["step_ms"] > tree["share_ms"]
  assert abs(tree["tok_s_lo"] - 4.48 / tree["step_ms"] * 1e3) < 1e-6
  assert "batch 1: " in text and " wins, " in text


def test_profile_step_small_and_its_overrides():
  _, text = run_script("profile_step", "--small", "--runs=ar,8", "--steps=4", "--top=5",
                       "--qkv_splits=0", "--residual=num_warps=4")
  assert "== ar: step" in text and "== ddtree B=8: step" in text
  assert "stage (named scope)" in text and "residual_warps=4" in text
  code, text = run_script("profile_step", "--small", "--tree_attention=block_n=8", ok=False)
  assert code != 0 and "unknown names" in text


def test_attention_scripts_smoke(tmp_path):
  _, text = run_script("bench_attention", "--smoke")
  assert "median xla/pallas time ratio" in text
  assert "floor bandwidth " in text and "median pallas time / its floor" in text
  out = tmp_path / "sweep.jsonl"
  run_script("sweep_attention", "--smoke", f"--json_out={out}")
  rows = read_rows(out)
  assert [r["tokens"] for r in rows] == [4, 9]
  for r in rows:
    assert "{},{}".format(*r["default"]) in r["times_us"] and len(r["times_us"]) >= 2
    assert all(v > 0 for v in r["times_us"].values())


def test_bench_residual_smoke():
  _, text = run_script("bench_residual", "--smoke")
  assert "KernelTuning's pick" in text and text.count("down") >= 2


def test_bench_gemm_smoke(tmp_path):
  out = tmp_path / "gemm.jsonl"
  run_script("bench_gemm", "--smoke", "--forms=flat,model,sbt", f"--json_out={out}")
  rows = read_rows(out)
  want = {(m, form) for m in (1, 5) for form in ("flat", "model", "sbt")}
  assert {(r["rows"], r["form"]) for r in rows} == want
  assert all(r["us"] > 0 for r in rows)
  formats = tmp_path / "formats.jsonl"
  run_script("bench_gemm", "--smoke", "--formats=bf16,w8,w8a8,w8a8t,fp8", "--gemms=o",
             f"--json_out={formats}")
  rows = read_rows(formats)
  err = {r["format"]: max(x["err"] for x in rows if x["format"] == r["format"]) for r in rows}
  assert err["bf16"] < 1e-2 and err["w8"] < 3e-2 and err["w8a8"] < 3e-2 and err["fp8"] < 1e-1
  assert err["w8a8t"] == err["w8a8"]  # the same numbers, stored K-major


def test_bench_gemm_forms_compute_the_same_layer():
  """bench_gemm.py times the decoder's projections against the layout they had before (stacked
  k/v, gate/up axis first): both must be the same layer, or the table is moot. Its own process:
  bench_gemm's --rows flag is also kimi_paper's."""
  code = """
import jax.numpy as jnp, numpy as np
from ddtree_jax.models import decoder, ops
from experiments.perf import bench_gemm
rng = np.random.default_rng(0)
d, nq, nkv, dh, f, t = 32, 4, 2, 8, 48, 5
w = lambda *s: jnp.asarray(rng.normal(size=s) * s[0] ** -0.5, jnp.float32)
layer = decoder.LayerParams(input_norm=w(d) + 1, wq=w(d, nq, dh), wkv=w(d, 2, nkv, dh),
                            wo=w(nq, dh, d), q_norm=w(dh) + 1, k_norm=w(dh) + 1,
                            post_norm=w(d) + 1, w_gate_up=w(d, 2, f), w_down=w(f, d))
x = w(1, t, d)
cfg = bench_gemm.layer_config(d, f, nq, nkv, dh)
cos, sin = ops.rope_tables(cfg, jnp.arange(t)[None], jnp.float32)
new = bench_gemm.model_layer_step(x, layer, cos, sin, cfg=cfg, form="model")
old = bench_gemm.model_layer_step(x, layer, cos, sin, cfg=cfg, form="sbt")
np.testing.assert_allclose(np.asarray(new), np.asarray(old), rtol=1e-5, atol=1e-5)
assert float(jnp.abs(new - x).max()) > 0.1  # the layer did something
print("same layer")
"""
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                        timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0 and "same layer" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_bench_load_writes_a_sharded_int4_checkpoint_and_loads_it(tmp_path):
  """The tiny kimi_k25 checkpoint in several shards (an index), loaded over an ep mesh of 8 CPU
  devices: the row's bytes and the experts it held."""
  ckpt, out = tmp_path / "ckpt", tmp_path / "rows.jsonl"
  run_script("bench_load", "--small", f"--dir={ckpt}", "--shard_gb=0.00005", "--ep=8",
             f"--json_out={out}")
  (row,) = read_rows(out)
  assert row["shards"] > 3 and os.path.exists(ckpt / "model.safetensors.index.json")
  assert row["devices"] == 8 and row["experts"] == 8 and row["device_bytes"] > 0
  assert row["disk_bytes"] > 0 and row["load_s"] > 0


def test_auto_paper_picks_the_budget_the_costs_favour():
  """The chooser under simulated acceptance: where B=16 costs little more than AR and B=64 much
  more, auto runs B=16 nearly always, at about its speed; where every draft costs too much for
  what it adds, auto backs off to AR. A malformed cost list is refused by name."""
  def table(costs):
    _, text = run_script("auto_paper", f"--costs={costs}", "--tau=16:5,64:6", "--batch=2",
                         "--tokens=48", "--seeds=1", "--calibration=1")
    row = next(line for line in text.splitlines() if line.strip().startswith("1.00"))
    return [float(v) for v in row.split()[1:7]], row

  (ar, b16, b64, auto, vs_best, _), row = table("0:1.0,16:1.2,64:4.0")
  assert max(ar, b16, b64) == b16 and vs_best >= 0.9, row
  assert "16 x" in row and "AR x" not in row, row
  (ar, b16, b64, auto, vs_best, _), row = table("0:1.0,16:9.0,64:20.0")
  assert max(ar, b16, b64) == ar and vs_best >= 0.6, row  # its few probes cost the rest
  steps = dict(p.split(" x") for p in row.split("  ")[-1].split(", "))
  assert int(steps["AR"]) > 2 * sum(int(n) for b, n in steps.items() if b != "AR"), row
  code, text = run_script("auto_paper", "--costs=0:1,16", ok=False)
  assert code != 0 and "--costs: budget:value pairs" in text


def test_bench_serve_auto_smoke_rows(tmp_path):
  """experiments/perf/bench_serve_auto.py on CPU: a row per (run, level, concurrency), every
  request's tokens AR's and on the planted path, auto's steps recorded by budget."""
  out = tmp_path / "rows.jsonl"
  _, text = run_script("bench_serve_auto", "--smoke", "--concurrency=2",
                       "--levels=none:0:0.5,high:0.95", f"--json_out={out}")
  rows = read_rows(out)
  assert {(r["run"], r["level"], r["concurrency"]) for r in rows} == {
      ("ar", "-", 2), *((run, level, 2) for run in ("4", "auto") for level in ("none", "high"))}
  for r in rows:
    assert r["divergent"] == 0 and r["planted"] == 1.0 and r["tokens_per_second"] > 0, r
    assert r["requests"] == r["concurrency"]
  for r in rows:
    if r["run"] == "auto":
      assert sum(r["chosen"].values()) == r["steps"] and set(r["chosen"]) <= {"0", "4"}, r  # JSON keys
    if r["run"] == "4":
      assert (r["tau"] == 1.0) == (r["level"] == "none"), r
  assert "benchmark drafter" in text and "auto/best" in text


def test_bench_drafter_training_smoke_rows(tmp_path):
  """experiments/perf/bench_drafter_training.py on CPU: capture, offline and online training
  rows, each with a positive throughput; the stored bytes are the features' width x dtype."""
  out = tmp_path / "rows.jsonl"
  run_script("bench_drafter_training", "--smoke", f"--json_out={out}")
  rows = read_rows(out)
  assert [r["stage"] for r in rows] == ["capture", "train (offline)", "train (online)"]
  assert all(r["tokens_per_second"] > 0 for r in rows)
  assert rows[0]["bytes_per_million_tokens"] == 1e6 * rows[0]["feature_width"] * 2
