"""Kernel times read back from a Perfetto / Chrome trace of `jax.profiler.trace`, grouped by
name, by kind (matmul, attention, collective, top-k / sort, other) and by decode stage (the named
scopes `decode.step` puts around draft, tree, verify and accept_commit, read from the HLO ops'
metadata). Used by profile_step.py; no TensorBoard needed."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re

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


def print_memcpys(events, n: int):
  """Memcpy events per step, by (kind, HLO op), e.g. a loop's dynamic-update-slice or carry
  copy."""
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
