"""Research workflow: config validation, the CPU benchmark smoke matrix, the sandboxed coding eval
(good and hostile completions), the tree picture and the walkthrough notebook."""

import csv
import glob
import json
import os
import subprocess
import sys
import tempfile

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES

import helpers
from experiments import bench_matrix, coding_eval, draw_tree, generate, workflow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TARGET = os.path.join(FIXTURES, "qwen3_gqa")


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
  import ddtree_jax as dj
  path = str(tmp_path_factory.mktemp("drafter"))
  return helpers.write_drafter(path, dj.load_target(TARGET, dtype="float32").config)


# ------------------------------------------------------------------------------------------------
# Configs


def test_config_files_load_and_validate(drafter_dir):
  for name in ("default", "bench_smoke"):
    cfg = workflow.load_config(f"configs/{name}.py", {"target": TARGET, "drafter": drafter_dir,
                                                      "random_drafter": False})
    plan = workflow.validate(cfg)
    assert set(plan.methods) <= set(workflow.METHODS)
  for spec in ("configs/qwen3_8b.py", "configs/llama3_8b.py", "configs/bench_matrix.py",
               "configs/bench_matrix.py:llama3_8b"):
    cfg = workflow.load_config(spec, {"random_target": True, "random_drafter": True,
                                      "drafter": ""})
    assert cfg.dtype == "bfloat16"
    plan = workflow.validate(cfg)
    assert plan.runs[0] == ("ar", None) and all(1 <= b <= 1024 for b in plan.budgets)
  cfg = workflow.load_config("configs/bench_matrix.py")
  assert cfg.random_target == (cfg.target == "")


@pytest.mark.parametrize("overrides, needle", [
    ({"methods": "ar,tree"}, "valid methods: ar, chain, ddtree"),
    ({"methods": ""}, "valid methods: ar, chain, ddtree"),
    ({"methods": "ddtree", "budgets": "0"}, "[1, 1024]"),
    ({"methods": "ddtree", "budgets": "8,2000"}, "[1, 1024]"),
    ({"methods": "ddtree", "budgets": "eight"}, "[1, 1024]"),
    ({"batches": "0"}, "integers >= 1"),
    ({"dtype": "fp8"}, "valid dtypes: float32, bfloat16, float16"),
    ({"attention": "flash"}, "xla, pallas"),
    ({"methods": "chain", "drafter": ""}, "need a drafter"),
    ({"target": "/nonexistent"}, "random_target=True"),
    ({"profile": "verify"}, "valid methods"),
])
def test_config_validation_errors(overrides, needle):
  cfg = workflow.load_config("configs/default.py", {"target": TARGET, **overrides})
  with pytest.raises(workflow.ConfigError) as e:
    workflow.validate(cfg)
  assert needle in str(e.value)


def test_unknown_keys_list_valid_keys():
  with pytest.raises(workflow.ConfigError, match="Did you mean 'budgets'.*Valid keys: .*methods"):
    workflow.load_config("configs/default.py", {"budget": "8"})
  with pytest.raises(workflow.ConfigError, match="coding.problems"):
    workflow.check_argv(["prog", "--config=configs/bench_smoke.py", "--config.coding.problem=x"])
  workflow.check_argv(["prog", "--config", "configs/default.py", "--config.budgets=64"])  # fine
  cfg = workflow.load_config("configs/default.py", {"target": TARGET})
  cfg.budgetz = 3  # a config file with a key the scripts do not know
  with pytest.raises(workflow.ConfigError, match="budgetz.*valid keys"):
    workflow.validate(cfg)
  with pytest.raises(workflow.ConfigError, match="qwen3_8b"):
    workflow.load_config("configs/bench_matrix.py:gpt5")
  with pytest.raises(workflow.ConfigError, match="default.py"):
    workflow.load_config("configs/nope.py")
  with pytest.raises(workflow.ConfigError, match="valid: is_palindrome, fib"):
    coding_eval.parse_problems("fib,sort")


def test_cli_bad_input_exits_with_message():
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, "-m", "experiments.bench_matrix", "--config=configs/bench_smoke.py"]
  r = subprocess.run(cmd + ["--config.budget=8"], cwd=REPO, env=env, capture_output=True,
                     text=True, timeout=120)
  assert r.returncode != 0 and "Did you mean 'budgets'" in r.stderr
  assert "Traceback" not in r.stderr
  r = subprocess.run(cmd + ["--config.methods=ar,beam"], cwd=REPO, env=env, capture_output=True,
                     text=True, timeout=120)
  assert r.returncode != 0 and "valid methods: ar, chain, ddtree" in r.stderr
  assert "Traceback" not in r.stderr


def test_random_models_from_shape():
  cfg = workflow.load_config("configs/qwen3_8b.py", {
      "random_target": True, "random_drafter": True, "drafter": "", "dtype": "float32",
      "shape.vocab_size": 64, "shape.hidden_size": 32, "shape.intermediate_size": 48,
      "shape.num_layers": 3, "shape.num_heads": 2, "shape.num_kv_heads": 1, "shape.head_dim": 16,
      "drafter_shape.num_layers": 1, "drafter_shape.block_size": 4,
      "drafter_shape.target_layer_ids": "", "drafter_shape.mask_token_id": -1})
  workflow.validate(cfg)
  target, drafter = workflow.load_models(cfg)
  assert target.config.num_layers == 3 and target.config.qk_norm and target.tokenizer is None
  assert all(l.wqkv is not None and l.wq is None for l in target.params.layers)  # as load_target
  assert drafter.config.block_size == 4 and drafter.config.mask_token_id == 63
  assert all(0 <= i < 3 for i in drafter.config.target_layer_ids)
  prompts = workflow.make_prompts(cfg, target, 3)  # no tokenizer: random token prompts
  assert len(prompts) == 3 and all(len(p) == 64 and max(p) < 64 for p in prompts)
  cfg.drafter_int8 = True
  _, d8 = workflow.load_models(cfg)
  assert d8.params.fc.q.dtype == jnp.int8 and d8.params.lm_head.shape == (32, 64)


def test_draft_vocab_config_key(tmp_path):
  cfg = workflow.load_config("configs/qwen3_8b.py", {
      "random_target": True, "random_drafter": True, "drafter": "", "dtype": "float32",
      "shape.vocab_size": 64, "shape.hidden_size": 32, "shape.intermediate_size": 48,
      "shape.num_layers": 2, "shape.num_heads": 2, "shape.num_kv_heads": 1, "shape.head_dim": 16,
      "drafter_shape.num_layers": 1, "drafter_shape.block_size": 4,
      "drafter_shape.target_layer_ids": "", "drafter_shape.mask_token_id": -1,
      "draft_vocab": str(tmp_path / "missing.npy")})
  with pytest.raises(workflow.ConfigError, match="draft_vocab .*missing.npy"):
    workflow.validate(cfg)
  ids = np.asarray([5, 3, 40, 0], np.int32)
  np.save(tmp_path / "ids.npy", ids)
  cfg.draft_vocab = str(tmp_path / "ids.npy")
  cfg.random_drafter, cfg.methods = False, "ar"
  with pytest.raises(workflow.ConfigError, match="no drafter"):
    workflow.validate(cfg)
  cfg.random_drafter, cfg.methods, cfg.drafter_int8 = True, "ddtree", True
  workflow.validate(cfg)
  _, d = workflow.load_models(cfg)
  np.testing.assert_array_equal(d.params.draft_vocab, ids)
  assert d.params.lm_head.shape == (32, 4) and d.params.lm_head.q.dtype == jnp.int8


# ------------------------------------------------------------------------------------------------
# Benchmark matrix


def test_bench_smoke_cpu(tmp_path, drafter_dir):
  cfg = workflow.load_config("configs/bench_smoke.py", {
      "target": TARGET, "drafter": drafter_dir, "random_drafter": False, "dtype": "float32",
      "methods": "ddtree", "budgets": "4", "batches": "2", "max_new_tokens": 8, "repeats": 1,
      "profile": "ddtree", "profile_repeats": 1, "progress": False, "out_dir": str(tmp_path)})
  out = bench_matrix.run(cfg)
  rows = {(r["method"], r["budget"]): r for r in out["rows"]}
  assert set(rows) == {("ar", None), ("chain", None), ("ddtree", 4)}  # baselines added
  ar = rows[("ar", None)]
  assert ar["speedup_vs_ar"] == pytest.approx(1.0)
  assert ar["tau"] == 1.0 and set(ar["acceptance_lengths"]) == {1}
  for key, r in rows.items():
    if key != ("ar", None):
      assert r["identical_to_ar"] and r["divergent_seqs"] == 0, key  # float32: lossless
      assert r["new_tokens"] == ar["new_tokens"], key
    acc = r["acceptance_lengths"]
    assert r["tau"] == pytest.approx(sum(acc) / len(acc)), key
    # each prompt's first token comes from the prefill, the rest from the steps
    assert r["new_tokens"] == 2 + sum(acc), key
    # repeats=1: tokens/s and step time are the one timed run's loop tokens over its decode time
    assert r["tokens_per_second"] == pytest.approx((r["new_tokens"] - 2) / r["decode_seconds"])
    assert r["step_ms"] == pytest.approx(1e3 * r["decode_seconds"] / r["steps"]), key
    assert r["speedup_vs_ar"] == pytest.approx(r["tokens_per_second"] / ar["tokens_per_second"])
    assert r["speedup_vs_chain"] == pytest.approx(
        r["tokens_per_second"] / rows[("chain", None)]["tokens_per_second"])
  assert rows[("ddtree", 4)]["verify_ms"] > 0 and rows[("ddtree", 4)]["draft_ms"] > 0
  with open(tmp_path / "bench.csv") as f:
    table = list(csv.DictReader(f))
  assert len(table) == 3 and {"tokens_per_second", "tau", "speedup_vs_chain"} <= set(table[0])
  data = json.loads((tmp_path / "bench.json").read_text())
  assert data["meta"]["platform"] == "cpu" and len(data["rows"]) == 3
  for png in ("tokens_per_second.png", "tau.png", "acceptance_hist.png", "speedup.png"):
    assert (tmp_path / png).stat().st_size > 1000
  # rows.jsonl (written row by row, for runs cut short) gives back the same rows and speed-ups
  partial, meta = bench_matrix.load_rows(str(tmp_path / "rows.jsonl"))
  assert meta is None and [(r["method"], r["budget"]) for r in partial] == [
      (r["method"], r["budget"]) for r in out["rows"]]
  assert [r["speedup_vs_chain"] for r in partial] == pytest.approx(
      [r["speedup_vs_chain"] for r in out["rows"]])

  # Near-tie accounting: a forged divergence at position 3 of a reference output.
  import ddtree_jax as dj
  target = dj.load_target(TARGET, dtype="float32")
  prompt, ar = [3, 4, 5, 6], [10, 11, 12, 13, 14, 15]
  forged = ar[:3] + [99] + ar[4:]
  d = bench_matrix.divergences(target, [prompt], [ar], [forged], eps=1e9)
  assert d["divergent_seqs"] == 1 and d["near_tie_divergences"] == 1
  assert d["divergence_positions"] == [3] and d["min_divergence_gap"] > 0
  assert bench_matrix.divergences(target, [prompt], [ar], [forged], eps=0.0)[
      "near_tie_divergences"] == 0
  assert bench_matrix.divergences(target, [prompt], [ar], [ar], eps=1.0)["divergent_seqs"] == 0


# ------------------------------------------------------------------------------------------------
# Coding eval in the sandbox


def _sandbox_procs():
  """pids of live processes whose command line mentions a sandbox temp dir."""
  out = []
  for d in glob.glob("/proc/[0-9]*"):
    try:
      with open(os.path.join(d, "cmdline"), "rb") as f:
        if b"ddtree_sandbox_" in f.read():
          out.append(int(os.path.basename(d)))
    except OSError:
      pass
  return out


def test_extract_body():
  text = "    x = 1\n\n    return x\nprint('top level')\n    more = 2\n"
  assert coding_eval.extract_body(text) == "    x = 1\n\n    return x\n"
  assert coding_eval.extract_body("    return 1\n```\nexplanation") == "    return 1\n"
  assert coding_eval.extract_body("    return 2<|endoftext|>junk") == "    return 2\n"
  assert coding_eval.extract_body("return 3\n").strip() == ""


def test_coding_eval_good_and_hostile(tmp_path):
  probs = list(coding_eval.PROBLEMS.values())
  rows = coding_eval.evaluate(lambda p: {"text": p.canonical + "\ndef unrelated():\n  pass\n",
                                         "tokens": 7, "tokens_per_second": 1.0, "tau": 1.0},
                              probs, timeout_s=5.0, memory_mb=512)
  assert [r["status"] for r in rows] == ["pass"] * 5, rows
  coding_eval.print_table(rows)

  outside = tmp_path / "escaped.txt"
  repo_file = os.path.join(REPO, "ESCAPED_BY_SANDBOX.txt")
  marker = tmp_path / "spawned.txt"
  keep = tmp_path / "keep"
  keep.mkdir()
  (keep / "data.txt").write_text("precious")
  hostile = {
      "infinite loop": ("    while True:\n        pass\n", "timeout"),
      "fork bomb": ("    import os\n    while True:\n        os.fork()\n", "blocked: os.fork"),
      "write outside": (f"    open({str(outside)!r}, 'w').write('x')\n    return 0\n", "blocked"),
      "write repo": (f"    open({repo_file!r}, 'a').write('x')\n", "blocked"),
      "read repo": (f"    return len(open({os.path.join(REPO, 'README.md')!r}).read())\n",
                    "blocked"),
      "socket": ("    import socket\n    s = socket.socket()\n    s.connect(('127.0.0.1', 9))\n",
                 "blocked: socket"),
      "memory": ("    x = bytearray(8 << 30)\n    return len(x)\n", "memory limit"),
      "os.system": (f"    import os\n    os.system('touch {marker}')\n", "blocked: os.system"),
      "subprocess": (f"    import subprocess\n    subprocess.run(['touch', {str(marker)!r}])\n",
                     "blocked"),
      "delete": (f"    import shutil\n    shutil.rmtree({str(keep)!r})\n", "blocked: shutil.rmtree"),
      "signal parent": ("    import os\n    os.kill(os.getppid(), 0)\n", "blocked: os.kill"),
      "ctypes": ("    import ctypes\n    return ctypes.CDLL(None)\n", "blocked"),
      "exit early": ("    raise SystemExit(0)\n", "error: SystemExit"),
      "device node": ("    import os, stat\n    os.mknod('null', 0o666 | stat.S_IFCHR, "
                      "os.makedev(1, 3))\n    return 0\n", "error: PermissionError"),
  }
  before = set(glob.glob(os.path.join(tempfile.gettempdir(), "ddtree_sandbox_*")))
  fib = coding_eval.PROBLEMS["fib"]
  for name, (body, status) in hostile.items():
    _, res = coding_eval.check(fib, body, timeout_s=1.0, memory_mb=256)
    assert not res.passed, name
    assert res.status.startswith(status), (name, res.status, res.detail)
  escaped = [p for p in (str(outside), repo_file, str(marker)) if os.path.exists(p)]
  for p in escaped:
    os.remove(p)
  assert not escaped
  assert (keep / "data.txt").read_text() == "precious"
  assert os.path.exists(os.path.join(REPO, "README.md"))
  assert _sandbox_procs() == []  # nothing left running
  assert {"rlimits", "audit"} <= set(res.isolation)
  after = set(glob.glob(os.path.join(tempfile.gettempdir(), "ddtree_sandbox_*")))
  assert after <= before  # every sandbox temp dir removed


# ------------------------------------------------------------------------------------------------
# Tree picture and notebook


def test_draw_tree(tmp_path):
  import jax
  import jax.numpy as jnp
  import tokenizers
  import matplotlib
  matplotlib.use("Agg")
  import ddtree_jax as dj
  from ddtree_jax.tools import viz
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(5, 256))
  logits[np.arange(5), rng.integers(0, 256, 5)] += 5.0  # peaked drafts: a deep tree
  tree = jax.jit(dj.build_tree, static_argnums=1)(jnp.asarray(logits), 12, root_token=7)
  tok = tokenizers.Tokenizer.from_file(os.path.join(TARGET, "tokenizer.json"))
  ax = viz.draw_tree(tree, accepted_path=[0, 1], tokenizer=tok)
  ax.figure.savefig(tmp_path / "tree.png")
  assert (tmp_path / "tree.png").stat().st_size > 1000
  pos = viz.layout(np.asarray(tree.parents), np.asarray(tree.scores))
  assert np.array_equal(pos[:, 0], np.asarray(tree.depths))
  with pytest.raises(ValueError, match="outside"):
    viz.draw_tree(tree, accepted_path=[0, 99])
  batched = jax.tree.map(lambda x: np.stack([x, x]), tree)
  with pytest.raises(ValueError, match="one tree"):
    viz.draw_tree(batched)
  assert viz.token_label(-1) == "root" and viz.token_label(5) == "5"


def test_draw_tree_script(tmp_path):
  cfg = workflow.load_config("configs/default.py", {
      "target": TARGET, "drafter": "", "methods": "ddtree", "budgets": "6",
      "drafter_shape.num_layers": 1, "drafter_shape.block_size": 4})
  info = draw_tree.run(cfg, str(tmp_path / "t.png"))
  assert info["path"][0] == 0 and len(info["path"]) == len(info["emitted"]) == info["tau"]
  # the step commits the target's own greedy tokens: the bonus, then tau more
  import ddtree_jax as dj
  target = dj.load_target(TARGET, dtype="float32")
  prompt = workflow.make_prompts(cfg, target, 1)[0]
  seq = prompt + [info["bonus"]] + info["emitted"]
  logits = dj.forward_logits(target, np.asarray([seq[:-1]]))[0, len(prompt) - 1:]
  assert np.asarray(logits).argmax(-1).tolist() == seq[len(prompt):]
  assert (tmp_path / "t.png").stat().st_size > 1000


def test_notebook_executes():
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  path = os.path.join(REPO, "notebooks", "ddtree_walkthrough.ipynb")
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": os.path.dirname(path)}})
  client.execute()
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
  assert "lossless" in text and "B=" in text
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "image/png" in o.get("data", {})]
  assert len(images) >= 3


def test_cpu_note_only_while_speculation_is_slower():
  row = lambda tps: {"tokens_per_second": tps}
  assert generate.speculation_slower([row(10.0), row(8.0), row(9.9)])
  assert not generate.speculation_slower([row(10.0), row(8.0), row(13.0)])
  assert not generate.speculation_slower([row(10.0)])


def test_demo_explains_its_figures(tmp_path):
  """A round's cost in AR steps is tau over its speed-up; the GPU paragraph comes from a run's
  own log (its JSON line and card), and no log gives none."""
  rows = [{"method": "ar", "budget": None, "tau": 1.0, "tokens_per_second": 100.0,
           "identical_to_first": True},
          {"method": "ddtree", "budget": 32, "tau": 6.0, "tokens_per_second": 150.0,
           "identical_to_first": True}]
  assert generate.round_costs(rows) == "a ddtree/B=32 round cost 4.0 AR steps for 6.00 tokens"
  run = tmp_path / "headline-2030-01-02"
  run.mkdir()
  (run / "demo.log").write_text("noise\n" + json.dumps({"results": rows}) + "\n")
  (run / "gpus.txt").write_text("name, memory.total [MiB]\nNVIDIA H100 80GB HBM3, 81559 MiB\n")
  text = generate.gpu_summary(str(run))
  assert "NVIDIA H100 80GB HBM3 (2030-01-02" in text and "ddtree/B=32 1.50x" in text
  assert "4.0 AR steps" in text and "identical to AR's" in text
  assert generate.gpu_summary(str(tmp_path / "absent")) is None
  assert os.path.exists(os.path.join(generate.GPU_RUN, "demo.log"))  # the committed run
