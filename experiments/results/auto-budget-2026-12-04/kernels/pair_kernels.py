"""One-off driver: the bundled pair's decode loop (batch 1, fixed B=64, and budget="auto" over 0,
8, 16, 32, 64 choosing every step or every 4) compiled for an H200 on a machine without one, and
the kernels a step launches along its costliest path (`profiling.costliest_path`). Needs the CUDA
plugin (compile_offline.py's docstring), from the repository root:
  JAX_PLATFORMS=cpu PYTHONPATH=. python experiments/results/auto-budget-2026-12-04/kernels/pair_kernels.py"""
import re

import jax
import jax.numpy as jnp
from jax.experimental.topologies import get_topology_desc

import ddtree_jax as dj
from ddtree_jax.kernels import Kernels, KernelTuning
from ddtree_jax.spec import decode
from ddtree_jax.tools import profiling

target, drafter = dj.load_default()
with open("experiments/perf/h200_target_config.txtpb") as f:
  topo = get_topology_desc("h200", "cuda", target_config=f.read(), topology="1x1x1")
dev = jax.sharding.SingleDeviceSharding(topo.devices[0])
put = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), t)
h200 = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,),
                                 abstract_device=jax.sharding.AbstractDevice(
                                     device_kind="NVIDIA H200", num_cores=132, platform="cuda"))
for run, every in (("64", 1), ("auto", 1), ("auto", 4)):
  auto = run == "auto"
  lc = decode.LoopConfig(method="ddtree", max_new_tokens=128, num_drafts=drafter.config.num_drafts,
                         budget=64, budgets=(0, 8, 16, 32, 64) if auto else (), auto_every=every,
                         kernels=Kernels("pallas", tuning=KernelTuning(interpret=False)))
  shapes = (jax.ShapeDtypeStruct((1, 16), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
  state = jax.eval_shape(lambda tp, dp, t, n: decode.prefill_with(
      lambda x, k: jnp.argmax(x, -1).astype(jnp.int32), tp, dp, t, n, jax.random.key(0),
      jnp.ones(5) if auto else None, tcfg=target.config, dcfg=drafter.config, lc=lc,
      capacity=224), target.params, drafter.params, *shapes)
  with jax.sharding.use_abstract_mesh(h200):
    lowered = decode.decode_loop.lower(put(target.params), put(drafter.params), put(state),
                                       tcfg=target.config, dcfg=drafter.config, lc=lc)
  path = profiling.costliest_path(lowered.compile().as_text())
  print(run, f"every {every}:", path, f"{path['kernels'] / every:.1f} a step", flush=True)
  if every > 1:  # each option's inner steps: kernels of one, the fixed program's step for each
    hlo = lowered.compile().as_text()
    comps = profiling._computations(hlo)  # pylint: disable=protected-access
    for body in re.findall(r'while\(.*?body=%?([\w.\-]+).*?known_trip_count":\{"n":"(\d+)"', hlo):
      one = profiling.costliest_path("ENTRY %e {\n  %w = () while(), body=%" + body[0] + "\n}\n"
                                     + "\n".join(c for c in comps.values()))
      print(f"  inner steps ({body[1]} a block): {one['kernels']} kernels each", flush=True)
