"""experiments/perf/floors.py: the floors' bandwidth is the best of its probes (or the figure
given), the spec bandwidth by device kind, and a row below its floor fails the benchmark."""

import jax
import pytest

from experiments.perf import floors

BW = floors.Bandwidth(1e12, 2e12, {}, "NVIDIA H200")  # 1 GB: a 1 ms floor, 0.5 ms at spec


def test_measure_is_the_best_of_its_probes():
  bw = floors.measure(small=True)
  assert set(bw.probes) == {"read 1 MiB", "copy 1 MiB", "read 4 MiB", "copy 4 MiB"}
  assert all(v > 0 for v in bw.probes.values())
  assert bw.bytes_per_s == max(bw.probes.values())
  assert bw.device == jax.devices()[0].device_kind and bw.spec is None  # a CPU: no datasheet
  row = bw.row()
  assert row["section"] == "bandwidth" and row["spec_GBps"] is None
  assert row["bandwidth_GBps"] == pytest.approx(bw.bytes_per_s / 1e9)
  assert row["probes_GBps"] == pytest.approx({k: v / 1e9 for k, v in bw.probes.items()})
  assert bw.describe().startswith(f"floor bandwidth {bw.bytes_per_s / 1e9:.0f} GB/s = best of "
                                  "read 1 MiB")


def test_a_given_bandwidth_skips_the_probes():
  bw = floors.measure(small=True, given=3e12)
  assert (bw.bytes_per_s, bw.probes) == (3e12, {})
  assert "= given" in bw.describe()


@pytest.mark.parametrize("kind, spec", [
    ("NVIDIA H200", 4.8e12), ("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12),
    ("NVIDIA H100 NVL", 3.9e12), ("NVIDIA GH200 480GB", None), ("cpu", None)])
def test_spec_bandwidth_by_device_kind(kind, spec):
  assert floors.spec_bandwidth(kind) == spec


def test_mark_fills_both_floors_and_flags_a_row_below():
  row = floors.mark({"section": "ar"}, 0.9, 1e9, BW)
  assert row["floor_ms"] == pytest.approx(1.0) and row["spec_floor_ms"] == pytest.approx(0.5)
  assert row["ratio_to_floor"] == pytest.approx(0.9)
  assert row["ratio_to_spec_floor"] == pytest.approx(1.8)
  assert row["below_floor"] is True and floors.flag(row) == "  < floor!"
  assert floors.x_spec(row) == "    1.80"
  above = floors.mark({}, 1.1, 1e9, BW, prefix="target_")
  assert above["target_below_floor"] is False and floors.flag(above, "target_") == ""
  assert above["target_ratio_to_floor"] == pytest.approx(1.1)
  unknown = floors.mark({}, 2.0, 1e9, floors.Bandwidth(1e12, None, {}, "cpu"))
  assert unknown["spec_floor_ms"] is None and unknown["ratio_to_spec_floor"] is None
  assert floors.x_spec(unknown) == "       -"


def test_check_fails_on_a_row_below_its_floor(capsys):
  rows = [BW.row(), floors.mark({"section": "ar", "batch": 1}, 1.5, 1e9, BW)]
  floors.check(rows)  # every row at or over its floor: quiet
  assert "BELOW FLOOR" not in capsys.readouterr().out
  rows.append(floors.mark({"section": "loop", "run": "ar"}, 0.6, 1e9, BW, prefix="target_"))
  with pytest.raises(SystemExit) as exit_:
    floors.check(rows)
  assert exit_.value.code == 1
  out = capsys.readouterr().out
  assert out.count("BELOW FLOOR") == 1 and "run=ar" in out and "target_floor" in out


def test_check_without_a_datasheet_prints_but_does_not_fail(capsys):
  cpu = floors.Bandwidth(1e12, None, {}, "cpu")
  rows = [cpu.row(), floors.mark({"section": "ar"}, -0.5, 1e9, cpu)]  # a noisy difference
  floors.check(rows)
  out = capsys.readouterr().out
  assert "BELOW FLOOR" in out and "not failing" in out
  with pytest.raises(SystemExit):
    floors.check(rows[1:])  # no bandwidth row nor bw: strict
  with pytest.raises(SystemExit):
    floors.check(rows, BW)  # bw says a card with a datasheet
