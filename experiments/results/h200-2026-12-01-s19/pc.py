"""Temporary (device call 7): where a decode call's fixed cost goes. AR and DDTree B=64 loops
compiled for 0, 1, 2 and 16 steps in one process; per call: the time until loop() returns (host
dispatch), until the result is ready, for 6 calls in a row (the first is the warm-up)."""
import json, os, sys, time
sys.path.insert(0, "experiments")
from absl import app
import jax
import numpy as np
import bench_step as bs
from ddtree_jax import drafter as drafter_lib


def main(_):
  small = bool(os.environ.get("SMALL"))
  tcfg = bs.qwen3_8b(small)
  tp = bs.target_params(tcfg, jax.random.key(0))
  dp, dcfg = bs.make_drafter(tcfg, jax.random.key(1), small)
  dp = jax.jit(drafter_lib.quantize_int8)(dp, tp)
  dp = drafter_lib.restrict_vocab(dp, tp, np.arange(256 if small else 32768))
  prefix = 64 if small else 1024
  bs.MIN_NEW_TOKENS = 65  # one capacity for every length
  for method, budget in (("ar", 0), ("ddtree", 64)):
    for n in (0, 1, 2, 16):
      lc = bs.decode.LoopConfig(method=method, max_new_tokens=n + 1,
                                num_drafts=0 if method == "ar" else 15, budget=budget,
                                attention="pallas")
      d = (None, None) if method == "ar" else (dp, dcfg)
      shape = bs.state_shape(tcfg, d[1], lc, 1, prefix)
      loop = bs.decode.decode_loop.lower(tp, d[0], shape, tcfg=tcfg, dcfg=d[1], lc=lc).compile()
      disp, tot = [], []
      for _ in range(6):
        st = jax.block_until_ready(bs.make_state(jax.random.key(1), tcfg, d[1], lc, 1, prefix))
        t0 = time.perf_counter()
        out = loop(tp, d[0], st)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        disp.append((t1 - t0) * 1e3)
        tot.append((t2 - t0) * 1e3)
      print(json.dumps({"run": f"{method}:{budget}", "steps": int(out.step),
                        "dispatch_ms": [round(x, 3) for x in disp],
                        "total_ms": [round(x, 3) for x in tot]}), flush=True)

if __name__ == "__main__":
  app.run(main)
