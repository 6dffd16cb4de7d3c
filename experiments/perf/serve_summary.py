"""The summary tables of run_serve_h200.sh, from its serve.jsonl (experiments/http_bench.py rows)
and health.jsonl (each server's /health after its HTTP run, with "label" added).

  python -m experiments.perf.serve_summary OUT/serve.jsonl OUT/health.jsonl

Labels: HTTP rows "MODEL:RUN/SLOTS" (e.g. 8b:16/1, pair:ar/32), in-process rows "MODEL:RUN";
RUN is ar, chain or a DDTree budget. Prints (1) HTTP at concurrency 1 against in-process
`generate` (the goal: ratio >= 0.95), (2) every HTTP row by concurrency, (3) the engine's host
counters per server: chunks, those run for a request alone (long, pipelined), steps per chunk,
and per chunk the ms spent dispatching it (`launch`; ~0 when dispatch is asynchronous), waiting
for results (`wait`), streaming (`host`) and waiting for requests to refill slots (`refill`).
"""

import json
import sys


def _rows(path: str) -> list[dict]:
  try:
    with open(path) as f:
      return [json.loads(line) for line in f if line.strip()]
  except OSError:
    return []


def _f(value, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def tables(rows: list[dict], health: list[dict]) -> str:
  inproc = {r["label"]: r for r in rows if r.get("mode") == "in_process"}
  http = [r for r in rows if r.get("mode") == "http"]
  lines = ["== HTTP at concurrency 1 vs in-process generate (batch 1, same prompts, tokens; "
           "goal: ratio >= 0.95)",
           f"{'server':<14}{'http tok/s':>11}{'in-proc':>10}{'ratio':>8}{'TTFT p50':>10}"
           f"{'TPOT ms':>9}{'accept':>8}"]
  for r in http:
    if r["concurrency"] != 1:
      continue
    base = inproc.get(r["label"].split("/")[0])
    ratio = base and r["tokens_per_second"] / base["tokens_per_second"]
    lines.append(f"{r['label']:<14}{r['tokens_per_second']:>11.1f}"
                 f"{_f(base and base['tokens_per_second'], '.1f'):>10}{_f(ratio, '.3f'):>8}"
                 f"{r['ttft_p50_ms']:>10.1f}{_f(r['tpot_ms'], '.2f'):>9}"
                 f"{_f(r['acceptance_length'], '.2f'):>8}")
  missing = sorted(set(inproc) - {r["label"].split("/")[0] for r in http})
  if missing:
    lines.append(f"(in-process only: {', '.join(missing)})")
  lines += ["", "== HTTP by concurrency",
            f"{'server':<14}{'conc':>5}{'req':>5}{'tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
            f"{'TPOT ms':>9}{'accept':>8}"]
  for r in http:
    lines.append(f"{r['label']:<14}{r['concurrency']:>5}{r['requests']:>5}"
                 f"{r['tokens_per_second']:>10.1f}{r['ttft_p50_ms']:>10.1f}"
                 f"{r['ttft_p99_ms']:>10.1f}{_f(r['tpot_ms'], '.2f'):>9}"
                 f"{_f(r['acceptance_length'], '.2f'):>8}")
  lines += ["", "== engine host time per chunk (over all of a server's requests; launch ~0: "
            "asynchronous dispatch)",
            f"{'server':<14}{'chunks':>7}{'alone':>6}{'steps/chunk':>12}{'launch ms':>10}"
            f"{'wait ms':>9}{'host ms':>9}{'refill ms':>10}{'tokens':>8}"]
  for h in health:
    n = h.get("chunks") or 0
    per = lambda k, n=n, h=h: 1e3 * h.get(k, 0.0) / n if n else None
    lines.append(f"{h['label']:<14}{n:>7}{h.get('alone_chunks', 0):>6}"
                 f"{_f(n and h.get('steps', 0) / n, '.1f'):>12}{_f(per('launch_s'), '.2f'):>10}"
                 f"{_f(per('wait_s'), '.2f'):>9}{_f(per('host_s'), '.2f'):>9}"
                 f"{_f(per('refill_s'), '.2f'):>10}{h.get('tokens', 0):>8}")
  return "\n".join(lines)


if __name__ == "__main__":
  if len(sys.argv) != 3:
    sys.exit("usage: python -m experiments.perf.serve_summary SERVE_JSONL HEALTH_JSONL")
  print(tables(_rows(sys.argv[1]), _rows(sys.argv[2])))
