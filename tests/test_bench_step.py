"""experiments/bench_step.py: a round's time as the slope of a call's wall time over its steps."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments"))
import bench_step  # noqa: E402


def _fake_calls(per_call, per_step, steps_of):
  """time_calls stand-in: a call of loop `name` takes per_call + steps * per_step seconds."""
  seen = []

  def fake(loop, *args):
    seen.append(loop)
    n = steps_of[loop]
    return [per_call + n * per_step], n
  return fake, seen


def test_round_is_the_slope_and_per_call_the_intercept(monkeypatch):
  fake, seen = _fake_calls(2.5e-3, 5.9e-3, {"short": 16, "long": 64})
  monkeypatch.setattr(bench_step, "time_calls", fake)
  per_round, per_call = bench_step.time_round("short", "long", (None,) * 6, None, None, 3)
  assert per_round == pytest.approx(5.9e-3) and per_call == pytest.approx(2.5e-3)
  assert seen == ["short", "long"] * 3  # timed alternately


def test_round_needs_a_longer_run(monkeypatch):
  fake, _ = _fake_calls(0.0, 1e-3, {"short": 16, "long": 16})  # e.g. all accepted early
  monkeypatch.setattr(bench_step, "time_calls", fake)
  with pytest.raises(ValueError, match="raise --marginal_steps"):
    bench_step.time_round("short", "long", (None,) * 6, None, None, 2)
