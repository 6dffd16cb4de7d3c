"""Measurement helpers: per-stage step times (each stage its own program), a Python-loop driver
over the jitted step, to price the host round trip that `lax.while_loop` avoids, and the decode
loop body's kernels per stage read from an optimized HLO."""

from __future__ import annotations

import functools
import re
import time

import jax
import numpy as np

from ddtree_jax.speculative import decode


def call_seconds(fn, *args, repeats: int = 10) -> list[float]:
  """Wall times of `repeats` calls of fn(*args) after one warm-up call (compile excluded)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return times


def median_seconds(fn, *args, repeats: int = 10) -> float:
  """Median wall time of fn(*args) after one warm-up call (compile excluded)."""
  return float(np.median(call_seconds(fn, *args, repeats=repeats)))


def compile_stages(tparams, tcfg, dparams, dcfg, lc: decode.LoopConfig, state,
                   seconds: dict | None = None) -> dict:
  """AOT-compiles draft, tree, verify and accept+commit as separate programs for these shapes.

  `state` may be concrete or ShapeDtypeStructs (with shardings when on a mesh). `seconds`, when
  given, receives each program's lower+compile time.
  """
  seconds = {} if seconds is None else seconds

  def aot(name, fn, *args):
    t0 = time.perf_counter()
    out[name] = fn.lower(*args).compile()
    seconds[name] = time.perf_counter() - t0

  key = jax.random.key(0)
  vocab = _draft_vocab(dparams, dcfg, lc)
  draft = jax.jit(lambda dp, tp, st: decode.draft(dp, tp, dcfg, lc, st))
  tree = jax.jit(lambda logits, bonus, vocab: decode.make_tree(lc, logits, bonus, vocab))
  verify = jax.jit(lambda tp, st, tr: decode.verify_and_pick(tp, tcfg, dcfg, lc, st, tr, key))
  commit = jax.jit(lambda dp, st, *rest: decode.accept_and_commit(dp, dcfg, lc, st, *rest, key),
                   donate_argnums=(1,))
  out = {}
  logits = None
  if lc.method != "ar":
    aot("draft", draft, dparams, tparams, state)
    logits = jax.eval_shape(draft, dparams, tparams, state)
  aot("tree", tree, logits, state.bonus, vocab)
  tr = jax.eval_shape(tree, logits, state.bonus, vocab)
  aot("verify", verify, tparams, state, tr)
  rest = (tr,) + tuple(jax.eval_shape(verify, tparams, state, tr))
  aot("accept_commit", commit, dparams, state, *rest)
  return out


def _draft_vocab(dparams, dcfg, lc):
  return None if lc.method == "ar" else dcfg.vocab(dparams)


def stage_seconds(tparams, tcfg, dparams, dcfg, lc: decode.LoopConfig, state, repeats: int = 10,
                  programs: dict | None = None) -> dict:
  """Median seconds of draft, tree, verify, accept+commit, each compiled on its own.

  `programs`: the output of `compile_stages` for these shapes (compiled here when None).
  `state` is consumed (accept+commit donates it, as in the loop). Returns a dict of floats.
  """
  p = programs or compile_stages(tparams, tcfg, dparams, dcfg, lc, state)
  out = {}
  logits = None
  if lc.method != "ar":
    out["draft"] = median_seconds(p["draft"], dparams, tparams, state, repeats=repeats)
    logits = p["draft"](dparams, tparams, state)
  vocab = _draft_vocab(dparams, dcfg, lc)
  out["tree"] = median_seconds(p["tree"], logits, state.bonus, vocab, repeats=repeats)
  tr = p["tree"](logits, state.bonus, vocab)
  out["verify"] = median_seconds(p["verify"], tparams, state, tr, repeats=repeats)
  rest = (tr,) + tuple(p["verify"](tparams, state, tr))
  times = []
  for i in range(repeats + 1):  # the state flows through, donated each time
    t = time.perf_counter()
    state = jax.block_until_ready(p["accept_commit"](dparams, state, *rest))
    if i:
      times.append(time.perf_counter() - t)
  out["accept_commit"] = float(np.median(times))
  return out


def python_loop(tparams, tcfg, dparams, dcfg, lc: decode.LoopConfig, state):
  """Drives the same jitted step from Python, reading `done` back every step (host round trip)."""
  step = _jitted_step(tcfg, dcfg, lc)
  for _ in range(max(lc.max_new_tokens - 1, 0)):
    if bool(np.all(jax.device_get(state.done))):
      break
    state = step(tparams, dparams, state)
  return state


@functools.cache
def _jitted_step(tcfg, dcfg, lc):
  return jax.jit(lambda tp, dp, st: decode.step(tp, tcfg, dp, dcfg, lc, st), donate_argnums=(2,))


KERNEL_OPS = ("fusion", "custom-call", "gather", "scatter", "reduce", "sort", "convert", "copy",
              "dynamic-update-slice", "slice", "concatenate")
STAGES = ("draft", "tree", "verify", "accept_commit")


def _computations(hlo: str) -> dict[str, str]:
  """An optimized HLO text's computations by name."""
  out = {}
  for comp in re.split(r"\n(?=\S.*\{\n)", hlo):
    m = re.match(r"(?:ENTRY )?%?([\w.\-]+)", comp)
    if m:
      out[m.group(1)] = comp
  return out


def costliest_path(hlo: str) -> dict[str, int]:
  """Kernels one iteration of the entry computation's while loop (the decode loop) launches
  along its costliest path: each `conditional` counted as itself plus its branch with the most
  kernels, recursively (a step of budget="auto" runs one branch of each of its switches), and a
  nested while loop as its body times its known trip count (once when unknown). Returns
  {"kernels": all, "conditionals": how many on the path, "copies": copy kernels on the path}."""
  comps = _computations(hlo)
  ops = "|".join(re.escape(op) for op in KERNEL_OPS + ("conditional", "while"))
  entry = next((c for c in re.split(r"\n(?=\S.*\{\n)", hlo) if c.startswith("ENTRY")), "")
  loop = re.search(r" while\(.*?body=%?([\w.\-]+)", entry)
  if not loop:
    raise ValueError("costliest_path: no while loop in this HLO's entry computation")

  def walk(name):
    total = {"kernels": 0, "conditionals": 0, "copies": 0}
    for line in comps[name].splitlines()[1:]:
      m = re.match(rf"\s*(?:ROOT )?\S+ = (?:\(.*?\)|\S+) ({ops})\(", line)
      if not m:
        continue
      if m.group(1) == "while":
        trip = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
        inner = walk(re.search(r"body=%?([\w.\-]+)", line).group(1))
        total = {k: total[k] + inner[k] * (int(trip.group(1)) if trip else 1) for k in total}
        continue
      total["kernels"] += 1
      total["copies"] += m.group(1) == "copy"
      if m.group(1) == "conditional":
        branches = re.search(r"branch_computations=\{([^}]*)\}", line)
        names = ([b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else
                 re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line))
        best = max((walk(b) for b in names), key=lambda t: t["kernels"])
        total = {k: total[k] + best[k] for k in total}
        total["conditionals"] += 1
    return total
  return walk(loop.group(1))


def loop_body_kernels(hlo: str) -> list[tuple[str, str, str]]:
  """(stage, op name, "result type  op") of every top-level kernel-launching op of the decode
  loop's body, in order: the computation with the most ops in a named stage. The stage is the
  `decode.step` scope in the op's metadata ("other" when none)."""
  comps = re.split(r"\n(?=\S.*\{\n)", hlo)
  body = max(comps, key=lambda c: sum(c.count(f"/{s}/") for s in STAGES))
  ops = "|".join(re.escape(op) for op in KERNEL_OPS)
  out = []
  for line in body.splitlines()[1:]:
    m = re.match(rf"\s*(?:ROOT )?(\S+) = (\(.*?\)|\S+) ({ops})\(", line)
    if not m:
      continue
    op_name = re.search(r'op_name="([^"]*)"', line)
    op_name = op_name.group(1) if op_name else ""
    stage = next((s for s in STAGES if f"/{s}/" in op_name), "other")
    out.append((stage, m.group(1), f"{m.group(2)[:40]}  {op_name.rsplit('/', 1)[-1]}"))
  return out
