"""Per-slot sampling of the slot engine (`row_sampling.pick`): each row draws as `verify.pick` draws for
a batch of one with that row's settings and key, whatever the other rows ask for; greedy rows
take the argmax. The server-level tests are in tests/test_server.py; last, bench_slots' CPU
smoke run."""

import json
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.request import GenerateOptions, RequestError
from ddtree_jax.speculative import sampling as row_sampling
from ddtree_jax.serving import slots
from ddtree_jax.speculative import verify
from ddtree_jax.models.config import ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (temperature, top_k, top_p) per row: greedy, plain, top-k, top-p, both; top_k 0 / top_p 1 = off
ROWS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 12, 0.9)]


def _settings(rows):
  s = row_sampling.Settings.free(len(rows), 2)
  for i, (t, k, p) in enumerate(rows):
    s.temperature[i], s.top_k[i], s.top_p[i] = t, k, p
  return jax.tree.map(jnp.asarray, s)


def test_each_row_draws_as_verify_pick_for_a_batch_of_one():
  logits = jax.random.normal(jax.random.key(0), (len(ROWS), 3, 97)) * 3
  keys = jax.random.split(jax.random.key(1), len(ROWS))
  pick = jax.jit(row_sampling.pick, static_argnames=("sampling", "max_top_k"))
  got = np.asarray(pick(logits, _settings(ROWS), keys, max_top_k=16))
  for i, (t, k, p) in enumerate(ROWS):
    want = verify.pick(logits[i:i + 1], t, keys[i], k or None, None if p >= 1 else p)[0]
    assert (got[i] == np.asarray(want)).all(), ROWS[i]
    alone = pick(logits[i:i + 1], _settings([ROWS[i]]), keys[i:i + 1], max_top_k=16)[0]
    assert (got[i] == np.asarray(alone)).all(), ROWS[i]  # neighbours change nothing
  assert (got[0] == np.asarray(jnp.argmax(logits[0], -1))).all()
  greedy_only = pick(logits, _settings(ROWS), keys, sampling=False, max_top_k=16)
  assert (np.asarray(greedy_only) == np.asarray(jnp.argmax(logits, -1))).all()


def test_filters_match_verify_filter_logits_row_by_row():
  logits = jax.random.normal(jax.random.key(2), (len(ROWS), 2, 64)) * 2
  got = np.asarray(row_sampling.filter_rows(logits, _settings(ROWS), 16))
  for i, (t, k, p) in enumerate(ROWS):
    want = verify.filter_logits(logits[i], t or 1.0, k or None, None if p >= 1 else p)
    np.testing.assert_array_equal(got[i], np.asarray(want))


@pytest.mark.parametrize("seed", [0, 1, 42, 2**31 + 5, 2**32 - 1])
def test_seed_key_data_is_jax_random_key(seed):
  want = jax.random.key_data(jax.random.key(seed))
  np.testing.assert_array_equal(row_sampling.seed_key_data(seed), np.asarray(want))
  assert row_sampling.seed_key_data(-1).tolist() == [2**32 - 1, 2**32 - 1]  # 64-bit, two's complement


@pytest.mark.parametrize("kw,field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=True), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=2.5), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_k=65), "top_k"), (dict(top_k=1.5), "top_k"),
    (dict(seed=2**64), "seed"), (dict(seed="1"), "seed"), (dict(method="chain"), "method"),
    (dict(max_new_tokens=2047), "max_new_tokens"), (dict(stop_token_ids=[512]), "stop_token_ids"),
    (dict(temperature=0.5, greedy_only=True), "temperature")])
def test_bad_sampling_settings_name_the_field(kw, field):
  """A served request's options are checked by `GenerateOptions.check` with the server's limits
  (temperature <= 2, top_k <= max_top_k, prompt + max_new_tokens <= capacity), per-request
  fields only."""
  greedy_only = kw.pop("greedy_only", False)
  cfg = ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=8, intermediate_size=8,
                    num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8)
  target = types.SimpleNamespace(config=cfg)
  server = slots.SlotConfig(capacity=2048, max_top_k=64, sampling=not greedy_only)
  check = lambda **kw: GenerateOptions(**{"max_new_tokens": 4, **kw}).check(
      target, None, [[1, 2]], server=server.limits())[1]
  assert check().stop_token_ids == ()  # the defaults pass (this model has no eos)
  assert check(top_k=512).top_k is None  # >= the vocabulary: off
  assert check(seed=2**64 - 1, max_new_tokens=2046).seed == 2**64 - 1
  with pytest.raises(RequestError) as e:
    check(**kw)
  assert e.value.field == field


def test_bench_slots_small_rows(tmp_path):
  """experiments/perf/bench_slots.py on its tiny CPU shapes: a row per (run, slots), both
  programs run every step."""
  out = tmp_path / "slots.jsonl"
  proc = subprocess.run([sys.executable, "-m", "experiments.perf.bench_slots", "--small",
                         "--runs=ar", "--slots=2", "--steps=3", "--repeats=1",
                         "--nocompilation_cache", f"--json_out={out}"], cwd=REPO,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [(r["method"], r["slots"]) for r in rows] == [("ar", 2)]
  r = rows[0]
  assert r["static_steps"] == r["slot_steps"] == 3
  assert r["ratio"] == pytest.approx(r["slot_step_ms"] / r["static_step_ms"], rel=1e-9)
  # the printed table holds the row's numbers
  table = proc.stdout.split("slot engine step vs static decode loop step")[1].splitlines()
  assert next(l.split() for l in table if l.startswith("ar ")) == [
      "ar", "-", "2", f"{r['slot_step_ms']:.3f}", f"{r['static_step_ms']:.3f}", f"{r['ratio']:.3f}"]
