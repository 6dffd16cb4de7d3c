"""Temporary (call 5, run from the repo root as spc.py): the B=64 (and AR) step by
LoopConfig.steps_per_check in ONE process (the GEMM autotuning of the first compile is reused by
the others), interleaved twice; H200."""
import json, sys
sys.path.insert(0, "experiments")
from absl import app
import jax
import numpy as np
import bench_step as bs
from ddtree_jax import drafter as drafter_lib


def main(_):
  tcfg = bs.qwen3_8b(False)
  tp = bs.target_params(tcfg, jax.random.key(0))
  dp, dcfg = bs.make_drafter(tcfg, jax.random.key(1), False)
  dp = jax.jit(drafter_lib.quantize_int8)(dp, tp)
  dp = drafter_lib.restrict_vocab(dp, tp, np.arange(32768))
  steps, prefix = 16, 1024
  rows = []
  for method, budget in (("ar", 0), ("ddtree", 64)):
    for k in (1, 2, 4, 16):
      lc = bs.decode.LoopConfig(method=method, max_new_tokens=steps + 1,
                                num_drafts=0 if method == "ar" else 15, budget=budget,
                                attention="pallas", steps_per_check=k)
      d = (None, None) if method == "ar" else (dp, dcfg)
      loop, _, _ = bs.compile_row(tp, tcfg, d[0], d[1], lc, 1, prefix, False)
      rows.append((method, budget, k, lc, loop, d))
  for rep in range(2):
    for method, budget, k, lc, loop, d in rows:
      ms = bs.time_loop(loop, tp, tcfg, d[0], d[1], lc, 1, prefix, 5) * 1e3
      print(json.dumps({"rep": rep, "method": method, "budget": budget, "steps_per_check": k,
                        "step_ms": round(ms, 3)}), flush=True)


if __name__ == "__main__":
  app.run(main)
