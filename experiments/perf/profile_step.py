"""Where a decode step's time goes: device kernels of one traced decode loop, per step.

  python -m experiments.perf.profile_step --runs=ar,32,64 --batch=1        # H200, Qwen3-8B shape
  python -m experiments.perf.profile_step --runs=ar --batch=1 --mesh_tp=2  # tp=2: collectives too
  python -m experiments.perf.profile_step --small --runs=ar,8              # CPU smoke
  python -m experiments.perf.profile_step --shape=qwen3-30b-a3b --runs=ar,16 --attention=pallas

Same shapes and random weights as bench_step.py (harness.py). Per run: compile, one warm-up loop,
then one loop of --steps steps under jax.profiler with a Perfetto trace, which this script reads
back (trace.py, no TensorBoard needed): device kernels grouped by name and by kind (matmul,
attention kernel, collective, top-k / sort, other fusion), microseconds per decode step and share
of the kernel time, and by stage (split by kind again): each kernel's HLO op carries the named
scope (draft, tree, verify, accept_commit) that decode.step puts around its stages, so the stages
are timed inside the one fused step, not as separate programs (profiling.py). On CPU the
"kernels" are the XLA thunks of the host trace. --tree_attention, --qkv_splits and --residual
A/B the Pallas kernels' rules inside the real step (a `KernelTuning`, harness.tuning_overrides).

Kernels that XLA:GPU replays inside CUDA graphs (command buffers, on by default) are not traced one
by one, so this script turns command buffers off (--xla_gpu_enable_command_buffer=) unless
--command_buffers is given; the "untraced" step time it prints is then without CUDA graphs too.
"""

import os
import sys

_KEEP_GRAPHS = any(a in ("--command_buffers", "--command_buffers=true", "--command_buffers=True",
                         "--command_buffers=1") for a in sys.argv)
if not _KEEP_GRAPHS:  # before jax initialises its backend (FLAGS are parsed later)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_gpu_enable_command_buffer=").strip()

import tempfile  # pylint: disable=g-import-not-at-top,wrong-import-position

from absl import app, flags
import jax

from ddtree_jax import engine, sharding
from ddtree_jax.speculative import decode
from ddtree_jax.kernels import Kernels
from experiments.perf import common_flags, harness
from experiments.perf.trace import (KINDS, kernel_events, op_stages, print_memcpys, read_trace,
                                    stage_table, summarize)

common_flags.define("small", "shape", "attention", "runs", "batch", "prefix", "drafter_int8",
                    "draft_vocab_first")
flags.DEFINE_integer("steps", 32, "decode steps traced per run")
flags.DEFINE_integer("top", 20, "kernels listed per run")
flags.DEFINE_string("trace_dir", "", "keep the traces (and each run's optimized HLO) here "
                    "(default: a temporary directory)")
flags.DEFINE_bool("memcpys", False, "also list the device memcpys per step by the HLO op that "
                  "issued them (e.g. a loop's dynamic-update-slice or carry copy)")
flags.DEFINE_bool("command_buffers", False, "keep XLA's CUDA graphs (their kernels are not traced)")
flags.DEFINE_string("tree_attention", "",
                    "override the Pallas launch rule for trees (T x G > 64), e.g. "
                    "'num_splits=4,block_k=128' (KernelTuning.tree_launch): an A/B of the rule "
                    "inside the real step")
flags.DEFINE_integer("qkv_splits", -1, "override the fused q/k/v projection's split rule for "
                     "16+ rows (0: XLA's GEMM; -1: the rule)")
flags.DEFINE_string("residual", "",
                    "override the residual add + RMSNorm kernel's rule for 16+ rows: split-K "
                    "count per contracted dim (a dim takes the entry of the largest listed dim "
                    "<= it) and warps, e.g. '4096=2,12288=4,num_warps=8' (0 = XLA's form)")
sharding.define_mesh_flags()
FLAGS = flags.FLAGS


engine.define_compilation_cache_flags()


def main(_):
  common_flags.start()
  small = FLAGS.small
  try:
    tuning = harness.tuning_overrides(FLAGS.tree_attention, FLAGS.qkv_splits, FLAGS.residual)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  mesh = sharding.mesh_from_flags()
  tcfg = harness.target_config(small, FLAGS.shape)
  tp = harness.random_target(tcfg, jax.random.key(0), mesh)
  dp, dcfg = harness.random_drafter(tcfg, jax.random.key(1), small)
  name = "int8" if FLAGS.drafter_int8 else "bf16"
  if FLAGS.draft_vocab_first:
    name += f":v{FLAGS.draft_vocab_first}"
  dp = harness.drafter_variants(dp, tp, [name], mesh)[name]
  attention = FLAGS.attention
  steps, b, prefix = FLAGS.steps, FLAGS.batch, FLAGS.prefix
  root = FLAGS.trace_dir or tempfile.mkdtemp(prefix="ddtree_trace_")
  print(f"devices: {jax.devices()}  attention {attention}  batch {b}  prefix {prefix}  "
        f"command buffers {'on' if _KEEP_GRAPHS else 'off'}  tuning {tuning}  "
        f"fused q/k/v {tp.layers[0].wqkv is not None}  traces: {root}", flush=True)
  for run in FLAGS.runs.split(","):
    method, budget = (run, 0) if run in ("ar", "chain") else ("ddtree", int(run))
    d = (None, None) if method == "ar" else (dp, dcfg)
    lc = decode.LoopConfig(method=method, max_new_tokens=steps + 1, budget=budget,
                           num_drafts=0 if method == "ar" else 15,
                           kernels=Kernels(attention, mesh, tuning=tuning))
    case = harness.Case.make(tp, tcfg, d[0], d[1], lc, b, prefix)
    loop, _, compile_s = case.compile()
    step_s = harness.step_seconds(loop, case, repeats=2)
    st = jax.block_until_ready(case.state())
    trace_dir = os.path.join(root, run)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      out = jax.block_until_ready(loop(tp, d[0], st))
    n = int(out.step)
    hlo = loop.as_text()
    with open(os.path.join(trace_dir, "decode_loop.hlo.txt"), "w") as f:  # names in the trace
      f.write(hlo)
    events = kernel_events(read_trace(trace_dir))
    rows, kinds, total = summarize(events, n, FLAGS.top)
    name = method if method != "ddtree" else f"ddtree B={budget}"
    print(f"\n== {name}: step {step_s * 1e3:.3f} ms untraced, kernels {total / 1e3:.3f} ms per "
          f"step ({n} steps traced, compile {compile_s:.1f} s)")
    cols = [k for k, _ in KINDS] + ["other"]
    print(f"{'stage (named scope)':<20}{'us/step':>10}{'share':>8}"
          + "".join(f"{c.split(' ')[0]:>12}" for c in cols))
    for k, us, share, kinds_us in stage_table(events, op_stages(hlo), n):
      print(f"{k:<20}{us:>10.1f}{share:>8.1%}"
            + "".join(f"{kinds_us.get(c, 0.0):>12.1f}" for c in cols))
    print(f"{'kind':<40}{'us/step':>10}{'share':>8}")
    for k, _, us, share in kinds:
      print(f"{k:<40}{us:>10.1f}{share:>8.1%}")
    print(f"{'kernel':<64}{'calls':>7}{'us/step':>10}{'share':>8}")
    for name, c, us, share in rows:
      print(f"{name[:63]:<64}{c:>7.1f}{us:>10.1f}{share:>8.1%}")
    if FLAGS.memcpys:
      print_memcpys(events, n)


if __name__ == "__main__":
  app.run(main)
