"""CPU A/B of the server over HTTP: for each (tree, server settings), start
experiments/serve.py from that source tree, run experiments/http_bench.py against it, stop it;
the trees' runs interleaved, each repeated. This 2-core machine is shared: a run starts once no
other process used more than 5 % of a core for 5 s, and a run during which other processes took
more than 10 % of the CPU time is done again (up to 4 times; the rows say how much they took).

  python -m experiments.perf.serve_ab --before=/tmp/base --after=/tmp/after \
      --out=/tmp/cpu/ab --repeats=2 --variants=norefill,nopipe,max8,b64
  python -m experiments.perf.serve_ab --table=/tmp/cpu/ab/rows.jsonl

--before / --after are copies of the source trees (`git archive COMMIT | tar -x -C /tmp/base`;
a copy of the working tree), so that edits during the run change nothing. Rows: OUT/rows.jsonl
(http_bench's, plus tree, repeat, foreign_cpu); logs beside them. --table prints the mean of the
repeats per tree, server and concurrency (tok/s, TTFT p50 ms).
"""

import argparse
import json
import os
import subprocess
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")
SERVERS = {  # name -> (serve overrides, concurrency levels)
    "ddtree16_8slots": (["--config.serve.method=ddtree", "--config.serve.budget=16",
                         "--config.serve.slots=8"], "1,4,16"),
    "ar_8slots": (["--config.serve.method=ar", "--config.serve.slots=8"], "1,4,16"),
    "ddtree16_1slot": (["--config.serve.method=ddtree", "--config.serve.budget=16",
                        "--config.serve.slots=1"], "1"),
}
VARIANTS = {  # "after" ablations: name -> extra overrides
    "": [],
    "nopipe": ["--config.serve.pipeline=False"],
    "max8": ["--config.serve.max_chunk_steps=8"],
    "b64": ["--config.serve.prompt_buckets=64,256"],
    "norefill": ["--config.serve.refill_wait=0"],
}


def _procs():
  """{pid: (ppid, cpu jiffies)} of every process."""
  out = {}
  for pid in os.listdir("/proc"):
    if not pid.isdigit():
      continue
    try:
      with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      out[int(pid)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    except (OSError, IndexError):
      pass
  return out


def _foreign_jiffies() -> int:
  """CPU jiffies of processes outside this one's tree (only those alive now)."""
  procs = _procs()
  mine, grew = {os.getpid()}, True
  while grew:
    new = {p for p, (pp, _) in procs.items() if pp in mine} - mine
    grew = bool(new)
    mine |= new
  return sum(j for p, (_, j) in procs.items() if p not in mine and p > 2)


def _wait_quiet(quiet_s=5.0, limit=0.05, give_up_s=1800):
  t_end = time.time() + give_up_s
  calm = 0.0
  while time.time() < t_end and calm < quiet_s:
    a = _foreign_jiffies()
    time.sleep(1.0)
    busy = (_foreign_jiffies() - a) / HZ
    calm = calm + 1.0 if busy < limit else 0.0


def _measure(py, tree, args, log_path, rows_file, tries=4):
  """Runs experiments/http_bench.py with args once the machine is quiet (again while other
  processes took > 10 % of the CPU, up to `tries` times); returns its rows."""
  for attempt in range(tries):
    if os.path.exists(rows_file):
      os.remove(rows_file)
    _wait_quiet()
    j0, t0 = _foreign_jiffies(), time.time()
    with open(log_path, "w") as log:
      subprocess.run([py, "-m", "experiments.http_bench", "--config=configs/default.py", *args,
                      f"--json_out={rows_file}"], cwd=tree, stdout=log,
                     stderr=subprocess.STDOUT, check=True, env=dict(os.environ, PYTHONPATH=tree))
    foreign = (_foreign_jiffies() - j0) / HZ / (time.time() - t0)
    if foreign < 0.1:
      break
  with open(rows_file) as f:
    return [dict(json.loads(line), foreign_cpu=round(foreign, 3), attempts=attempt + 1)
            for line in f]


def run_one(py, tree, name, serve_args, levels, out, port, tag, requests=16):
  log = open(os.path.join(out, f"{tag}.serve.log"), "w")
  srv = subprocess.Popen([py, "-m", "experiments.serve", "--config=configs/serve.py",
                          f"--config.serve.port={port}", *serve_args], cwd=tree, stdout=log,
                         stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=tree))
  try:
    for _ in range(900):
      with open(log.name) as f:
        if any(line.startswith("ready:") for line in f):
          break
      if srv.poll() is not None:
        raise RuntimeError(f"{tag}: the server exited, see {log.name}")
      time.sleep(1)
    return _measure(py, tree, [f"--config.endpoint=http://127.0.0.1:{port}",
                               f"--config.concurrency={levels}",
                               f"--config.requests_per_level={requests}",
                               "--config.max_new_tokens=64",
                               f"--config.out_dir=/tmp/serve_ab_{port}", f"--label={name}"],
                    os.path.join(out, f"{tag}.http.log"), os.path.join(out, f"{tag}.rows.jsonl"))
  finally:
    srv.terminate()
    srv.wait()


def in_process(py, tree, out, tag):
  return _measure(py, tree, ["--in_process=ar,16", "--capacity=512", "--config.max_new_tokens=64",
                             "--config.repeats=3"],
                  os.path.join(out, f"{tag}.log"), os.path.join(out, f"{tag}.rows.jsonl"), tries=1)


def table(path):
  """Markdown: tok/s (TTFT p50 ms) per server and concurrency, a column per tree, the mean of the
  repeats; then each HTTP row over its repeat's in-process tok/s of the same method (the `after`
  run's for the ablations), the machine's speed of the moment divided out: mean (min-max)."""
  with open(path) as f:
    rows = [json.loads(line) for line in f]
  trees = list(dict.fromkeys(r["tree"] for r in rows))
  cells = {}
  for r in rows:
    key = (r["label"] if r["mode"] == "http" else f"in-process {r['label']}", r["concurrency"])
    cells.setdefault(key, {}).setdefault(r["tree"], []).append(r)
  mean = lambda xs: sum(xs) / len(xs)
  head = ["| server | conc | " + " | ".join(trees) + " |", "| --- | --- |" + " --- |" * len(trees)]
  print("\n".join(head))
  for (label, conc), by_tree in cells.items():
    row = [(f"{mean([r['tokens_per_second'] for r in rs]):.0f}" + (
        f" ({mean([r['ttft_p50_ms'] for r in rs]):.0f})" if "ttft_p50_ms" in rs[0] else ""))
           if (rs := by_tree.get(t)) else "-" for t in trees]
    print(f"| {label} | {conc} | " + " | ".join(row) + " |")
  base = {(r["tree"], r["repeat"], r["label"]): r["tokens_per_second"] for r in rows
          if r["mode"] == "in_process"}
  print("\nHTTP tok/s over in-process tok/s (same repeat, same method)\n" + "\n".join(head))
  for (label, conc), by_tree in cells.items():
    if label.startswith("in-process"):
      continue
    row = []
    for t in trees:
      x = [r["tokens_per_second"] / b for r in by_tree.get(t, []) if (b := base.get(
          (t if (t, r["repeat"], "ar") in base else "after", r["repeat"],
           "ar" if label.startswith("ar") else "16")))]
      row.append(f"{mean(x):.3f} ({min(x):.2f}-{max(x):.2f})" if x else "-")
    print(f"| {label} | {conc} | " + " | ".join(row) + " |")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--table", default="", help="print the table of a rows.jsonl and stop")
  ap.add_argument("--before")
  ap.add_argument("--after")
  ap.add_argument("--out")
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--servers", default=",".join(SERVERS))
  ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
  ap.add_argument("--variants", default="",
                  help="after-tree ablations: " + ", ".join(v for v in VARIANTS if v))
  a = ap.parse_args()
  if a.table:
    return table(a.table)
  if not (a.before and a.after and a.out):
    ap.error("--before, --after and --out are required (or --table)")
  py = sys.executable
  os.makedirs(a.out, exist_ok=True)
  trees = [("before", os.path.abspath(a.before), [])] + [
      (f"after{'_' + v if v else ''}", os.path.abspath(a.after), VARIANTS[v])
      for v in [""] + [v for v in a.variants.split(",") if v]]
  with open(os.path.join(a.out, "rows.jsonl"), "a") as rows:
    for rep in range(a.repeats):
      for tree_name, tree, extra in trees:
        if not extra:
          for r in in_process(py, tree, a.out, f"{tree_name}.inprocess.{rep}"):
            rows.write(json.dumps(dict(r, tree=tree_name, repeat=rep)) + "\n")
            rows.flush()
        for name in a.servers.split(","):
          args, levels = SERVERS[name]
          for r in run_one(py, tree, name, args + extra, levels, a.out, 8013,
                           f"{tree_name}.{name}.{rep}", a.requests):
            rows.write(json.dumps(dict(r, tree=tree_name, repeat=rep)) + "\n")
            rows.flush()
          print(tree_name, name, rep, "done", flush=True)


if __name__ == "__main__":
  main()
