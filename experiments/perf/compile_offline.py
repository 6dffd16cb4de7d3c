"""Compile the decode loops (Qwen3-8B shape, or --shape) for an H200 on a machine without a GPU.

XLA's GPU compiler runs on the host; JAX compiles for a described device (no autotuning, so real
compiles take longer, but a compile that blows up shows up here too: this is how the DDTree
ancestor-chain trap was found: docs/findings/compile-time.md). Needs the CUDA plugin with its
toolchain:

  pip install 'jax-cuda13-plugin[with-cuda]==0.11.2' jax-cuda13-pjrt==0.11.2
  JAX_PLATFORMS=cpu python -m experiments.perf.compile_offline --runs=ar,chain,32,256 \
      --attention=pallas
  JAX_PLATFORMS=cpu python -m experiments.perf.compile_offline --runs=ar,32 --tp=2 --batch=8
  JAX_PLATFORMS=cpu python -m experiments.perf.compile_offline --runs=32 --attention=pallas \
      --triton --drafter_int8 --hlo_dir=/tmp/hlo --list_scope=verify
  JAX_PLATFORMS=cpu python -m experiments.perf.compile_offline --runs=64,auto --small \
      --attention=pallas --triton --hlo_dir=/tmp/hlo     # budget="auto" against its largest tree

Prints lower / compile seconds per decode loop (bench_step.py's shapes and random-weight layout,
harness.py) and, with --hlo_dir, the kernels a step launches along its costliest path (a
budget="auto" step runs one branch of each of its switches) and the top-level kernels of the
loop body per stage (the named scopes of `decode.step`): how to find glue kernels that XLA
would not fuse. With --triton the
Pallas kernels are lowered to Triton, as on the GPU, instead of interpret mode
(`KernelTuning(interpret=False)`).
"""

import collections
import contextlib
import os
import re
import time

import numpy as np

from absl import app, flags
import jax
from jax.experimental.topologies import get_topology_desc

from ddtree_jax import engine, sharding
from ddtree_jax.speculative import decode
from ddtree_jax.models import decoder
from ddtree_jax.tools import profiling
from ddtree_jax.models import drafter as drafter_lib
from ddtree_jax.kernels import Kernels, KernelTuning
from ddtree_jax.request import DEFAULT_BUDGETS
from experiments.perf import common_flags, harness

common_flags.define("small", "shape", "attention", "fuse_qkv", "batch", "prefix", "drafter_int8",
                    "draft_vocab_first", runs="ar,chain,32,256")
flags.DEFINE_integer("tp", 1, "tensor-parallel devices (a mesh of that many H200s when > 1)")
flags.DEFINE_string("hlo_dir", "", "write each optimized HLO here, count its collectives and its "
                    "loop body's kernels per stage")
flags.DEFINE_bool("triton", False, "lower the Pallas kernels to Triton for an abstract H200 (as on "
                  "the GPU) instead of interpret mode; tp=1 only")
flags.DEFINE_integer("auto_every", 1, "auto runs: choose every this many steps")
flags.DEFINE_string("list_scope", "", "with --hlo_dir: also list the kernels of this stage in order")
flags.DEFINE_string("target_config", os.path.join(os.path.dirname(__file__),
                                                  "h200_target_config.txtpb"),
                    "GpuTargetConfigProto (text) of the device to compile for")
FLAGS = flags.FLAGS


def lowering_context():
  """With --triton, the abstract H200 the Pallas Triton lowering reads the GPU from."""
  if not FLAGS.triton:
    return contextlib.nullcontext()
  from jax.sharding import AbstractDevice, AbstractMesh, AxisType  # pylint: disable=import-outside-toplevel
  dev = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
  return jax.sharding.use_abstract_mesh(
      AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=dev))


engine.define_compilation_cache_flags(default=False)  # compile times are what it measures


def main(_):
  common_flags.start()
  if FLAGS.triton:
    if FLAGS.tp > 1:
      raise app.UsageError("--triton lowers for one abstract H200: use --tp=1")
  tuning = KernelTuning(interpret=False) if FLAGS.triton else KernelTuning()
  with open(FLAGS.target_config) as f:
    topo = get_topology_desc("h200", "cuda", target_config=f.read(),
                             topology=f"1x1x{FLAGS.tp}")
  mesh = None
  if FLAGS.tp > 1:
    mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(1, FLAGS.tp), ("dp", "tp"))
    put = lambda t: t if t is None else jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), t,
        sharding.shardings(t, mesh))
  else:
    on_gpu = jax.sharding.SingleDeviceSharding(topo.devices[0])
    put = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_gpu),
                                 t)
  tcfg = harness.target_config(FLAGS.small, FLAGS.shape)
  tparams = jax.eval_shape(lambda: decoder.init_params(tcfg, jax.random.key(0)))
  if FLAGS.tp == 1 and FLAGS.fuse_qkv:
    tparams = jax.eval_shape(decoder.fuse_qkv, tparams)
  dcfg = harness.drafter_config(tcfg, FLAGS.small)
  dparams = jax.eval_shape(lambda: harness.random_drafter(tcfg, jax.random.key(1),
                                                          FLAGS.small)[0])
  if FLAGS.drafter_int8:
    dparams = jax.eval_shape(drafter_lib.quantize_int8, dparams, tparams)
  if FLAGS.draft_vocab_first:
    dparams = jax.eval_shape(lambda d, t: drafter_lib.restrict_vocab(
        d, t, np.arange(FLAGS.draft_vocab_first)), dparams, tparams)
  attention = FLAGS.attention
  print(f"tp={FLAGS.tp}")
  print(f"{'run':<12}{'attention':>10}{'batch':>6}{'lower s':>9}{'compile s':>11}", flush=True)
  for run in FLAGS.runs.split(","):
    budgets = ()
    if run.startswith("auto"):  # auto:0+8+16 (default AUTO_BUDGETS), the tree at the largest
      budgets = (tuple(int(b) for b in run[5:].split("+")) if ":" in run
                 else tuple(DEFAULT_BUDGETS))
      method, budget = "ddtree", max(budgets)
    else:
      method, budget = (run, 0) if run in ("ar", "chain") else ("ddtree", int(run))
    d = (None, None) if method == "ar" else (dparams, dcfg)
    lc = decode.LoopConfig(method=method, max_new_tokens=17, num_drafts=0 if d[1] is None else 15,
                           budget=budget, budgets=budgets,
                           auto_every=FLAGS.auto_every if budgets else 1,
                           kernels=Kernels(attention, mesh, tuning=tuning))
    state = harness.Case.make(None, tcfg, None, d[1], lc, FLAGS.batch, FLAGS.prefix).state_shape()
    if mesh is None:
      state = put(state)  # on a mesh state_shape already carries the shardings
    t0 = time.perf_counter()
    with lowering_context():
      lowered = decode.decode_loop.lower(put(tparams), put(d[0]), state, tcfg=tcfg, dcfg=d[1],
                                         lc=lc)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    print(f"{run:<12}{attention:>10}{FLAGS.batch:>6}{t1 - t0:>9.1f}"
          f"{time.perf_counter() - t1:>11.1f}", flush=True)
    if FLAGS.hlo_dir:
      hlo = compiled.as_text()
      path = os.path.join(FLAGS.hlo_dir, f"{run}_b{FLAGS.batch}_tp{FLAGS.tp}.hlo.txt")
      os.makedirs(FLAGS.hlo_dir, exist_ok=True)
      with open(path, "w") as f:
        f.write(hlo)
      print(f"  {path}: " + ", ".join(f"{k} {n}" for k, n in collectives(hlo).items()))
      path = profiling.costliest_path(hlo)
      steps = lc.auto_every * lc.steps_per_check
      print(f"  a loop iteration's costliest path ({steps} steps): {path['kernels']} kernels "
            f"({path['kernels'] / steps:.1f} a step), of them {path['conditionals']} "
            f"conditionals and {path['copies']} copies")
      kernels = profiling.loop_body_kernels(hlo)
      counts = collections.Counter(scope for scope, _, _ in kernels)
      print("  loop-body kernels per stage: " + ", ".join(f"{k} {n}" for k, n in counts.items()))
      for scope, name, what in kernels:
        if scope == FLAGS.list_scope:
          print(f"    {name:<40}{what}")


def collectives(hlo: str) -> dict[str, int]:
  """Collective ops in an optimized HLO text (static count: a while body counts once)."""
  ops = ("all-reduce-start", "all-reduce", "all-gather-start", "all-gather", "reduce-scatter",
         "collective-permute-start", "collective-permute", "all-to-all")
  counts = {op: len(re.findall(rf"= [^=]*? {op}\(", hlo)) for op in ops}
  return {k: v for k, v in counts.items() if v}


if __name__ == "__main__":
  app.run(main)
