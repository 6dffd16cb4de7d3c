"""Temporary (device call): per-call fixed cost vs per-step cost of the decode loop. The same
run compiled for 16 and 64 steps in ONE process (one set of GEMM autotuning picks), timed
interleaved; marginal step = (T64 - T16) / (steps64 - steps16)."""
import json, os, sys, time
sys.path.insert(0, "experiments")
from absl import app
import jax
import numpy as np
import bench_step as bs
from ddtree_jax import drafter as drafter_lib


def total(loop, tp, tcfg, dp, dcfg, lc, batch, prefix, repeats):
  ts, steps = [], None
  for _ in range(repeats + 1):
    st = jax.block_until_ready(bs.make_state(jax.random.key(1), tcfg, dcfg, lc, batch, prefix))
    t = time.perf_counter()
    out = jax.block_until_ready(loop(tp, dp, st))
    ts.append(time.perf_counter() - t)
    steps = int(out.step)
  return float(np.median(ts[1:])), steps


def main(_):
  small = bool(os.environ.get("SMALL"))
  tcfg = bs.qwen3_8b(small)
  tp = bs.target_params(tcfg, jax.random.key(0))
  dp, dcfg = bs.make_drafter(tcfg, jax.random.key(1), small)
  dp = jax.jit(drafter_lib.quantize_int8)(dp, tp)
  dp = drafter_lib.restrict_vocab(dp, tp, np.arange(int(os.environ.get("DV", "32768"))))
  prefix = int(os.environ.get("PREFIX", "1024"))
  runs = [r.split(":") for r in os.environ.get("RUNS", "ar:0:1,ddtree:64:1").split(",")]
  lengths = [int(s) for s in os.environ.get("STEPS", "16,64").split(",")]
  rows = []
  for method, budget, batch in runs:
    for n in lengths:
      lc = bs.decode.LoopConfig(method=method, max_new_tokens=n + 1,
                                num_drafts=0 if method == "ar" else 15, budget=int(budget),
                                attention="pallas")
      d = (None, None) if method == "ar" else (dp, dcfg)
      shape = bs.state_shape(tcfg, d[1], lc, int(batch), prefix)
      loop = bs.decode.decode_loop.lower(tp, d[0], shape, tcfg=tcfg, dcfg=d[1], lc=lc).compile()
      rows.append((f"{method}:{budget}:{batch}", n, lc, loop, d, int(batch)))
      print(json.dumps({"compiled": rows[-1][0], "steps": n}), flush=True)
  res = {}
  for rep in range(int(os.environ.get("REPS", "3"))):
    for run, n, lc, loop, d, batch in rows:
      t, steps = total(loop, tp, tcfg, d[0], d[1], lc, batch, prefix, 5)
      res.setdefault(run, {})[n] = (t, steps)
      print(json.dumps({"rep": rep, "run": run, "max_steps": n, "steps": steps,
                        "total_ms": round(t * 1e3, 3), "per_step_ms": round(t * 1e3 / steps, 3)}),
            flush=True)
    for run, r in res.items():
      (ta, sa), (tb, sb) = r[lengths[0]], r[lengths[-1]]
      print(json.dumps({"rep": rep, "run": run, "marginal_step_ms":
                        round((tb - ta) * 1e3 / (sb - sa), 3),
                        "fixed_ms": round((ta - sa * (tb - ta) / (sb - sa)) * 1e3, 3)}), flush=True)

if __name__ == "__main__":
  app.run(main)
