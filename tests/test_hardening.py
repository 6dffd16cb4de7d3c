"""Bad requests, bad checkpoints and interrupted writes: each gets a clear error naming the
problem (or leaves the old file whole), never a crash deep in JAX, a silent clamp or an
allocation that threatens the host."""

import dataclasses
import json
import logging
import os
import shutil
import struct
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

import ddtree_jax as dj
from conftest import FIXTURES
from ddtree_jax.checkpoints import files
from ddtree_jax.checkpoints import export as hf_export
from ddtree_jax.tools import sandbox
from ddtree_jax import request as validation
from ddtree_jax.checkpoints.hf import read_checkpoint_tensors
from ddtree_jax.checkpoints.safetensors_io import CheckpointError, read_safetensors, write_safetensors
from helpers import copy_fixture, edit_config, write_drafter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(FIXTURES, "qwen3_gqa")


@pytest.fixture(scope="module")
def target():
  return dj.load_target(TARGET, dtype="float32")


@pytest.fixture(scope="module")
def drafter(target, tmp_path_factory):
  return dj.load_drafter(write_drafter(str(tmp_path_factory.mktemp("d")), target.config), target)


def run_limited(module, *args, memory_gb=4, timeout=300):
  """Runs `python -m module args` under RLIMIT_AS, set in the child before anything else (a
  request that slipped through validation fails to allocate instead of taking the host's
  memory)."""
  boot = ("import resource, runpy, sys; limit = int(sys.argv.pop(1)) << 30; "
          "resource.setrlimit(resource.RLIMIT_AS, (limit, limit)); "
          "runpy.run_module(sys.argv[1], run_name='__main__', alter_sys=True)")
  return subprocess.run([sys.executable, "-c", boot, str(memory_gb), module, *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------------- requests


def test_cli_refuses_more_tokens_than_positions_within_a_memory_limit(tmp_path):
  r = run_limited("experiments.generate", "--config=configs/default.py", "--config.methods=ar",
                  "--config.max_new_tokens=10000000", f"--compilation_cache_dir={tmp_path}")
  assert r.returncode != 0 and "positions" in r.stderr and "Traceback" not in r.stderr, \
      r.stderr[-2000:]


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=10**7), "needs 10000002 positions; the model has 512"),
    (dict(prompts=[[2] * 600]), "600 tokens .* the model has 512"),
    (dict(steps_per_check=9, max_new_tokens=8), r"steps_per_check must be an integer in \[1, 8\]"),
    (dict(temperature=float("nan")), "temperature must be finite"),
    (dict(temperature=float("inf")), "temperature must be finite"),
    (dict(temperature=1.0, top_k=1.5), "top_k must be an integer"),
    (dict(temperature=1.0, top_p=float("nan")), "top_p must be finite"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer"),
    (dict(prompts=[[1.5, 2]]), "integer token ids"),
    (dict(prompts=[[True, 2]]), "integer token ids"),
    (dict(prompts="hello"), "prompts is empty"),
    (dict(seed=0.5), "seed must be an integer"),
    (dict(stop_token_ids=[999]), "stop_token_ids has token ids"),
    (dict(budget=8), "budget is only used by method='ddtree', not 'ar'"),
    (dict(kernel_tuning="fast"), "kernel_tuning must be"),
])
def test_bad_requests_are_named(target, kwargs, match):
  call = dict(prompts=[[1, 2, 3]], max_new_tokens=4) | kwargs
  with pytest.raises(validation.RequestError, match=match):
    dj.generate(target, call.pop("prompts"), **call)


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="ddtree", budget=1.5), "budget must be an integer"),
    (dict(method="ddtree", budget=True), "budget must be an integer"),
    (dict(method="ddtree", budget="32"),
     r"budget must be an integer in \[1, 1024\] or 'auto', got '32'"),
    (dict(method="ddtree", budget=8, topk_cap=1.5), "topk_cap must be an integer"),
    (dict(method="chain", budget=8), "budget is only used by method='ddtree', not 'chain'"),
    (dict(method="chain", topk_cap=4), "topk_cap is only used"),
])
def test_bad_speculative_requests_are_named(target, drafter, kwargs, match):
  with pytest.raises(validation.RequestError, match=match):
    dj.generate(target, [[1, 2, 3]], max_new_tokens=4, drafter=drafter, **kwargs)


def test_a_target_as_drafter_and_out_of_range_ids(target, drafter):
  with pytest.raises(validation.RequestError, match="drafter must be a Drafter .* got Target"):
    dj.generate(target, [[1, 2]], method="chain", drafter=target, max_new_tokens=4)
  with pytest.raises(validation.RequestError, match="drafter must be a Drafter"):
    dj.draft_logits(target, target, [1, 2])
  with pytest.raises(validation.RequestError, match=r"outside \[0, 256\)"):
    dj.forward_logits(target, [[1, 256]])
  with pytest.raises(validation.RequestError, match=r"outside \[0, 256\)"):
    dj.draft_logits(target, drafter, [-1, 2])
  with pytest.raises(validation.RequestError, match="positions"):
    dj.forward_logits(target, np.ones((1, 513), np.int32))


def test_cache_bigger_than_free_memory_is_refused_before_allocating(target):
  roomy = dataclasses.replace(target, config=dataclasses.replace(
      target.config, max_position_embeddings=1 << 30))
  with pytest.raises(validation.RequestError, match=r"needs .* GiB, but the device has"):
    dj.generate(roomy, [[1, 2]] * 256, max_new_tokens=1 << 24)
  with pytest.raises(validation.RequestError, match="needs 2.00 GiB, but the device has 1.00"):
    validation.check_memory(2 << 30, "x", free=1 << 30)
  validation.check_memory(1 << 29, "x", free=1 << 30)  # fits: no error


# ------------------------------------------------------------------------------- checkpoints


def test_a_config_with_fewer_layers_than_the_checkpoint_is_refused(tmp_path):
  path = copy_fixture(tmp_path)
  edit_config(path, num_hidden_layers=1, layer_types=["full_attention"])
  with pytest.raises(CheckpointError, match=r"does not read \['model.layers.1.*num_hidden_layers 1"):
    dj.load_target(path)


def test_a_bias_the_model_has_no_place_for_is_refused(tmp_path):
  path = copy_fixture(tmp_path)
  tensors = {k: np.array(v) for k, v in read_checkpoint_tensors(path).items()}
  tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(128, np.float32)
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(16, np.float32)  # skipped
  save_file(tensors, os.path.join(path, "model.safetensors"))
  with pytest.raises(CheckpointError, match=r"does not read \['model.layers.0.self_attn.q_proj.bias'\]"):
    dj.load_target(path)


def _header_file(path, header: dict, data: bytes):
  raw = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw + data)


def test_broken_safetensors_files_are_named(tmp_path):
  good = str(tmp_path / "good.safetensors")
  write_safetensors(good, {"a": np.arange(6, dtype=np.float32), "b": np.ones((2, 2), np.int8)})
  np.testing.assert_array_equal(read_safetensors(good)["a"], np.arange(6))
  size = os.path.getsize(good)
  cut = str(tmp_path / "cut.safetensors")
  with open(good, "rb") as f, open(cut, "wb") as g:
    g.write(f.read(size - 3))
  with pytest.raises(CheckpointError, match=r"cut.safetensors: tensor '.*': bytes .* outside"):
    read_safetensors(cut)
  huge = str(tmp_path / "huge.safetensors")
  with open(huge, "wb") as f:
    f.write(struct.pack("<Q", 2**62) + b"{}")
  with pytest.raises(CheckpointError, match="huge.safetensors: header length"):
    read_safetensors(huge)
  over = str(tmp_path / "over.safetensors")
  _header_file(over, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12))
  with pytest.raises(CheckpointError, match="'a' and 'b' overlap"):
    read_safetensors(over)
  bad = str(tmp_path / "bad.safetensors")
  _header_file(bad, {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8))
  with pytest.raises(CheckpointError, match="8 bytes for shape"):
    read_safetensors(bad)
  with open(bad, "wb") as f:
    f.write(struct.pack("<Q", 5) + b"{nope")
  with pytest.raises(CheckpointError, match="bad.safetensors: the safetensors header is not valid"):
    read_safetensors(bad)


def test_an_index_may_not_point_outside_the_checkpoint(tmp_path):
  path = copy_fixture(tmp_path, "qwen3_sharded")
  index = os.path.join(path, "model.safetensors.index.json")
  with open(index) as f:
    idx = json.load(f)
  name = next(iter(idx["weight_map"]))
  outside = tmp_path / "elsewhere.safetensors"
  shutil.copy(os.path.join(path, idx["weight_map"][name]), outside)
  idx["weight_map"][name] = "../elsewhere.safetensors"
  with open(index, "w") as f:
    json.dump(idx, f)
  with pytest.raises(CheckpointError, match="not a file of the checkpoint directory"):
    dj.load_target(path)


@pytest.mark.parametrize("file", ["config.json", "tokenizer.json"])
def test_bad_json_names_the_file(tmp_path, file):
  path = copy_fixture(tmp_path)
  with open(os.path.join(path, file), "w") as f:
    f.write("{not json")
  with pytest.raises(CheckpointError, match=f"{file}"):
    dj.load_target(path)


@pytest.mark.parametrize("changes,match", [
    (dict(rms_norm_eps=0.0), "rms_norm_eps must be a finite number > 0"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps"),
    (dict(num_hidden_layers=-2), "num_hidden_layers must be a positive integer"),
    (dict(hidden_size=64.5), "hidden_size must be a positive integer"),
    (dict(rope_theta=float("inf")), "rope_theta"),
    (dict(eos_token_id=999), "eos_token_id"),
])
def test_config_values_are_range_checked_with_the_file_named(tmp_path, changes, match):
  path = copy_fixture(tmp_path)
  edit_config(path, **changes)
  with pytest.raises(ValueError, match=f"config.json: .*{match}"):
    dj.load_target(path)


def test_integer_dtypes_and_non_finite_weights_are_refused(tmp_path):
  with pytest.raises(ValueError, match="int8 cannot hold weights"):
    dj.load_target(TARGET, dtype=np.int8)
  path = copy_fixture(tmp_path)
  tensors = {k: np.array(v) for k, v in read_checkpoint_tensors(path).items()}
  tensors["model.layers.1.mlp.down_proj.weight"][3, 4] = np.nan
  save_file(tensors, os.path.join(path, "model.safetensors"))
  with pytest.raises(CheckpointError, match=r"layers\[1\].w_down.*1 non-finite"):
    dj.load_target(path, dtype="float32")


def test_drafter_mismatches(target, tmp_path, caplog):
  path = write_drafter(str(tmp_path / "d1"), target.config, config_overrides={
      "num_target_layers": 4})
  with pytest.raises(CheckpointError, match="4-layer target, this target has 2"):
    dj.load_drafter(path, target)
  assert dj.load_drafter(path, target, allow_layer_mismatch=True).config.block_size == 8
  path = write_drafter(str(tmp_path / "d2"), target.config, config_overrides={
      "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 1], "new_knob": 3}})
  with caplog.at_level(logging.WARNING):
    dj.load_drafter(path, target)
  assert "new_knob" in caplog.text


def test_meshes_from_jax_make_mesh_are_accepted(target):
  mesh = jax.make_mesh((2,), ("tp",))
  assert set(mesh.axis_types) != {jax.sharding.AxisType.Auto}  # JAX's helper: Explicit axes
  sharded = dj.load_target(TARGET, dtype="float32", mesh=mesh)
  want = dj.generate(target, [[3, 4, 5]], max_new_tokens=6, stop_token_ids=()).tokens
  assert dj.generate(sharded, [[3, 4, 5]], max_new_tokens=6, stop_token_ids=()).tokens == want


# ------------------------------------------------------------------------------ atomic writes


def test_an_interrupted_export_leaves_the_old_one_whole(target, tmp_path, monkeypatch):
  out = str(tmp_path / "export")
  hf_export.save_target_hf(out, target.params, target.config, dtype="float32")
  before = {k: np.array(v) for k, v in read_checkpoint_tensors(out).items()}
  config_before = open(os.path.join(out, "config.json")).read()

  def killed(fd):
    raise KeyboardInterrupt("killed before the rename")
  monkeypatch.setattr(files.os, "fsync", killed)
  scaled = jax.tree.map(lambda x: x * 2, target.params)
  with pytest.raises(KeyboardInterrupt):
    hf_export.save_target_hf(out, scaled, target.config, dtype="float32")
  monkeypatch.undo()
  after = read_checkpoint_tensors(out)
  assert sorted(after) == sorted(before)
  for k, v in before.items():
    np.testing.assert_array_equal(after[k], v)
  assert open(os.path.join(out, "config.json")).read() == config_before
  assert not [f for f in os.listdir(out) if f.endswith(".tmp")]  # no torn temporaries left


def test_stale_orbax_temporaries_are_removed(target, tmp_path, caplog):
  from ddtree_jax.checkpoints import hf as checkpoint  # pylint: disable=import-outside-toplevel
  ckpt = str(tmp_path / "params")
  stale = tmp_path / "params.orbax-checkpoint-tmp-1234"
  stale.mkdir()
  (stale / "junk").write_text("x")
  other = tmp_path / "other.orbax-checkpoint-tmp-9"
  other.mkdir()
  with caplog.at_level(logging.WARNING):
    checkpoint.save_params(ckpt, target.params)
  assert not stale.exists() and other.exists() and "did not finish" in caplog.text
  restored = checkpoint.restore_params(ckpt, jax.eval_shape(lambda: target.params))
  np.testing.assert_array_equal(restored.embed, target.params.embed)


# ---------------------------------------------------------------------------------- sandbox


def test_the_sandbox_reads_only_its_dir_and_the_standard_library():
  import site  # pylint: disable=import-outside-toplevel
  pkg = os.path.join(site.getsitepackages()[0], "numpy", "__init__.py")
  run = lambda body: sandbox.run_tests(f"import os\ndef f():\n{body}", "f", [[]], [0])
  r = run(f"  return open({pkg!r}).read()")
  assert r.status.startswith("blocked") and "site-packages" in r.detail
  r = run(f"  return os.stat({REPO!r}).st_size")
  assert r.status.startswith("blocked") and REPO in r.detail
  r = run(f"  return int(os.path.exists({os.path.join(REPO, 'README.md')!r}))")
  assert r.status == "pass"  # exists() says False: the stat was refused
  r = run("  import json, collections, dataclasses\n  return os.stat('.').st_size * 0")
  assert r.status == "pass", r.detail  # the standard library and its own dir stay usable
  r = run("  return len(os.readlink('/proc/self/exe'))")
  assert r.status.startswith("blocked")


def test_the_sandbox_has_a_total_disk_quota():
  code = ("def f():\n  for i in range(64):\n    with open(f'f{i}', 'wb') as h:\n"
          "      h.write(b'x' * (1 << 20))\n  return 0")
  r = sandbox.run_tests(code, "f", [[]], [0], disk_mb=8, timeout_s=20)
  assert r.status == "disk quota" and not r.passed
  assert sandbox.run_tests(code.replace("64", "2"), "f", [[]], [0], disk_mb=8).passed


# --------------------------------------------------------------------- compilation cache, CLI


def test_scripts_use_the_persistent_compilation_cache(tmp_path):
  cache = tmp_path / "cache"
  args = ["experiments.generate", "--config=configs/default.py", "--config.methods=ar",
          "--config.max_new_tokens=4", f"--compilation_cache_dir={cache}"]
  r = run_limited(*args, "--verbosity=0")  # the compile's INFO line only when asked for
  assert r.returncode == 0, r.stderr[-2000:]
  assert "compiling prefill + decode loop (ar, batch 3" in r.stderr
  assert cache.is_dir() and any(cache.iterdir())
  off = tmp_path / "off"
  r = run_limited(*args[:-1], f"--compilation_cache_dir={off}", "--nocompilation_cache")
  assert r.returncode == 0 and not off.exists()
