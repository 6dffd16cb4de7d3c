"""Temporary (device calls 1-2): the tree attention's split merge in the kernel (last split merges,
merge="kernel") against XLA's merge kernel (merge="xla"), AR / chain / DDTree decode loops compiled
in ONE process (one set of GEMM autotuning picks), timed interleaved; tokens compared.
Runs on the tree of rejected_in_kernel_merge.patch (its temporary COUNTS_FROM_KNEW switch makes the
counters' zeros a per-call kernel instead of a copy of a hoisted constant: variant kernel_knew)."""
import functools, importlib, json, os, sys
sys.path.insert(0, "experiments")
from absl import app
import jax
import numpy as np
import bench_step as bs
from ddtree_jax import drafter as drafter_lib

TA = importlib.import_module("ddtree_jax.pallas.tree_attention")
ORIG = TA.tree_attention


def main(_):
  small = bool(os.environ.get("SMALL"))
  tcfg = bs.qwen3_8b(small)
  tp = bs.target_params(tcfg, jax.random.key(0))
  dp, dcfg = bs.make_drafter(tcfg, jax.random.key(1), small)
  dp = jax.jit(drafter_lib.quantize_int8)(dp, tp)
  dp = drafter_lib.restrict_vocab(dp, tp, np.arange(int(os.environ.get("DV", "32768"))))
  steps, prefix = 16, int(os.environ.get("PREFIX", "1024"))
  runs = [r.split(":") for r in os.environ.get("RUNS", "ar:0:1,ddtree:64:1").split(",")]
  merges = os.environ.get("MERGES", "xla,kernel").split(",")
  rows = []
  for method, budget, batch in runs:
    for merge in merges:
      os.environ.pop("COUNTS_FROM_KNEW", None)
      if merge == "kernel_knew":
        os.environ["COUNTS_FROM_KNEW"] = "1"
      TA.tree_attention = functools.partial(ORIG, merge=merge.split("_")[0])
      jax.clear_caches()
      lc = bs.decode.LoopConfig(method=method, max_new_tokens=steps + 1,
                                num_drafts=0 if method == "ar" else 15, budget=int(budget),
                                attention="pallas")
      d = (None, None) if method == "ar" else (dp, dcfg)
      shape = bs.state_shape(tcfg, d[1], lc, int(batch), prefix)
      loop = bs.decode.decode_loop.lower(tp, d[0], shape, tcfg=tcfg, dcfg=d[1], lc=lc).compile()
      mem = loop.memory_analysis()
      print(json.dumps({"compiled": f"{method}:{budget}:{batch}", "merge": merge,
                        "temp_MB": round(mem.temp_size_in_bytes / 2**20, 1)}), flush=True)
      rows.append((method, int(budget), int(batch), merge, lc, loop, d))
  TA.tree_attention = ORIG
  ref = {}
  for rep in range(int(os.environ.get("REPS", "3"))):
    for method, budget, batch, merge, lc, loop, d in rows:
      ms = bs.time_loop(loop, tp, tcfg, d[0], d[1], lc, batch, prefix, 5) * 1e3
      st = bs.make_state(jax.random.key(1), tcfg, d[1], lc, batch, prefix)
      out = np.asarray(loop(tp, d[0], st).out)
      same = ref.setdefault((method, budget, batch), out)
      print(json.dumps({"rep": rep, "run": f"{method}:{budget}:{batch}", "merge": merge,
                        "step_ms": round(ms, 3), "same_tokens": bool((out == same).all())}),
            flush=True)

if __name__ == "__main__":
  app.run(main)
