"""Step-time benchmark on a Qwen3-8B-shaped target (+ 5-layer DFlash drafter), random bf16 weights.

  python experiments/bench_step.py                 # full table (H200)
  python experiments/bench_step.py --small         # tiny shapes, runs on CPU (smoke)
  python experiments/bench_step.py --mesh_tp=8      # tensor parallel (ar/spec sections)

Prints, in one run: copy bandwidth; AR step vs the weight+KV bandwidth floor; per-step time of
chain and DDTree by budget with the per-stage split (draft, tree, verify, accept+commit, each its
own program); the while_loop driver vs a Python loop over the same jitted step. Medians of repeats;
compile time reported separately (the programs of a group compile concurrently in threads, then
run one at a time). Steps are timed inside the real decode loop (lax.while_loop; with
--steps_per_check=K, K steps per loop iteration). The random drafter accepts ~1 token per step,
so a row runs --steps steps; a K that does not divide them adds idle steps (their time counts,
the steps do not).

A row's step time is one call's wall time over its steps, so it includes the call's fixed cost
(~2 ms on the H200: ~1 ms of dispatch, first condition check and final sync, and a first step
0.5-1 ms slower than the rest), spread over --steps. With --marginal_steps=N every ar/spec row is also compiled for N
steps and both lengths are timed alternately: `round` is the slope (ms per extra step, a round's
time without the per-call cost) and `per-call` the intercept. Every row's cache then has room for
N steps, so both lengths run the same kernels.
"""

import concurrent.futures
import dataclasses
import json
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import decode, model, profiling, sharding
from ddtree_jax.config import ModelConfig
from ddtree_jax.drafter import DrafterConfig, DrafterParams, quantize_int8, restrict_vocab

flags.DEFINE_bool("small", False, "tiny shapes (CPU smoke run)")
flags.DEFINE_string("sections", "copy,ar,spec,host",
                    "comma list of: copy, compile (serial compile seconds per program), ar, spec, host")
flags.DEFINE_string("budgets", "chain,1,4,16,32,64,128,256",
                    "spec runs of the full sweep: 'chain' or a ddtree budget")
flags.DEFINE_string("batches", "1,8", "batch sizes")
flags.DEFINE_string("prefixes", "1024,8192", "AR prefix lengths")
flags.DEFINE_string("spec_prefixes", "1024", "prefix lengths of chain/ddtree rows (first: full sweep)")
flags.DEFINE_string("alt_runs", "chain,32", "spec runs for the other attentions / prefixes")
flags.DEFINE_integer("compile_threads", 1, "programs of a group compiled concurrently (threads)")
flags.DEFINE_string("attention", "xla", "comma list: xla, pallas (first: full sweep)")
flags.DEFINE_integer("steps", 32, "decode steps timed per row")
flags.DEFINE_integer("repeats", 5, "timed repeats (median)")
flags.DEFINE_string("json_out", "", "append each row here as a JSON line as soon as measured")
flags.DEFINE_string("drafters", "bf16", "comma list: bf16, int8 (int8 W8A8 drafter with its "
                    "own int8 lm_head, drafter.quantize_int8), each optionally with ':vN' (drafts "
                    "over ids 0..N-1 only, drafter.restrict_vocab), e.g. int8:v32768; spec rows "
                    "run for each")
flags.DEFINE_bool("fuse_qkv", True, "without a mesh, fuse the target's q and k/v weights into "
                  "one (model.fuse_qkv), as checkpoint.load_target does")
flags.DEFINE_bool("stages", True, "also time the stages as separate programs")
flags.DEFINE_integer("steps_per_check", 1, "decode steps per check of the loop's stop condition "
                     "(LoopConfig.steps_per_check; ar and spec rows)")
flags.DEFINE_string("stage_runs", "", "runs of the sweep that get stage times ('' = all)")
flags.DEFINE_integer("marginal_steps", 0, "also time each ar/spec row over this many steps (> "
                     "--steps) and report the per-step slope between the two lengths (a round "
                     "without the per-call cost) and the per-call cost; 0 = off")
sharding.define_mesh_flags()
FLAGS = flags.FLAGS

ROWS = []
MESH = None  # set from --mesh_dp/--mesh_tp in main
MIN_NEW_TOKENS = 0  # caches hold at least this many new tokens (--marginal_steps + 1), set in main


def qwen3_8b(small):
  if small:
    return ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                       rope_theta=1e6, max_position_embeddings=40960)
  return ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
                     head_dim=128, rope_theta=1e6, max_position_embeddings=40960)


def target_params(tcfg, key):
  """Random target weights on the --mesh_* mesh, or fused (--fuse_qkv) on one device."""
  params = sharding.shard_params(model.init_params(tcfg, key), MESH)
  return model.fuse_qkv(params) if MESH is None and FLAGS.fuse_qkv else params


def drafter_config(tcfg, small):
  """A 5-layer (2 when small) DFlash drafter of the target's width, block 16."""
  lcfg = dataclasses.replace(tcfg, num_layers=2 if small else 5)
  ids = (1, 2) if small else (1, 9, 17, 25, 33)
  return DrafterConfig(layers=lcfg, block_size=16, mask_token_id=tcfg.vocab_size - 3,
                       target_layer_ids=ids)


def make_drafter(tcfg, key, small):
  cfg = drafter_config(tcfg, small)
  ids = cfg.target_layer_ids
  p = model.init_params(cfg.layers, key)
  k1, k2 = jax.random.split(key)
  params = DrafterParams(
      fc=(0.02 * jax.random.normal(k1, (len(ids) * tcfg.hidden_size, tcfg.hidden_size))).astype(jnp.bfloat16),
      hidden_norm=jnp.ones((tcfg.hidden_size,), jnp.bfloat16), layers=p.layers,
      final_norm=jnp.ones((tcfg.hidden_size,), jnp.bfloat16))
  return params, cfg


def random_cache(key, cfg, batch, capacity, prefix):
  shape = (cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
  kk, kv = jax.random.split(key)
  return model.KVCache(k=jax.random.normal(kk, shape, jnp.bfloat16),
                       v=jax.random.normal(kv, shape, jnp.bfloat16),
                       lens=jnp.full((batch,), prefix, jnp.int32))


def make_state(key, tcfg, dcfg, lc, batch, prefix):
  capacity = prefix + max(lc.max_new_tokens, MIN_NEW_TOKENS) + 16
  k1, k2 = jax.random.split(key)
  m = lc.max_new_tokens
  state = decode.DecodeState(
      cache=random_cache(k1, tcfg, batch, capacity, prefix),
      draft_cache=None if dcfg is None else random_cache(k2, dcfg.layers, batch, capacity, prefix),
      bonus=jnp.full((batch,), 11, jnp.int32), out=jnp.zeros((batch, m), jnp.int32),
      n_out=jnp.ones((batch,), jnp.int32), done=jnp.zeros((batch,), bool),
      accepted=jnp.zeros((m, batch), jnp.int32), step=jnp.zeros((), jnp.int32),
      key=jax.random.key(0))
  return sharding.shard_params(state, lc.mesh, lc.rules)


def loop_config(**kw):
  """LoopConfig of the ar/spec sections: on the --mesh_* mesh when one is given."""
  return decode.LoopConfig(mesh=MESH, steps_per_check=FLAGS.steps_per_check, **kw)


def state_shape(tcfg, dcfg, lc, batch, prefix):
  """Abstract DecodeState of a row (with the mesh's shardings, which eval_shape drops)."""
  shape = jax.eval_shape(lambda: make_state(jax.random.key(1), tcfg, dcfg, lc, batch, prefix))
  if lc.mesh is not None:
    shape = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shape,
                         sharding.shardings(shape, lc.mesh, lc.rules))
  return shape


def compile_row(tp, tcfg, dp, dcfg, lc, batch, prefix, stages):
  """The row's decode loop (and stage programs), AOT-compiled; runs in a worker thread."""
  t0 = time.perf_counter()
  shape = state_shape(tcfg, dcfg, lc, batch, prefix)
  loop = decode.decode_loop.lower(tp, dp, shape, tcfg=tcfg, dcfg=dcfg, lc=lc).compile()
  progs = profiling.compile_stages(tp, tcfg, dp, dcfg, lc, shape) if stages else None
  return loop, progs, time.perf_counter() - t0


def time_calls(loop, tp, tcfg, dp, dcfg, lc, batch, prefix, repeats):
  """Wall seconds of each timed call of the compiled while_loop (after one warm-up call) and the
  steps it ran (the same every call: same state, same weights)."""
  times, steps = [], 0
  for _ in range(repeats + 1):
    st = jax.block_until_ready(make_state(jax.random.key(1), tcfg, dcfg, lc, batch, prefix))
    t = time.perf_counter()
    out = jax.block_until_ready(loop(tp, dp, st))
    times.append(time.perf_counter() - t)
    steps = int(out.step)
  return times[1:], steps


def time_loop(loop, tp, tcfg, dp, dcfg, lc, batch, prefix, repeats):
  """Seconds per step of the compiled while_loop over lc.max_new_tokens-1 steps (median)."""
  times, steps = time_calls(loop, tp, tcfg, dp, dcfg, lc, batch, prefix, repeats)
  return float(np.median(times)) / steps


def time_round(short, long, args, lc, lc_long, repeats):
  """(seconds per round, seconds per call): the slope and intercept of a call's wall time against
  its steps, from the short and long loops timed alternately (medians of `repeats` each)."""
  tp, tcfg, dp, dcfg, batch, prefix = args
  ts, tl = [], []
  for _ in range(repeats):
    t, n_short = time_calls(short, tp, tcfg, dp, dcfg, lc, batch, prefix, 1)
    ts += t
    t, n_long = time_calls(long, tp, tcfg, dp, dcfg, lc_long, batch, prefix, 1)
    tl += t
  if n_long <= n_short:
    raise ValueError(f"the long loop ran {n_long} steps, the short one {n_short}: raise "
                     "--marginal_steps")
  t_short, t_long = float(np.median(ts)), float(np.median(tl))
  per_round = (t_long - t_short) / (n_long - n_short)
  return per_round, t_short - n_short * per_round


def compile_group(rows, threads):
  """Compiles every row of a group concurrently (XLA compiles outside the GIL), then returns
  them; timing starts only after the whole group is compiled, so it never overlaps a compile."""
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as ex:
    futs = [ex.submit(compile_row, *r["compile_args"]) for r in rows]
    out = [f.result() for f in futs]
  print(f"compiled {len(rows)} programs in {time.perf_counter() - t0:.1f} s "
        f"({threads} threads)", flush=True)
  return out


def copy_bandwidth(small):
  n = (1 << 20) if small else (1 << 31)  # elements of bf16: 4 GiB
  x = jnp.ones((n,), jnp.bfloat16)
  f = jax.jit(lambda a: a + 1)
  s = profiling.median_seconds(f, x, repeats=10)
  return 2 * n * 2 / s  # bytes read + written per second


def emit(row):
  if row["section"] in ("ar", "spec"):  # these run on the --mesh_* mesh
    row.update({k: (dict(MESH.shape).get(k, 1) if MESH is not None else 1) for k in ("dp", "tp")})
    row["steps_per_check"] = FLAGS.steps_per_check
  ROWS.append(row)
  print(json.dumps(row), flush=True)
  if FLAGS.json_out:
    with open(FLAGS.json_out, "a") as f:
      f.write(json.dumps(row) + "\n")


def parse_runs(text):
  """'chain,32,64' -> [("chain", 0), ("ddtree", 32), ("ddtree", 64)]."""
  return [("chain", 0) if x == "chain" else ("ddtree", int(x)) for x in text.split(",") if x]


def main(_):
  small = FLAGS.small
  sections = FLAGS.sections.split(",")
  tcfg = qwen3_8b(small)
  key = jax.random.key(0)
  global MESH, MIN_NEW_TOKENS
  MESH = sharding.mesh_from_flags()
  if FLAGS.marginal_steps and FLAGS.marginal_steps <= FLAGS.steps:
    raise app.UsageError(f"--marginal_steps={FLAGS.marginal_steps} must exceed "
                         f"--steps={FLAGS.steps}")
  MIN_NEW_TOKENS = FLAGS.marginal_steps + 1 if FLAGS.marginal_steps else 0
  tp = target_params(tcfg, key)
  dp, dcfg = make_drafter(tcfg, jax.random.key(1), small)
  dps = {"bf16": sharding.shard_params(dp, MESH)}
  names = FLAGS.drafters.split(",")
  if any(n.partition(":")[0] == "int8" for n in names):
    dps["int8"] = sharding.shard_params(jax.jit(quantize_int8)(dps["bf16"], tp), MESH)
  for name in names:
    base, _, size = name.partition(":v")
    if base not in dps or (name != base and not size.isdigit()):
      raise ValueError(f"--drafters: {name!r}; valid: bf16 or int8, optionally with :vN "
                       "(N > 0 ids), e.g. int8:v32768")
    if name != base:
      dps[name] = sharding.shard_params(restrict_vocab(dps[base], tp, np.arange(int(size))),
                                        MESH)
  dps = {name: dps[name] for name in names}
  dp = next(iter(dps.values()))
  batches = [int(b) for b in FLAGS.batches.split(",")]
  attns = FLAGS.attention.split(",")
  spec_prefixes = [int(p) for p in FLAGS.spec_prefixes.split(",")]
  print(f"devices: {jax.devices()}  target params {model.param_bytes(tp) / 1e9:.2f} GB  "
        "drafter " + ", ".join(f"{k} {model.param_bytes(v) / 1e9:.2f} GB" for k, v in dps.items()),
        flush=True)
  bw = copy_bandwidth(small)
  emit({"section": "copy", "bandwidth_GBps": bw / 1e9})
  weight_bytes = model.param_bytes(tp) - tp.embed.size * tp.embed.dtype.itemsize
  kv_row = 2 * tcfg.num_layers * tcfg.num_kv_heads * tcfg.head_dim * 2  # bytes per token per seq
  steps = FLAGS.steps

  def ar_row(attn, b, prefix):
    lc = loop_config(method="ar", max_new_tokens=steps + 1, attention=attn)
    return {"section": "ar", "attention": attn, "batch": b, "prefix": prefix,
            "compile_args": (tp, tcfg, None, None, lc, b, prefix, False)}

  def spec_row(attn, method, budget, b, prefix, stages, drafter):
    lc = loop_config(method=method, max_new_tokens=steps + 1, num_drafts=15, budget=budget,
                     attention=attn)
    return {"section": "spec", "attention": attn, "method": method, "budget": budget,
            "batch": b, "prefix": prefix, "drafter": drafter,
            "compile_args": (tp, tcfg, dps[drafter], dcfg, lc, b, prefix, stages)}

  groups = []  # each group is compiled in parallel, then timed serially
  if "ar" in sections:
    groups.append([ar_row(a, b, p) for a in attns for b in batches
                   for p in [int(x) for x in FLAGS.prefixes.split(",")]])
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
             for dn in dps for a in attns for p in spec_prefixes if (a, p) != (attns[0], spec_prefixes[0])
             for m, bud in parse_runs(FLAGS.alt_runs)]
      if alt:
        groups.append(alt)

  if "compile" in sections:  # serial compile seconds of every program, nothing run
    for m, bud in [("ar", 0)] + parse_runs(FLAGS.budgets):
      for b in batches:
        lc = loop_config(method=m, max_new_tokens=steps + 1, num_drafts=0 if m == "ar" else 15,
                         budget=bud, attention=attns[0])
        d = (None, None) if m == "ar" else (dp, dcfg)
        shape = state_shape(tcfg, d[1], lc, b, spec_prefixes[0])
        t0 = time.perf_counter()
        decode.decode_loop.lower(tp, d[0], shape, tcfg=tcfg, dcfg=d[1], lc=lc).compile()
        secs = {"loop": time.perf_counter() - t0}
        profiling.compile_stages(tp, tcfg, d[0], d[1], lc, shape, seconds=secs)
        emit({"section": "compile", "attention": attns[0], "method": m, "budget": bud,
              "batch": b, "prefix": spec_prefixes[0], **{f"{k}_s": v for k, v in secs.items()}})

  ar_ms, ar_round = {}, {}
  for group in groups:
    compiled = compile_group(group, FLAGS.compile_threads)
    for row, (loop, progs, compile_s) in zip(group, compiled):
      args = row.pop("compile_args")
      tp_, tcfg_, dp_, dcfg_, lc, b, prefix, _ = args
      s = time_loop(loop, tp_, tcfg_, dp_, dcfg_, lc, b, prefix, FLAGS.repeats)
      row.update(step_ms=s * 1e3, compile_s=compile_s)
      if FLAGS.marginal_steps:
        lc_long = dataclasses.replace(lc, max_new_tokens=FLAGS.marginal_steps + 1)
        long, _, _ = compile_row(tp_, tcfg_, dp_, dcfg_, lc_long, b, prefix, False)
        per_round, per_call = time_round(loop, long, (tp_, tcfg_, dp_, dcfg_, b, prefix), lc,
                                         lc_long, FLAGS.repeats)
        row.update(round_ms=per_round * 1e3, per_call_ms=per_call * 1e3)
      if row["section"] == "ar":
        floor = (weight_bytes + b * prefix * kv_row) / bw
        ar_ms[(row["attention"], b, prefix)] = s * 1e3
        ar_round[(row["attention"], b, prefix)] = row.get("round_ms")
        row.update(floor_ms=floor * 1e3, ratio_to_floor=s / floor)
      else:
        row["vs_ar_step"] = s * 1e3 / ar_ms[(row["attention"], b, prefix)]
        if FLAGS.marginal_steps:
          row["vs_ar_round"] = row["round_ms"] / ar_round[(row["attention"], b, prefix)]
        if progs is not None:  # same shapes as the loop's state (capacity included)
          st = make_state(jax.random.key(2), tcfg, dcfg, lc, b, prefix)
          stages = profiling.stage_seconds(tp, tcfg, dp_, dcfg, lc, st, repeats=FLAGS.repeats,
                                           programs=progs)
          row.update({f"{k}_ms": v * 1e3 for k, v in stages.items()})
      emit(row)

  if "host" in sections:  # while_loop vs Python loop over the jitted step, small model
    scfg = qwen3_8b(True)
    sp = model.init_params(scfg, key)
    sdp, sdcfg = make_drafter(scfg, jax.random.key(1), True)
    for method, budget in (("ar", 0), ("ddtree", 32)):
      lc = decode.LoopConfig(method=method, max_new_tokens=129, num_drafts=15 if budget else 0,
                             budget=budget)
      d = (sdp, sdcfg) if budget else (None, None)
      loop, _, _ = compile_row(sp, scfg, d[0], d[1], lc, 1, 64, False)
      s_loop = time_loop(loop, sp, scfg, d[0], d[1], lc, 1, 64, FLAGS.repeats)
      run_py = lambda st: profiling.python_loop(sp, scfg, d[0], d[1], lc, st)
      times = []
      for _ in range(FLAGS.repeats + 1):
        st = jax.block_until_ready(make_state(jax.random.key(1), scfg, d[1], lc, 1, 64))
        t = time.perf_counter()
        out = jax.block_until_ready(run_py(st))
        times.append((time.perf_counter() - t) / int(out.step))
      s_py = float(np.median(times[1:]))
      emit({"section": "host", "method": method, "budget": budget, "while_loop_step_ms": s_loop * 1e3,
            "python_loop_step_ms": s_py * 1e3, "python_over_while": s_py / s_loop})
  print_tables()


def print_tables():
  print("\n== AR decode step vs weight+KV bandwidth floor")
  print(f"{'attn':<7}{'batch':>6}{'prefix':>8}{'step ms':>10}{'floor ms':>10}{'ratio':>8}")
  for r in ROWS:
    if r["section"] == "copy":
      print(f"copy bandwidth {r['bandwidth_GBps']:.0f} GB/s (read+write)")
    if r["section"] == "ar":
      print(f"{r['attention']:<7}{r['batch']:>6}{r['prefix']:>8}{r['step_ms']:>10.3f}"
            f"{r['floor_ms']:>10.3f}{r['ratio_to_floor']:>8.2f}")
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
