"""Slot-engine step vs the static-batch decode loop's step at the same batch: the Qwen3-8B shape
(random bf16 weights) and its 5-layer DFlash drafter, every slot busy.

  python -m experiments.perf.bench_slots            # one H200: AR, DDTree B=16 / 64 x 1-32 slots
  python -m experiments.perf.bench_slots --small    # tiny shapes on CPU (smoke)

Per (run, slots): the static program is `decode.decode_loop` over a batch of `slots` rows; the
slot program is the server's chunk (`slot_programs.chunk`: per-slot settings and PRNG keys, stop
ids and max_tokens checked on device, the sampling branch behind a condition, its step count a
traced argument, each slot's new tokens gathered for the copy back), both over --steps steps
from the same random state (caches of --prefix rows, every row busy, every row greedy unless
--temperature > 0). A step is a call's wall time over the steps it ran (the per-call cost is in
both; the slot call's includes copying its new tokens back, as the server does), the median of
--repeats calls, the two programs timed alternately. A run's programs are compiled together,
--compile_threads at a time, then timed. Goal: slot / static <= 1.1. Prints a table and appends
one JSON line per row to --json_out.
"""

import concurrent.futures
import dataclasses
import json
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import engine
from ddtree_jax.request import default_attention
from ddtree_jax.speculative import decode
from ddtree_jax.speculative import sampling as row_sampling
from ddtree_jax.serving import programs as slot_programs
from ddtree_jax.serving import slots
from ddtree_jax.kernels import Kernels
from experiments.perf import common_flags, harness

common_flags.define("small", "prefix", "compile_threads", "json_out", runs="ar,16,64")
flags.DEFINE_string("slots", "1,8,16,32", "decode slots (the batch of both programs)")
flags.DEFINE_integer("steps", 16, "decode steps per timed call (the chunk's K)")
flags.DEFINE_integer("repeats", 5, "timed calls per program (median), after one warm-up call")
flags.DEFINE_string("drafter", "int8:v32768", "bf16 or int8, optionally ':vN' (drafting over "
                    "ids 0..N-1), as bench_step's --drafters")
flags.DEFINE_string("attention", "", "xla or pallas ('' = pallas on GPU, xla on CPU)")
flags.DEFINE_float("temperature", 0.0, "> 0: every row samples (the static loop at this "
                   "temperature, every slot at it), else both greedy")
flags.DEFINE_bool("sampling", True, "the slot program with its sampling branch (the server's "
                  "default); --nosampling: the greedy-only program (SlotConfig.sampling=False)")
FLAGS = flags.FLAGS
engine.define_compilation_cache_flags()


def parse_runs(text):
  """'ar,chain,16' -> [("ar", 0), ("chain", 0), ("ddtree", 16)]."""
  return [(x, 0) if x in ("ar", "chain") else ("ddtree", int(x)) for x in text.split(",") if x]


def busy_settings(b: int, steps: int, temperature: float) -> row_sampling.Settings:
  """Every slot busy for `steps` steps (max_tokens steps + 1), no stop id."""
  s = row_sampling.Settings.free(b, slots.SlotConfig.max_stop_ids)
  s.limit[:] = steps + 1
  s.temperature[:] = temperature
  return jax.tree.map(jnp.asarray, s)


def slot_state(case: harness.Case, key=None) -> decode.DecodeState:
  """The case's random state with one PRNG key per row, as the slot engine keeps it."""
  st = case.state(key)
  return dataclasses.replace(st, key=jax.random.split(jax.random.key(3), case.batch))


def compile_pair(case: harness.Case, settings):
  """(static loop, slot chunk, seconds): both compiled for the case's shapes."""
  t0 = time.perf_counter()
  static, _, _ = case.compile()
  shape = jax.eval_shape(lambda: slot_state(case))
  steps = jnp.int32(FLAGS.steps)
  chunk = slot_programs.chunk.lower(
      case.tparams, case.dparams, shape, settings, steps, tcfg=case.tcfg, dcfg=case.dcfg,
      lc=case.lc, max_steps=FLAGS.steps, sampling=FLAGS.sampling,
      max_top_k=slots.SlotConfig.max_top_k).compile()
  run = lambda tparams, dparams, state, settings: chunk(tparams, dparams, state, settings, steps)
  return static, run, time.perf_counter() - t0


def time_pair(case, static, chunk, settings):
  """(static step s, slot step s, static steps, slot steps): medians of alternate calls."""
  ts, tc, n_static, n_slot = [], [], 0, 0
  for i in range(FLAGS.repeats + 1):  # call 0 warms up
    st = jax.block_until_ready(case.state())
    t = time.perf_counter()
    out = jax.block_until_ready(static(case.tparams, case.dparams, st))
    ts.append(time.perf_counter() - t)
    n_static = int(out.step)
    del st, out
    st = jax.block_until_ready(slot_state(case))
    t = time.perf_counter()
    out, new = jax.block_until_ready(chunk(case.tparams, case.dparams, st, settings))
    new = np.asarray(new)  # the copy back is part of the server's chunk
    tc.append(time.perf_counter() - t)
    n_slot = int(out.step)
    del st, out, new
  return (float(np.median(ts[1:])) / n_static, float(np.median(tc[1:])) / n_slot,
          n_static, n_slot)


def main(_):
  common_flags.start()
  t_start = time.perf_counter()
  small = FLAGS.small
  tcfg = harness.target_config(small)
  tp = harness.random_target(tcfg, jax.random.key(0))
  dp, dcfg = harness.random_drafter(tcfg, jax.random.key(1), small)
  drafter = FLAGS.drafter
  if small and ":v" in drafter:  # the small vocabulary has 512 ids
    base, _, n = drafter.partition(":v")
    drafter = f"{base}:v{min(int(n), tcfg.vocab_size // 2)}" if n.isdigit() else drafter
  try:
    dp = harness.drafter_variants(dp, tp, [drafter])[drafter]
  except ValueError as e:
    raise app.UsageError(f"--drafter: {e}") from None
  attention = FLAGS.attention or default_attention()
  prefix = 64 if small else FLAGS.prefix
  print(f"devices: {jax.devices()}  {attention} attention, prefix {prefix}, {FLAGS.steps} "
        f"steps per call, temperature {FLAGS.temperature}, sampling branch {FLAGS.sampling}",
        flush=True)
  groups = []  # per run: its programs compiled together, then timed (a cut run keeps rows)
  for method, budget in parse_runs(FLAGS.runs):
    groups.append([])
    for b in harness.ints(FLAGS.slots):
      lc = decode.LoopConfig(method=method, max_new_tokens=FLAGS.steps + 1,
                             num_drafts=0 if method == "ar" else dcfg.num_drafts, budget=budget,
                             temperature=FLAGS.temperature, kernels=Kernels(attention))
      d = (None, None) if method == "ar" else (dp, dcfg)
      case = harness.Case.make(tp, tcfg, d[0], d[1], lc, b, prefix)
      groups[-1].append((method, budget, case, busy_settings(b, FLAGS.steps, FLAGS.temperature)))
  rows = []
  for jobs in groups:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, FLAGS.compile_threads)) as ex:
      compiled = list(ex.map(lambda j: compile_pair(j[2], j[3]), jobs))
    print(f"compiled {2 * len(jobs)} programs in {time.perf_counter() - t0:.1f} s "
          f"({FLAGS.compile_threads} threads)", flush=True)
    for (method, budget, case, settings), (static, chunk, compile_s) in zip(jobs, compiled):
      s_static, s_slot, n_static, n_slot = time_pair(case, static, chunk, settings)
      row = {"section": "slots", "method": method, "budget": budget, "slots": case.batch,
             "prefix": prefix, "steps": FLAGS.steps, "static_steps": n_static,
             "slot_steps": n_slot, "static_step_ms": s_static * 1e3,
             "slot_step_ms": s_slot * 1e3, "ratio": s_slot / s_static,
             "temperature": FLAGS.temperature, "sampling": FLAGS.sampling,
             "drafter": None if method == "ar" else drafter, "attention": attention,
             "small": small, "compile_s": compile_s}
      rows.append(row)
      print(json.dumps(row), flush=True)
      if FLAGS.json_out:
        with open(FLAGS.json_out, "a") as f:
          f.write(json.dumps(row) + "\n")
    del compiled
  print("\n== slot engine step vs static decode loop step, ms (goal: ratio <= 1.1)")
  print(f"{'method':<8}{'budget':>7}{'slots':>6}{'slot step':>11}{'static step':>13}{'ratio':>7}")
  for r in rows:
    print(f"{r['method']:<8}{r['budget'] or '-':>7}{r['slots']:>6}{r['slot_step_ms']:>11.3f}"
          f"{r['static_step_ms']:>13.3f}{r['ratio']:>7.3f}")
  print(f"total {time.perf_counter() - t_start:.1f} s", flush=True)


if __name__ == "__main__":
  app.run(main)
