"""The bandwidth the benchmarks' floors are drawn at, and the check that no row beats its floor.

A floor is the fewest bytes a step must move over a bandwidth. One copy probe can read well
under what the card streams, and a floor drawn at too low a bandwidth is one a step beats. So
the floors' bandwidth is the best of several probes measured in the same process: a read-only
stream (a sum: bytes read) and a copy (c + i in place: bytes read + written), each at sizes well
past the L2 and each many passes inside one program (a pass timed per call also counts the
launch and the host's sync, which left the floors low enough for steps to beat). The card's
datasheet bandwidth (`SPEC`) gives a second floor, the same on every run. A row faster than its floor is a
measuring bug: `check` fails the benchmark on it (on a card with a datasheet bandwidth).

  bw = floors.measure(args.small, args.floor_bandwidth)   # once, before the timed rows
  floors.mark(row, ms, nbytes, bw)                         # each row with a floor
  floors.check(rows, bw)                                   # last, after the tables
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ddtree_jax.tools import profiling

# (words of jax's device_kind, datasheet bytes/s), the first match wins: PCIe and NVL before SXM
SPEC = ((("H100", "PCIe"), 2.0e12), (("H100", "NVL"), 3.9e12), (("H200",), 4.8e12),
        (("H100",), 3.35e12))
SIZES = (256 << 20, 1 << 30, 4 << 30)  # probe arrays (bytes), well past an H100/H200's L2
SMALL_SIZES = (1 << 20, 4 << 20)       # CPU smoke runs
KEYS = ("floor_ms", "ratio_to_floor", "spec_floor_ms", "ratio_to_spec_floor", "below_floor")


def spec_bandwidth(device_kind: str) -> float | None:
  """The datasheet bandwidth (bytes/s) of a jax device_kind, None where unknown (a CPU)."""
  words = set(device_kind.split())
  return next((bw for names, bw in SPEC if words >= set(names)), None)


@dataclasses.dataclass(frozen=True)
class Bandwidth:
  """bytes_per_s: the floors'; spec: the datasheet's (None: unknown); probes: name -> bytes/s
  measured (empty: bytes_per_s was given); device: jax's device_kind."""
  bytes_per_s: float
  spec: float | None
  probes: dict
  device: str

  def floor_ms(self, nbytes: float) -> float:
    return nbytes / self.bytes_per_s * 1e3

  def spec_floor_ms(self, nbytes: float) -> float | None:
    return None if self.spec is None else nbytes / self.spec * 1e3

  def describe(self) -> str:
    how = ("best of " + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in self.probes.items())
           if self.probes else "given")
    spec = "no spec known" if self.spec is None else f"spec {self.spec / 1e9:.0f} GB/s"
    return f"floor bandwidth {self.bytes_per_s / 1e9:.0f} GB/s = {how} ({self.device}; {spec})"

  def row(self) -> dict:
    return {"section": "bandwidth", "bandwidth_GBps": self.bytes_per_s / 1e9,
            "spec_GBps": None if self.spec is None else self.spec / 1e9,
            "probes_GBps": {k: v / 1e9 for k, v in self.probes.items()}, "device": self.device}


def _label(nbytes: int) -> str:
  return f"{nbytes >> 30} GiB" if nbytes >= 1 << 30 else f"{nbytes >> 20} MiB"


def probe(nbytes: int, passes: int = 16, repeats: int = 5) -> dict:
  """{"read SIZE": bytes/s, "copy SIZE": bytes/s} of a bf16 array of nbytes on the default
  device: the float32 sum of x * i (counted: the bytes read) and c <- c + i (read + written in
  place), `passes` of each inside one program's loop (i enters each pass, so none is hoisted),
  so a call's launch and host sync are paid once for passes x the bytes; the best of
  `repeats` calls, over passes."""
  x = jax.random.normal(jax.random.key(nbytes), (nbytes // 2,), jnp.bfloat16)  # (not constant)
  scale = lambda i: (i + 1).astype(jnp.bfloat16)
  read = jax.jit(lambda a: jax.lax.fori_loop(
      0, passes, lambda i, acc: acc + jnp.sum(a * scale(i), dtype=jnp.float32), jnp.float32(0)))
  copy = jax.jit(lambda a: jax.lax.fori_loop(0, passes, lambda i, c: c + scale(i), a))
  best = lambda fn: min(profiling.call_seconds(fn, x, repeats=repeats))
  out = {f"read {_label(nbytes)}": passes * nbytes / best(read),
         f"copy {_label(nbytes)}": passes * 2 * nbytes / best(copy)}
  x.delete()  # the card also holds the model under test
  return out


def measure(small: bool = False, given: float = 0.0) -> Bandwidth:
  """The floors' bandwidth: `given` (bytes/s) when > 0, else the best of `probe` at SIZES
  (SMALL_SIZES when small), read and copy."""
  device = jax.devices()[0].device_kind
  probes = {} if given > 0 else {k: v for n in (SMALL_SIZES if small else SIZES)
                                 for k, v in probe(n).items()}
  return Bandwidth(given if given > 0 else max(probes.values()), spec_bandwidth(device), probes,
                   device)


def mark(row: dict, ms: float, nbytes: float, bw: Bandwidth, prefix: str = "") -> dict:
  """Fills row's prefix + KEYS for a time of `ms` against the floor of `nbytes`: the floor and
  its ratio at bw, at the spec bandwidth (None without one), and below_floor (ms < the floor).
  Returns row."""
  floor, spec = bw.floor_ms(nbytes), bw.spec_floor_ms(nbytes)
  values = (floor, ms / floor, spec, None if spec is None else ms / spec, bool(ms < floor))
  row.update({prefix + k: v for k, v in zip(KEYS, values)})
  return row


def x_spec(row: dict, prefix: str = "", width: int = 8) -> str:
  """A table's "x spec" cell: the row's ratio to its spec floor, "-" when None."""
  ratio = row.get(prefix + "ratio_to_spec_floor")
  return f"{'-' if ratio is None else f'{ratio:.2f}':>{width}}"


def flag(row: dict, prefix: str = "") -> str:
  """A table line's tail: "  < floor!" when the row is below its (prefix's) floor."""
  return "  < floor!" if row.get(prefix + "below_floor") else ""


def check(rows, bw: Bandwidth | None = None) -> None:
  """Prints each row below one of its floors; exits with status 1 if there is any and the card
  has a datasheet bandwidth (bw's spec, else the rows' bandwidth row's; a CPU has none: its
  floors are indicative and its smoke rows are differences of tiny noisy times). Call it last,
  after the tables."""
  bad = [(r, k[:-len("below_floor")]) for r in rows for k, v in r.items()
         if k.endswith("below_floor") and v is True]
  for r, prefix in bad:
    name = ", ".join(f"{k}={v}" for k, v in r.items()
                     if isinstance(v, (str, int)) and not isinstance(v, bool))
    print(f"BELOW FLOOR: {name}: {r[prefix + 'ratio_to_floor']:.3f}x its {prefix}floor of "
          f"{r[prefix + 'floor_ms']:.4f} ms: a floor that a step beats is a measuring bug "
          "(the bandwidth or the bytes)", flush=True)
  if not bad:
    return
  given = [r.get("spec_GBps") for r in rows if r.get("section") == "bandwidth"]
  if (bw.spec if bw is not None else given[0] if given else "unknown: strict") is not None:
    raise SystemExit(1)
  print("(not failing: this device has no datasheet bandwidth)", flush=True)
