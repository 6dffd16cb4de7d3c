"""Step-time benchmark on a Qwen3-8B-shaped target (+ 5-layer DFlash drafter), random bf16 weights.

  python experiments/bench_step.py                 # full table (H200)
  python experiments/bench_step.py --small         # tiny shapes, runs on CPU (smoke)
  python experiments/bench_step.py --mesh_tp=8      # tensor parallel (ar/spec sections)

Prints, in one run: copy bandwidth; AR step vs the weight+KV bandwidth floor; per-step time of
chain and DDTree by budget with the per-stage split (draft, tree, verify, accept+commit, each its
own program); the while_loop driver vs a Python loop over the same jitted step. Medians of repeats;
compile time reported separately. Steps are timed inside the real decode loop (lax.while_loop).
"""

import dataclasses
import json
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import decode, model, profiling, sharding
from ddtree_jax.config import ModelConfig
from ddtree_jax.drafter import DrafterConfig, DrafterParams

flags.DEFINE_bool("small", False, "tiny shapes (CPU smoke run)")
flags.DEFINE_string("sections", "copy,ar,spec,host", "comma list of sections to run")
flags.DEFINE_string("budgets", "1,4,16,32,64,128,256", "ddtree budgets")
flags.DEFINE_string("batches", "1,8", "batch sizes")
flags.DEFINE_string("prefixes", "1024,8192", "AR prefix lengths")
flags.DEFINE_integer("spec_prefix", 1024, "prefix length for chain/ddtree rows")
flags.DEFINE_string("attention", "xla", "comma list: xla, pallas")
flags.DEFINE_integer("steps", 32, "decode steps timed per row")
flags.DEFINE_integer("repeats", 5, "timed repeats (median)")
flags.DEFINE_string("json_out", "", "append each row here as a JSON line as soon as measured")
flags.DEFINE_bool("stages", True, "also time the stages as separate programs")
sharding.define_mesh_flags()
FLAGS = flags.FLAGS

ROWS = []
MESH = None  # set from --mesh_dp/--mesh_tp in main


def qwen3_8b(small):
  if small:
    return ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                       rope_theta=1e6, max_position_embeddings=40960)
  return ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
                     head_dim=128, rope_theta=1e6, max_position_embeddings=40960)


def make_drafter(tcfg, key, small):
  layers = 2 if small else 5
  lcfg = dataclasses.replace(tcfg, num_layers=layers)
  ids = (1, 2) if small else (1, 9, 17, 25, 33)
  cfg = DrafterConfig(layers=lcfg, block_size=16, mask_token_id=tcfg.vocab_size - 3,
                      target_layer_ids=ids)
  p = model.init_params(lcfg, key)
  k1, k2 = jax.random.split(key)
  params = DrafterParams(
      fc=(0.02 * jax.random.normal(k1, (len(ids) * tcfg.hidden_size, tcfg.hidden_size))).astype(jnp.bfloat16),
      hidden_norm=jnp.ones((tcfg.hidden_size,), jnp.bfloat16), layers=p.layers,
      final_norm=jnp.ones((tcfg.hidden_size,), jnp.bfloat16))
  return params, cfg


def random_cache(key, cfg, batch, capacity, prefix):
  shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
  keys = jax.random.split(key, 2 * cfg.num_layers)
  mk = lambda k: jax.random.normal(k, shape, jnp.bfloat16)
  return model.KVCache(k=[mk(k) for k in keys[:cfg.num_layers]],
                       v=[mk(k) for k in keys[cfg.num_layers:]],
                       lens=jnp.full((batch,), prefix, jnp.int32))


def make_state(key, tcfg, dcfg, lc, batch, prefix):
  capacity = prefix + lc.max_new_tokens + 16
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
  return decode.LoopConfig(mesh=MESH, **kw)


def time_loop(tp, tcfg, dp, dcfg, lc, batch, prefix, repeats):
  """(seconds per step, compile seconds) of the real while_loop over lc.max_new_tokens-1 steps."""
  make = lambda: make_state(jax.random.key(1), tcfg, dcfg, lc, batch, prefix)
  shape = jax.eval_shape(make)
  if lc.mesh is not None:  # eval_shape drops shardings: the loop is compiled for the placed state
    shape = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shape,
                         sharding.shardings(shape, lc.mesh, lc.rules))
  t0 = time.perf_counter()
  loop = decode.decode_loop.lower(tp, dp, shape, tcfg=tcfg, dcfg=dcfg, lc=lc).compile()
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(repeats + 1):
    st = jax.block_until_ready(make())
    t = time.perf_counter()
    out = jax.block_until_ready(loop(tp, dp, st))
    times.append((time.perf_counter() - t) / int(out.step))
  return float(np.median(times[1:])), compile_s


def copy_bandwidth(small):
  n = (1 << 20) if small else (1 << 31)  # elements of bf16: 4 GiB
  x = jnp.ones((n,), jnp.bfloat16)
  f = jax.jit(lambda a: a + 1)
  s = profiling.median_seconds(f, x, repeats=10)
  return 2 * n * 2 / s  # bytes read + written per second


def emit(row):
  ROWS.append(row)
  print(json.dumps(row), flush=True)
  if FLAGS.json_out:
    with open(FLAGS.json_out, "a") as f:
      f.write(json.dumps(row) + "\n")


def main(_):
  small = FLAGS.small
  sections = FLAGS.sections.split(",")
  tcfg = qwen3_8b(small)
  key = jax.random.key(0)
  global MESH
  MESH = sharding.mesh_from_flags()
  tp = sharding.shard_params(model.init_params(tcfg, key), MESH)
  dp, dcfg = make_drafter(tcfg, jax.random.key(1), small)
  dp = sharding.shard_params(dp, MESH)
  batches = [int(b) for b in FLAGS.batches.split(",")]
  print(f"devices: {jax.devices()}  target params {model.param_bytes(tp) / 1e9:.2f} GB  "
        f"drafter {model.param_bytes(dp) / 1e9:.2f} GB", flush=True)
  bw = copy_bandwidth(small)
  emit({"section": "copy", "bandwidth_GBps": bw / 1e9})
  weight_bytes = model.param_bytes(tp) - tp.embed.size * tp.embed.dtype.itemsize
  kv_row = 2 * tcfg.num_layers * tcfg.num_kv_heads * tcfg.head_dim * 2  # bytes per token per seq
  steps = FLAGS.steps
  ar_ms = {}
  attns = FLAGS.attention.split(",")
  if "ar" in sections:
    for attn in attns:
      for b in batches:
        for prefix in [int(p) for p in FLAGS.prefixes.split(",")]:
          lc = loop_config(method="ar", max_new_tokens=steps + 1, attention=attn)
          s, c = time_loop(tp, tcfg, None, None, lc, b, prefix, FLAGS.repeats)
          floor = (weight_bytes + b * prefix * kv_row) / bw
          ar_ms[(attn, b, prefix)] = s * 1e3
          emit({"section": "ar", "attention": attn, "batch": b, "prefix": prefix,
                "step_ms": s * 1e3, "floor_ms": floor * 1e3, "ratio_to_floor": s / floor,
                "compile_s": c})
  if "spec" in sections:
    prefix = FLAGS.spec_prefix
    runs = [("chain", 0)] + [("ddtree", int(x)) for x in FLAGS.budgets.split(",")]
    for attn in attns:
      for b in batches:
        if (attn, b, prefix) not in ar_ms:
          lc = loop_config(method="ar", max_new_tokens=steps + 1, attention=attn)
          ar_ms[(attn, b, prefix)] = time_loop(tp, tcfg, None, None, lc, b, prefix,
                                               FLAGS.repeats)[0] * 1e3
        for method, budget in runs:
          lc = loop_config(method=method, max_new_tokens=steps + 1, num_drafts=15,
                           budget=budget, attention=attn)
          s, c = time_loop(tp, tcfg, dp, dcfg, lc, b, prefix, FLAGS.repeats)
          stages = {}
          if FLAGS.stages:
            big = dataclasses.replace(lc, max_new_tokens=10_000)
            st = make_state(jax.random.key(2), tcfg, dcfg, big, b, prefix)
            stages = profiling.stage_seconds(tp, tcfg, dp, dcfg, big, st, repeats=FLAGS.repeats)
          emit({"section": "spec", "attention": attn, "method": method, "budget": budget,
                "batch": b, "prefix": prefix, "step_ms": s * 1e3,
                "vs_ar_step": s * 1e3 / ar_ms[(attn, b, prefix)], "compile_s": c,
                **{f"{k}_ms": v * 1e3 for k, v in stages.items()}})
  if "host" in sections:  # while_loop vs Python loop over the jitted step, small model
    scfg = qwen3_8b(True)
    sp = model.init_params(scfg, key)
    sdp, sdcfg = make_drafter(scfg, jax.random.key(1), True)
    for method, budget in (("ar", 0), ("ddtree", 32)):
      lc = decode.LoopConfig(method=method, max_new_tokens=129, num_drafts=15 if budget else 0,
                             budget=budget)
      d = (sdp, sdcfg) if budget else (None, None)
      s_loop, _ = time_loop(sp, scfg, d[0], d[1], lc, 1, 64, FLAGS.repeats)
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
  print(f"{'attn':<7}{'method':<8}{'B':>5}{'batch':>6}{'step':>9}{'xAR':>7}{'draft':>8}"
        f"{'tree':>8}{'verify':>8}{'acc+com':>8}")
  for r in ROWS:
    if r["section"] == "spec":
      print(f"{r['attention']:<7}{r['method']:<8}{r['budget']:>5}{r['batch']:>6}{r['step_ms']:>9.3f}"
            f"{r['vs_ar_step']:>7.2f}{r.get('draft_ms', 0):>8.3f}{r.get('tree_ms', 0):>8.3f}"
            f"{r.get('verify_ms', 0):>8.3f}{r.get('accept_commit_ms', 0):>8.3f}")
  for r in ROWS:
    if r["section"] == "host":
      print(f"host: {r['method']}/B={r['budget']} while_loop {r['while_loop_step_ms']:.3f} ms/step, "
            f"python loop {r['python_loop_step_ms']:.3f} ms/step ({r['python_over_while']:.2f}x)")


if __name__ == "__main__":
  app.run(main)
