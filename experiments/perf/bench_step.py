"""Step-time benchmark on a Qwen3-8B-shaped target (+ 5-layer DFlash drafter), random bf16 weights.

  python -m experiments.perf.bench_step                # full table (H200)
  python -m experiments.perf.bench_step --small        # tiny shapes, runs on CPU (smoke)
  python -m experiments.perf.bench_step --mesh_tp=8    # tensor parallel (ar/spec sections)

Prints, in one run: the floors' bandwidth (`floors.measure`); AR step vs the weight+KV bandwidth
floor (a hybrid's: its attention layers' KV rows, and its Gated DeltaNet states read and written;
on a mesh those bytes over all its devices) and vs the same bytes at the card's spec bandwidth;
per-step time of chain and DDTree by budget with the per-stage split (draft, tree, verify,
accept+commit, each its own program); the while_loop driver vs a Python loop over the same jitted
step. Medians of repeats; compile time reported separately (the programs of a group compile
concurrently in threads, then run one at a time). Steps are timed inside the real decode loop
(lax.while_loop; with --steps_per_check=K, K steps per loop iteration). The random drafter
accepts ~1 token per step, so a row runs --steps steps; a K that does not divide them adds idle
steps (their time counts, the steps do not).

A row's step time is one call's wall time over its steps, so it includes the call's fixed cost
(dispatch, the first condition check, the final sync and a slower first step:
docs/findings/host-loop-and-cuda-graphs.md), spread over --steps. With --marginal_steps=N every
ar/spec row is also compiled for N steps and both lengths are timed alternately: `round` is the slope (ms
per extra step, a round's time without the per-call cost) and `per-call` the intercept. Every
row's cache then has room for N steps, so both lengths run the same kernels.
"""

import json
import time

from absl import app, flags
import jax
import numpy as np

from ddtree_jax import engine, sharding
from ddtree_jax.speculative import decode
from ddtree_jax.models import decoder
from ddtree_jax.tools import profiling
from ddtree_jax.kernels import Kernels
from experiments.perf import common_flags, floors, harness

common_flags.define("small", "repeats", "json_out", "fuse_qkv", "floor_bandwidth",
                    compile_threads=1)
flags.DEFINE_string("sections", "bandwidth,ar,spec,host",
                    "comma list of: bandwidth (the floors' bandwidth row, also written with ar / "
                    "spec; 'copy' is its old name), compile (serial compile seconds per "
                    "program), ar, spec, host")
flags.DEFINE_string("budgets", "chain,1,4,16,32,64,128,256",
                    "spec runs of the full sweep: 'chain' or a ddtree budget")
flags.DEFINE_string("batches", "1,8", "batch sizes")
flags.DEFINE_string("prefixes", "1024,8192", "AR prefix lengths")
flags.DEFINE_string("spec_prefixes", "1024", "prefix lengths of chain/ddtree rows (first: full sweep)")
flags.DEFINE_string("alt_runs", "chain,32", "spec runs for the other attentions / prefixes")
flags.DEFINE_string("attention", "xla", "comma list: xla, pallas (first: full sweep)")
flags.DEFINE_integer("steps", 32, "decode steps timed per row")
flags.DEFINE_string("drafters", "bf16", "comma list: bf16, int8 (int8 W8A8 drafter with its "
                    "own int8 lm_head, drafter.quantize_int8), each optionally with ':vN' (drafts "
                    "over ids 0..N-1 only, drafter.restrict_vocab), e.g. int8:v32768; spec rows "
                    "run for each")
flags.DEFINE_bool("stages", True, "also time the stages as separate programs")
flags.DEFINE_integer("steps_per_check", 1, "decode steps per check of the loop's stop condition "
                     "(LoopConfig.steps_per_check; ar and spec rows)")
flags.DEFINE_string("stage_runs", "", "runs of the sweep that get stage times ('' = all)")
flags.DEFINE_integer("marginal_steps", 0, "also time each ar/spec row over this many steps (> "
                     "--steps) and report the per-step slope between the two lengths (a round "
                     "without the per-call cost) and the per-call cost; 0 = off")
flags.DEFINE_string("shape", "qwen3-8b", "target shape (harness.SHAPES; dense: qwen3-8b, "
                    "qwen3-32b)")
sharding.define_mesh_flags()
sharding.define_layout_flag()
FLAGS = flags.FLAGS

ROWS = []


def emit(row, mesh):
  if row["section"] in ("ar", "spec"):  # these run on the --mesh_* mesh
    row.update({k: (dict(mesh.shape).get(k, 1) if mesh is not None else 1) for k in ("dp", "tp")})
    row.update(shape=FLAGS.shape, layout=FLAGS.mesh_layout)
    row["steps_per_check"] = FLAGS.steps_per_check
  ROWS.append(row)
  print(json.dumps(row), flush=True)
  if FLAGS.json_out:
    with open(FLAGS.json_out, "a") as f:
      f.write(json.dumps(row) + "\n")


def parse_runs(text):
  """'chain,32,64' -> [("chain", 0), ("ddtree", 32), ("ddtree", 64)]."""
  return [("chain", 0) if x == "chain" else ("ddtree", int(x)) for x in text.split(",") if x]


engine.define_compilation_cache_flags()


def main(_):
  if "compile" in FLAGS.sections.split(","):  # it times compiles: a warm cache would hide them
    print("--sections=compile: the persistent compilation cache stays off", flush=True)
  else:
    engine.compilation_cache_from_flags()
  small = FLAGS.small
  sections = FLAGS.sections.split(",")
  tcfg = harness.target_config(small, FLAGS.shape)
  key = jax.random.key(0)
  mesh = sharding.mesh_from_flags()
  rules = sharding.rules_from_flags()
  if FLAGS.marginal_steps and FLAGS.marginal_steps <= FLAGS.steps:
    raise app.UsageError(f"--marginal_steps={FLAGS.marginal_steps} must exceed "
                         f"--steps={FLAGS.steps}")
  min_new = FLAGS.marginal_steps + 1 if FLAGS.marginal_steps else 0
  tp = harness.random_target(tcfg, key, mesh, FLAGS.fuse_qkv, rules)
  dp, dcfg = harness.random_drafter(tcfg, jax.random.key(1), small)
  try:
    dps = harness.drafter_variants(dp, tp, FLAGS.drafters.split(","), mesh, rules)
  except ValueError as e:
    raise app.UsageError(f"--drafters: {e}") from None
  dp = next(iter(dps.values()))
  batches = harness.ints(FLAGS.batches)
  attns = FLAGS.attention.split(",")
  spec_prefixes = harness.ints(FLAGS.spec_prefixes)
  print(f"devices: {jax.devices()}  target params {decoder.param_bytes(tp) / 1e9:.2f} GB  "
        "drafter " + ", ".join(f"{k} {decoder.param_bytes(v) / 1e9:.2f} GB" for k, v in dps.items()),
        flush=True)
  if {"bandwidth", "copy", "ar", "spec"} & set(sections):
    bw = floors.measure(small, FLAGS.floor_bandwidth)
    print(bw.describe(), flush=True)
    emit(bw.row(), mesh)
  weight_bytes = decoder.param_bytes(tp) - tp.embed.size * tp.embed.dtype.itemsize
  kv_row = 2 * len(tcfg.attention_layers) * tcfg.num_kv_heads * tcfg.head_dim * 2  # per token, seq
  state_bytes = harness.recurrent_bytes(tcfg)  # per seq and step: read and written
  chips = 1 if mesh is None else mesh.size  # a mesh's floor: each byte read by one device at least
  steps = FLAGS.steps

  def loop_config(attn, **kw):
    return decode.LoopConfig(kernels=Kernels(attn, mesh, rules),
                             steps_per_check=FLAGS.steps_per_check,
                             max_new_tokens=steps + 1, **kw)

  def ar_row(attn, b, prefix):
    case = harness.Case.make(tp, tcfg, None, None, loop_config(attn, method="ar"), b, prefix,
                             min_new)
    return {"section": "ar", "attention": attn, "batch": b, "prefix": prefix, "case": case,
            "stages": False}

  def spec_row(attn, method, budget, b, prefix, stages, drafter):
    lc = loop_config(attn, method=method, num_drafts=15, budget=budget)
    case = harness.Case.make(tp, tcfg, dps[drafter], dcfg, lc, b, prefix, min_new)
    return {"section": "spec", "attention": attn, "method": method, "budget": budget,
            "batch": b, "prefix": prefix, "drafter": drafter, "case": case, "stages": stages}

  groups = []  # each group is compiled in parallel, then timed serially
  if "ar" in sections:
    groups.append([ar_row(a, b, p) for a in attns for b in batches
                   for p in harness.ints(FLAGS.prefixes)])
  if "spec" in sections:  # full sweep for the first (attention, prefix); alt_runs for the rest
    have = {(r["attention"], r["batch"], r["prefix"]) for g in groups for r in g}
    need = [(a, b, p) for a in attns for b in batches for p in spec_prefixes]
    missing = [ar_row(*k) for k in need if k not in have]
    if missing:
      groups.append(missing)
    for b in batches:  # per batch: the full sweep, then the other (attention, prefix) pairs
      staged = set(parse_runs(FLAGS.stage_runs or FLAGS.budgets))
      sweep = [spec_row(attns[0], m, bud, b, spec_prefixes[0], FLAGS.stages and (m, bud) in staged,
                        dn) for m, bud in parse_runs(FLAGS.budgets) for dn in dps]
      groups += [sweep[i:i + 4] for i in range(0, len(sweep), 4)]  # rows come out as they go
      alt = [spec_row(a, m, bud, b, p, FLAGS.stages and a == attns[0] and (m, bud) in staged, dn)
             for dn in dps for a in attns for p in spec_prefixes
             if (a, p) != (attns[0], spec_prefixes[0]) for m, bud in parse_runs(FLAGS.alt_runs)]
      if alt:
        groups.append(alt)

  if "compile" in sections:  # serial compile seconds of every program, nothing run
    for m, bud in [("ar", 0)] + parse_runs(FLAGS.budgets):
      for b in batches:
        lc = loop_config(attns[0], method=m, num_drafts=0 if m == "ar" else 15, budget=bud)
        d = (None, None) if m == "ar" else (dp, dcfg)
        case = harness.Case.make(tp, tcfg, d[0], d[1], lc, b, spec_prefixes[0], min_new)
        shape = case.state_shape()
        t0 = time.perf_counter()
        decode.decode_loop.lower(tp, d[0], shape, tcfg=tcfg, dcfg=d[1], lc=lc).compile()
        secs = {"loop": time.perf_counter() - t0}
        profiling.compile_stages(tp, tcfg, d[0], d[1], lc, shape, seconds=secs)
        emit({"section": "compile", "attention": attns[0], "method": m, "budget": bud,
              "batch": b, "prefix": spec_prefixes[0], **{f"{k}_s": v for k, v in secs.items()}},
             mesh)

  ar_ms, ar_round = {}, {}
  for group in groups:
    compiled = harness.compile_cases([r["case"] for r in group], FLAGS.compile_threads,
                                     [r.pop("stages") for r in group])
    for row, (loop, progs, compile_s) in zip(group, compiled):
      case = row.pop("case")
      b, prefix = case.batch, case.prefix
      s = harness.step_seconds(loop, case, FLAGS.repeats)
      row.update(step_ms=s * 1e3, compile_s=compile_s)
      if FLAGS.marginal_steps:
        long_case = case.with_steps(FLAGS.marginal_steps)
        long, _, _ = long_case.compile()
        per_round, per_call = harness.round_seconds(loop, case, long, long_case, FLAGS.repeats)
        row.update(round_ms=per_round * 1e3, per_call_ms=per_call * 1e3)
      if row["section"] == "ar":
        ar_ms[(row["attention"], b, prefix)] = s * 1e3
        ar_round[(row["attention"], b, prefix)] = row.get("round_ms")
        floors.mark(row, s * 1e3, (weight_bytes + b * (prefix * kv_row + state_bytes)) / chips, bw)
      else:
        row["vs_ar_step"] = s * 1e3 / ar_ms[(row["attention"], b, prefix)]
        if FLAGS.marginal_steps:
          row["vs_ar_round"] = row["round_ms"] / ar_round[(row["attention"], b, prefix)]
        if progs is not None:  # same shapes as the loop's state (capacity included)
          st = case.state(jax.random.key(2))
          stages = profiling.stage_seconds(tp, tcfg, case.dparams, dcfg, case.lc, st,
                                           repeats=FLAGS.repeats, programs=progs)
          row.update({f"{k}_ms": v * 1e3 for k, v in stages.items()})
      emit(row, mesh)

  if "host" in sections:  # while_loop vs Python loop over the jitted step, small model
    scfg = harness.target_config(True)
    sp = decoder.init_params(scfg, key)
    sdp, sdcfg = harness.random_drafter(scfg, jax.random.key(1), True)
    for method, budget in (("ar", 0), ("ddtree", 32)):
      lc = decode.LoopConfig(method=method, max_new_tokens=129, num_drafts=15 if budget else 0,
                             budget=budget)
      d = (sdp, sdcfg) if budget else (None, None)
      case = harness.Case.make(sp, scfg, d[0], d[1], lc, 1, 64)
      loop, _, _ = case.compile()
      s_loop = harness.step_seconds(loop, case, FLAGS.repeats)
      times = []
      for _ in range(FLAGS.repeats + 1):
        st = jax.block_until_ready(case.state())
        t = time.perf_counter()
        out = jax.block_until_ready(profiling.python_loop(sp, scfg, d[0], d[1], lc, st))
        times.append((time.perf_counter() - t) / int(out.step))
      s_py = float(np.median(times[1:]))
      emit({"section": "host", "method": method, "budget": budget,
            "while_loop_step_ms": s_loop * 1e3, "python_loop_step_ms": s_py * 1e3,
            "python_over_while": s_py / s_loop}, mesh)
  print_tables()
  floors.check(ROWS)


def print_tables():
  print("\n== AR decode step vs weight+KV bandwidth floor")
  print(f"{'attn':<7}{'batch':>6}{'prefix':>8}{'step ms':>10}{'floor ms':>10}{'ratio':>8}"
        f"{'x spec':>8}")
  for r in ROWS:
    if r["section"] == "ar":
      print(f"{r['attention']:<7}{r['batch']:>6}{r['prefix']:>8}{r['step_ms']:>10.3f}"
            f"{r['floor_ms']:>10.3f}{r['ratio_to_floor']:>8.2f}{floors.x_spec(r)}{floors.flag(r)}")
  print("\n== Speculative step (while_loop) and stages (separate programs), ms")
  print(f"{'attn':<7}{'method':<8}{'B':>5}{'drafter':>13}{'batch':>6}{'prefix':>7}{'step':>9}"
        f"{'xAR':>7}{'draft':>8}"
        f"{'tree':>8}{'verify':>8}{'acc+com':>8}")
  for r in ROWS:
    if r["section"] == "spec":
      print(f"{r['attention']:<7}{r['method']:<8}{r['budget']:>5}{r['drafter']:>13}{r['batch']:>6}"
            f"{r['prefix']:>7}"
            f"{r['step_ms']:>9.3f}"
            f"{r['vs_ar_step']:>7.2f}" + "".join(
                f"{r[k]:>8.3f}" if k in r else f"{'-':>8}"
                for k in ("draft_ms", "tree_ms", "verify_ms", "accept_commit_ms")))
  rounds = [r for r in ROWS if "round_ms" in r]
  if rounds:
    print(f"\n== Round = ms per extra step between --steps={FLAGS.steps} and "
          f"--marginal_steps={FLAGS.marginal_steps} (no per-call cost); per-call = the intercept")
    print(f"{'attn':<7}{'method':<8}{'B':>5}{'drafter':>13}{'batch':>6}{'prefix':>7}{'step':>9}"
          f"{'round':>9}{'xAR':>7}{'per-call':>10}")
    for r in rounds:
      method, budget = ("ar", 0) if r["section"] == "ar" else (r["method"], r["budget"])
      print(f"{r['attention']:<7}{method:<8}{budget:>5}{r.get('drafter', '-'):>13}"
            f"{r['batch']:>6}{r['prefix']:>7}{r['step_ms']:>9.3f}{r['round_ms']:>9.3f}"
            f"{r.get('vs_ar_round', 1.0):>7.2f}{r['per_call_ms']:>10.3f}")
  for r in ROWS:
    if r["section"] == "compile":
      print(f"compile s: {r['attention']} {r['method']}/B={r['budget']} batch {r['batch']}: " +
            ", ".join(f"{k[:-2]} {v:.1f}" for k, v in r.items() if k.endswith("_s")))
  for r in ROWS:
    if r["section"] == "host":
      print(f"host: {r['method']}/B={r['budget']} while_loop {r['while_loop_step_ms']:.3f} ms/step, "
            f"python loop {r['python_loop_step_ms']:.3f} ms/step ({r['python_over_while']:.2f}x)")


if __name__ == "__main__":
  app.run(main)
