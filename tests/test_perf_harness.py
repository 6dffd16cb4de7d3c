"""experiments/perf/harness.py: a round as the slope of a call's wall time over its steps, the
tuning overrides of profile_step, the drafter variants and a case's cache rows."""

import jax
import pytest

from ddtree_jax import kernels
from ddtree_jax.speculative import decode
from ddtree_jax.pallas.tree_attention import launch_config
from experiments.perf import harness


def _fake_calls(per_call, per_step, steps_of):
  """time_calls stand-in: a call of loop `name` takes per_call + steps * per_step seconds."""
  seen = []

  def fake(loop, case, repeats):
    seen.append(loop)
    n = steps_of[loop]
    return [per_call + n * per_step] * repeats, n
  return fake, seen


def test_round_is_the_slope_and_per_call_the_intercept(monkeypatch):
  fake, seen = _fake_calls(2.5e-3, 5.9e-3, {"short": 16, "long": 64})
  monkeypatch.setattr(harness, "time_calls", fake)
  per_round, per_call = harness.round_seconds("short", None, "long", None, 3)
  assert per_round == pytest.approx(5.9e-3) and per_call == pytest.approx(2.5e-3)
  assert seen == ["short", "long"] * 3  # timed alternately


def test_round_needs_a_longer_run(monkeypatch):
  fake, _ = _fake_calls(0.0, 1e-3, {"short": 16, "long": 16})  # e.g. all accepted early
  monkeypatch.setattr(harness, "time_calls", fake)
  with pytest.raises(ValueError, match="raise --marginal_steps"):
    harness.round_seconds("short", None, "long", None, 2)


def test_tuning_overrides_change_trees_and_verify_rows_only():
  t = harness.tuning_overrides("num_splits=3,block_k=128,block_t=8", 4, "4096=2,12288=0,"
                               "num_warps=4")
  tree = launch_config(1, 33, 32, 8, 1057, 128, t)
  assert (tree["block_t"], tree["block_k"], tree["block_n"], tree["num_splits"]) == (8, 128, 64, 3)
  default = kernels.KernelTuning(sm_count=t.device_sm_count())
  assert launch_config(1, 1, 32, 8, 1057, 128, t) == launch_config(1, 1, 32, 8, 1057, 128,
                                                                         default)  # decode
  assert [t.qkv_split_count(r) for r in (1, 15, 16, 33, 520)] == [0, 0, 4, 4, 4]
  assert t.residual_split_count(33, 4096) == 2 and t.residual_split_count(33, 12288) == 0
  assert t.residual_split_count(33, 8192) == 2 and t.residual_split_count(1, 4096) == 0
  assert t.residual_warps == 4
  assert harness.tuning_overrides() == kernels.KernelTuning()
  with pytest.raises(ValueError, match=r"unknown names \['block_n'\]"):
    harness.tuning_overrides("block_n=32")
  with pytest.raises(ValueError, match="name=int"):
    harness.tuning_overrides(residual="4096=two")


def test_latent_tuning_flags():
  """bench_latent --pallas / bench_moe --latent: the default rule, XLA always, or a launch that
  runs wherever the kernel can; bad launches are refused."""
  assert harness.latent_tuning("default") == kernels.KernelTuning()
  assert not harness.latent_tuning("xla").use_latent_pallas(1, 16, 1024)
  t = harness.latent_tuning("64x128:32x16x8x3")
  assert (t.latent_split_rows, t.latent_max_splits, t.latent_launch) == (64, 128, (32, 16, 8, 3))
  assert t.use_latent_pallas(65, 128, 1 << 15)  # the rule's limits lifted
  assert harness.latent_tuning("128x64").latent_launch == kernels.KernelTuning().latent_launch
  for bad in ("128", "128x64:16x64x4", "axb", "0x64", "128x64:24x64x4x2"):
    with pytest.raises(ValueError):
      harness.latent_tuning(bad)


def test_drafter_variants_and_case_rows():
  tcfg = harness.target_config(small=True)
  tp = harness.random_target(tcfg, jax.random.key(0))
  dp, dcfg = harness.random_drafter(tcfg, jax.random.key(1), small=True)
  out = harness.drafter_variants(dp, tp, ["int8:v64", "bf16"])
  assert list(out) == ["int8:v64", "bf16"]
  assert out["int8:v64"].draft_vocab.shape == (64,) and out["bf16"].lm_head is None
  with pytest.raises(ValueError, match="int8:v32768"):
    harness.drafter_variants(dp, tp, ["fp8"])
  lc = decode.LoopConfig(method="chain", max_new_tokens=5, num_drafts=15)
  case = harness.Case.make(tp, tcfg, dp, dcfg, lc, batch=2, prefix=20, min_new_tokens=9)
  assert case.capacity == 20 + 9 + 16 and case.with_steps(8).lc.max_new_tokens == 9
  with pytest.raises(ValueError, match="min_new_tokens >= 41"):
    case.with_steps(40)
  st = case.state_shape()
  assert st.cache.k.shape[3] == case.capacity and st.out.shape == (2, 5)
