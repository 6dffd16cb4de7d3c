"""The flags the performance scripts share, defined in one place, and the first step of their main:

  common_flags.define("small", "json_out", prefix=64)  # at import: --small, --json_out, --prefix
  args = common_flags.start(SMOKE)                      # first in main

`define` gives the calling script each named flag with the default and help below, or the
default its keyword says; the script's --help lists them as its own. `keep_row` keeps a result
row and writes it where --json_out says.
"""

from __future__ import annotations

import json
import types

from absl import flags

# Flags defined from here belong to the script that asks for them (absl's key flags of a module).
flags.disclaim_key_flags()

SHARED = {  # name: (DEFINE_*, default, help)
    "small": (flags.DEFINE_bool, False, "tiny shapes (CPU smoke run)"),
    "smoke": (flags.DEFINE_bool, False, "tiny shapes, few rounds, on CPU (Pallas kernels in "
              "interpret mode)"),
    "shape": (flags.DEFINE_string, "qwen3-8b", "target shape (harness.SHAPES)"),
    "attention": (flags.DEFINE_string, "xla", "xla or pallas"),
    "runs": (flags.DEFINE_string, "ar,32,64", "comma list: ar, chain or a DDTree budget"),
    "batch": (flags.DEFINE_integer, 1, "batch size"),
    "prefix": (flags.DEFINE_integer, 1024, "cached prefix per sequence"),
    "repeats": (flags.DEFINE_integer, 5, "timed repeats (median)"),
    "compile_threads": (flags.DEFINE_integer, 8, "programs compiled concurrently"),
    "fuse_qkv": (flags.DEFINE_bool, True, "without a mesh, fuse the target's q and k/v weights "
                 "into one (decoder.fuse_qkv), as hf.load_target does"),
    "drafter_int8": (flags.DEFINE_bool, False, "an int8 (W8A8) drafter (drafter.quantize_int8)"),
    "draft_vocab_first": (flags.DEFINE_integer, 0, "draft over ids 0..N-1 only "
                          "(drafter.restrict_vocab); 0 = the whole vocabulary"),
    "round_ms": (flags.DEFINE_float, 10.0, "target duration of a timed round"),
    "rounds": (flags.DEFINE_integer, 5, "timed rounds (median)"),
    "floor_bandwidth": (flags.DEFINE_float, 0.0, "bytes per second of the floors; 0: measure "
                        "them in this run (floors.measure)"),
    "json_out": (flags.DEFINE_string, "", "append each row here as a JSON line"),
}


def define(*names: str, **defaults) -> None:
  """Defines the shared flags `names`, and those named by `defaults` with those defaults."""
  for name in (*names, *defaults):
    define_flag, default, help_text = SHARED[name]
    define_flag(name, defaults.get(name, default), help_text)


def start(smoke: dict | None = None) -> types.SimpleNamespace:
  """main's first step: the persistent compilation cache on as the flags say. Returns the flags
  as attributes; with --smoke, the values in `smoke` replace the defaults of flags not given on
  the command line (tiny shapes for a CPU run)."""
  # imported here: ref_hf_moe.py takes these flags in a python without jax
  from ddtree_jax import engine  # pylint: disable=import-outside-toplevel
  engine.compilation_cache_from_flags()
  values = flags.FLAGS.flag_values_dict()
  if smoke and values.get("smoke"):
    values.update({k: v for k, v in smoke.items() if not flags.FLAGS[k].present})
  return types.SimpleNamespace(**values)


def keep_row(rows: list, row: dict, json_out: str = "", echo: bool = True) -> dict:
  """Appends row to rows, prints it as a JSON line when echo, and appends that line to the file
  json_out (--json_out; '' = none). Returns row."""
  line = json.dumps(row)
  rows.append(row)
  if echo:
    print(line, flush=True)
  if json_out:
    with open(json_out, "a") as f:
      f.write(line + "\n")
  return row
