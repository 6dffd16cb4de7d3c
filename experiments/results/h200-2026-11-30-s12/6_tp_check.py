"""Throwaway: float32 lossless check of attention="pallas" on a tp=2 mesh (2 GPUs), bundled pair."""
import os
import ddtree_jax as dj
from ddtree_jax import sharding
d = os.path.join("ddtree_jax", "default_model")
prompts = [[5, 17, 99, 4, 250, 31, 8] * 9, [42, 7, 7, 1] * 15, [9, 8, 7, 6, 5] * 13]
t = dj.load_target(os.path.join(d, "target"), dtype="float32")
ar = dj.generate(t, prompts, max_new_tokens=48, stop_token_ids=(), attention="xla").tokens
mesh = sharding.make_mesh({"dp": 1, "tp": 2})
st = dj.load_target(os.path.join(d, "target"), dtype="float32", mesh=mesh)
for int8 in (False, True):
  dr = dj.load_drafter(os.path.join(d, "drafter"), st, int8=int8)
  for method, budget in (("ar", None), ("chain", None), ("ddtree", 16), ("ddtree", 64)):
    r = dj.generate(st, prompts, method=method, drafter=None if method == "ar" else dr,
                    budget=budget, max_new_tokens=48, stop_token_ids=(), attention="pallas")
    print(f"tp=2 pallas int8={int8} {method} B={budget}: same={r.tokens == ar} "
          f"tau={r.stats['tau']:.2f}", flush=True)
