"""Where a decode step's time goes: device kernels of one traced decode loop, per step.

  python experiments/profile_step.py --runs=ar,32,64 --batch=1            # H200, Qwen3-8B shape
  python experiments/profile_step.py --runs=ar --batch=1 --mesh_tp=2      # tp=2: collectives too
  python experiments/profile_step.py --small --runs=ar,8                  # CPU smoke

Same shapes and random weights as bench_step.py. Per run: compile, one warm-up loop, then one loop
of --steps steps under jax.profiler with a Perfetto trace, which this script reads back (no
TensorBoard needed): device kernels grouped by name and by kind (matmul, attention kernel,
collective, top-k / sort, other fusion), microseconds per decode step and share of the kernel
time, and by stage (split by kind again): each kernel's HLO op carries the named scope (draft,
tree, verify, accept_commit) that decode.step puts around its stages, so the stages are timed
inside the one fused step, not as separate programs (profiling.py). On CPU the "kernels" are
the XLA thunks of the host trace.

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

import collections  # pylint: disable=g-import-not-at-top,wrong-import-position
import glob
import gzip
import importlib
import json
import re
import tempfile

from absl import app, flags
import jax
import numpy as np

import bench_step
from ddtree_jax import drafter as drafter_lib
from ddtree_jax import sharding

flags.DEFINE_string("runs", "ar,32,64", "ar, chain or ddtree budgets")
flags.DEFINE_integer("batch", 1, "batch size")
flags.DEFINE_integer("prefix", 1024, "committed prefix length")
flags.DEFINE_bool("drafter_int8", False, "an int8 (W8A8) drafter (drafter.quantize_int8)")
flags.DEFINE_integer("draft_vocab_first", 0, "draft over ids 0..N-1 only "
                     "(drafter.restrict_vocab); 0 = the whole vocabulary")
flags.DEFINE_integer("top", 20, "kernels listed per run")
flags.DEFINE_string("trace_dir", "", "keep the traces (and each run's optimized HLO) here "
                    "(default: a temporary directory)")
flags.DEFINE_bool("memcpys", False, "also list the device memcpys per step by the HLO op that "
                  "issued them (e.g. a loop's dynamic-update-slice or carry copy)")
flags.DEFINE_bool("command_buffers", False, "keep XLA's CUDA graphs (their kernels are not traced)")
flags.DEFINE_string("tree_attention", "",
                    "override the Pallas launch rule for trees (T x G > 64), e.g. "
                    "'num_splits=4,block_k=128': an A/B of the rule inside the real step")
flags.DEFINE_integer("qkv_splits", -1, "override the fused q/k/v projection's split rule for "
                     "16+ rows (0: XLA's GEMM; -1: the rule)")
flags.DEFINE_string("residual", "",
                    "override the residual add + RMSNorm kernel's rule for 16+ rows: split-K "
                    "count per contracted dim and warps, e.g. '4096=2,12288=4,num_warps=8' "
                    "(0 = XLA's form)")
# --small, --steps, --attention (first entry) and --mesh_* are bench_step's flags
FLAGS = flags.FLAGS

KINDS = (  # first match wins; patterns over lower-cased kernel names
    ("collective", r"nccl|all-reduce|all_reduce|allreduce|all-gather|all_gather|reduce-scatter|"
                   r"collective"),
    ("attention", r"tree_attention"),  # qk_norm_rope (q/k norm + RoPE) counts as "other" glue
    ("top-k / sort", r"topk|top_k|sort"),
    ("matmul", r"gemm|cublas|cutlass|matmul|dot|sm90_xmma|wgmma"),
)


def kind(name: str) -> str:
  low = name.lower()
  return next((k for k, pat in KINDS if re.search(pat, low)), "other")


def kernel_events(trace: dict) -> list[tuple[str, float, str]]:
  """(name, microseconds, HLO op or "") of the device kernels of a Perfetto/Chrome trace, in
  stream order: the GPU stream threads (not the XLA Ops / Modules summary lines); without a GPU,
  the host's XLA ops. Events that enclose others on their thread (a while loop around its body)
  are dropped."""
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  meta = lambda what: {(e["pid"], e.get("tid")) if what == "thread_name" else e["pid"]:
                       e.get("args", {}).get("name", "") for e in events
                       if e.get("ph") == "M" and e.get("name") == what}
  pname, tname = meta("process_name"), meta("thread_name")
  complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
  gpu = {p for p, n in pname.items() if re.search(r"gpu", n.lower())}
  if gpu:
    on_gpu = [e for e in complete if e["pid"] in gpu]
    streams = [e for e in on_gpu if "stream" in tname.get((e["pid"], e.get("tid")), "").lower()]
    picked = streams or [e for e in on_gpu if not re.search(
        r"xla (ops|modules)|steps|source", tname.get((e["pid"], e.get("tid")), "").lower())]
  else:
    picked = [e for e in complete if "hlo_op" in e.get("args", {})]
  return [(e["name"], float(e["dur"]), e.get("args", {}).get("hlo_op", ""))
          for e in _leaves(picked)]


def _leaves(events):
  """The events that contain no other event of the same (pid, tid). Consecutive kernels of one
  stream may overlap a little (programmatic dependent launch), so only an event that holds a
  later one entirely counts as an enclosing one."""
  out = []
  by_thread = collections.defaultdict(list)
  for e in events:
    by_thread[(e["pid"], e.get("tid"))].append(e)
  for evs in by_thread.values():
    evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    for i, e in enumerate(evs):
      end, j, encloses = e["ts"] + e["dur"], i + 1, False
      while j < len(evs) and evs[j]["ts"] < end and not encloses:
        encloses = evs[j]["ts"] + evs[j]["dur"] <= end
        j += 1
      if not encloses:
        out.append(e)
  return out


def summarize(events, steps: int, top: int) -> tuple[list, list, float]:
  """(top kernels, kinds, total us per step); rows: (name or kind, calls/step, us/step, share)."""
  by_name, calls = collections.Counter(), collections.Counter()
  for n, d, _ in events:
    by_name[n] += d
    calls[n] += 1
  total = sum(by_name.values())
  by_kind = collections.Counter()
  for n, d in by_name.items():
    by_kind[kind(n)] += d
  rows = [(n, calls[n] / steps, d / steps, d / total) for n, d in by_name.most_common(top)]
  kinds = [(k, None, d / steps, d / total) for k, d in by_kind.most_common()]
  return rows, kinds, total / steps


STAGES = ("draft", "tree", "verify", "accept_commit")  # decode.step's named scopes


def op_stages(hlo: str) -> dict[str, str]:
  """Stage of every instruction of an optimized HLO text, from the named scope in its op_name
  ("jit(decode_loop)/while/body/verify/..." -> "verify"; none of STAGES -> "loop"; no op_name at
  all, as in a fusion XLA deduplicated across ops -> "?"). Keyed by the instruction name and by
  the kernel name XLA:GPU gives it ("." -> "_", also its deduplicated_name); a kernel name shared
  by instructions of different known stages maps to "mixed"."""
  out = {}
  for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*", hlo, re.M):
    line = m.group(0)
    op = re.search(r'op_name="([^"]*)"', line)
    stage = next((p for p in op.group(1).split("/") if p in STAGES), "loop") if op else "?"
    dedup = re.search(r'deduplicated_name="([^"]*)"', line)
    names = {m.group(1), m.group(1).replace(".", "_")}
    if dedup:
      names.add(dedup.group(1).replace(".", "_"))
    for n in names:  # "?" neither overrides nor conflicts
      prev = out.get(n, "?")
      out[n] = stage if prev in ("?", stage) else prev if stage == "?" else "mixed"
  return out


def stage_table(events, stages: dict[str, str], steps: int) -> list[tuple[str, float, float, dict]]:
  """(stage, us per step, share, {kind: us per step}) of the kernels, by their hlo_op (else their
  name) in `stages`. Events come in stream order; a kernel of no known stage ("?": no op_name; or
  not in the HLO, like a memcpy) belongs to the stage of the kernel before it, as stages run one
  after another; "unattributed" only before the first known one."""
  by_stage, last = collections.defaultdict(collections.Counter), "unattributed"
  for name, d, op in events:
    stage = stages.get(op) or stages.get(op.replace(".", "_")) or stages.get(name) or "?"
    if stage == "?":
      stage = last
    by_stage[stage][kind(name)] += d
    last = stage
  total = sum(sum(c.values()) for c in by_stage.values()) or 1.0
  order = STAGES + ("loop", "mixed", "unattributed")
  return [(s, sum(by_stage[s].values()) / steps, sum(by_stage[s].values()) / total,
           {k: us / steps for k, us in by_stage[s].items()}) for s in order if s in by_stage]


def read_trace(trace_dir: str) -> dict:
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True),
                 key=os.path.getmtime)
  if not paths:
    raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}: the profiler wrote no trace")
  with gzip.open(paths[-1], "rt") as f:
    return json.load(f)


def override_tree_rule(spec: str):
  """Patches tree_attention's default_config so trees (T x G > 64) use the launch parameters in
  `spec` ("name=int,..." of block_t (tokens per program), block_k, num_splits, num_warps,
  num_stages); decode and the drafter block keep the rule. Programs compiled afterwards see it."""
  ta = importlib.import_module("ddtree_jax.pallas.tree_attention")  # the module, not the function
  names = ("block_t", "block_k", "block_n", "num_splits", "num_warps", "num_stages")
  override = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(",") if kv)}
  if not set(override) <= set(names) - {"block_n"}:
    raise ValueError("--tree_attention takes block_t, block_k, num_splits, num_warps, num_stages: "
                     f"{spec}")
  rule = ta.default_config

  def patched(batch, t_len, hq, hkv, cap, head_dim, *, sm_count=None):
    cfg = dict(zip(names, rule(batch, t_len, hq, hkv, cap, head_dim, sm_count=sm_count)))
    if t_len * (hq // hkv) > 64:
      cfg.update(override)
      cfg["block_n"] = min(cfg["block_k"], max(16, ta._next_pow2(t_len)))  # as tree_attention
    return tuple(cfg[n] for n in names)

  ta.default_config = patched


def override_residual_rule(spec: str):
  """Patches pallas.add_rms_norm's split rule ("contracted=splits,...", for 16+ rows; other
  contracted sizes keep the rule) and its warps per program ("num_warps=n")."""
  arn = importlib.import_module("ddtree_jax.pallas.add_rms_norm")
  override = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(",") if kv)}
  arn.NUM_WARPS = override.pop("num_warps", arn.NUM_WARPS)
  splits = {int(k): v for k, v in override.items()}
  rule = arn.default_splits
  arn.default_splits = lambda rows, c: splits.get(c, rule(rows, c)) if rows >= 16 else rule(rows, c)


def override_qkv_splits(splits: int):
  """Patches pallas.qk_norm_rope's split rule for a fused q/k/v projection at 16+ rows."""
  qk = importlib.import_module("ddtree_jax.pallas.qk_norm_rope")
  rule = qk.default_splits
  qk.default_splits = lambda rows: splits if rows >= 16 else rule(rows)


def main(_):
  small = FLAGS.small
  if FLAGS.qkv_splits >= 0:
    override_qkv_splits(FLAGS.qkv_splits)
  if FLAGS.tree_attention:
    override_tree_rule(FLAGS.tree_attention)
  if FLAGS.residual:
    override_residual_rule(FLAGS.residual)
  bench_step.MESH = sharding.mesh_from_flags()
  tcfg = bench_step.qwen3_8b(small)
  tp = bench_step.target_params(tcfg, jax.random.key(0))
  dp, dcfg = bench_step.make_drafter(tcfg, jax.random.key(1), small)
  if FLAGS.drafter_int8:
    dp = jax.jit(drafter_lib.quantize_int8)(dp, tp)
  if FLAGS.draft_vocab_first:
    dp = drafter_lib.restrict_vocab(dp, tp, np.arange(FLAGS.draft_vocab_first))
  dp = sharding.shard_params(dp, bench_step.MESH)
  attention = FLAGS.attention.split(",")[0]
  steps, b, prefix = FLAGS.steps, FLAGS.batch, FLAGS.prefix
  root = FLAGS.trace_dir or tempfile.mkdtemp(prefix="ddtree_trace_")
  print(f"devices: {jax.devices()}  attention {attention}  batch {b}  prefix {prefix}  "
        f"command buffers {'on' if _KEEP_GRAPHS else 'off'}  tree rule override "
        f"{FLAGS.tree_attention or 'none'}  residual override {FLAGS.residual or 'none'}  "
        f"qkv splits {FLAGS.qkv_splits if FLAGS.qkv_splits >= 0 else 'rule'}  "
        f"fused q/k/v {tp.layers[0].wqkv is not None}  "
        f"traces: {root}", flush=True)
  for run in FLAGS.runs.split(","):
    method, budget = (run, 0) if run in ("ar", "chain") else ("ddtree", int(run))
    d = (None, None) if method == "ar" else (dp, dcfg)
    lc = bench_step.loop_config(method=method, max_new_tokens=steps + 1, budget=budget,
                                num_drafts=0 if method == "ar" else 15, attention=attention)
    loop, _, compile_s = bench_step.compile_row(tp, tcfg, d[0], d[1], lc, b, prefix, False)
    step_s = bench_step.time_loop(loop, tp, tcfg, d[0], d[1], lc, b, prefix, repeats=2)
    st = jax.block_until_ready(bench_step.make_state(jax.random.key(1), tcfg, d[1], lc, b, prefix))
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


def print_memcpys(events, n: int):
  """Memcpy events per step, by (kind, HLO op): the tenth session found 56 tiny device copies
  per DDTree step this way (the tree's beam scan)."""
  calls, us = collections.Counter(), collections.Counter()
  for name, dur, op in events:
    if name.startswith("Memcpy"):
      calls[(name, op)] += 1
      us[(name, op)] += dur
  print(f"{'memcpy':<12}{'hlo op':<52}{'calls':>7}{'us/step':>10}")
  for (name, op), c in calls.most_common():
    print(f"{name:<12}{op[:51]:<52}{c / n:>7.1f}{us[(name, op)] / n:>10.1f}")
  if not calls:
    print("(none)")


if __name__ == "__main__":
  app.run(main)
