"""Measures any OpenAI-compatible server over HTTP (ddtree-jax's `experiments/serve.py`, SGLang,
vLLM) with the same code: streaming completions at each concurrency, time to first token,
time per output token, tokens/s, and the acceptance length when the server reports it
(ddtree-jax's `ddtree.acceptance_lengths`); and, for the "HTTP within 5 % of in-process" check,
in-process `generate` one request at a time with the same prompts and lengths.

  python -m experiments.bench_matrix --config=configs/default.py \
      --config.endpoint=http://127.0.0.1:8000 --config.concurrency=1,4,16,32
  python -m experiments.http_bench --config=configs/default.py \
      --config.endpoint=http://127.0.0.1:8000 --label=16 --json_out=out/serve.jsonl
  python -m experiments.http_bench --config=configs/default.py --in_process=ar,chain,16 \
      --capacity=512 --json_out=out/serve.jsonl

  python -m experiments.http_bench --config=configs/default.py --config.random_target=True \
      --config.random_drafter=True --config.drafter= --config.dtype=bfloat16 --in_process=ar,16 \
      --tokenizer=ddtree_jax/default_model/target --label=8b   # a random 8B-shape target

Each level sends `requests_per_level` requests (the config's prompts, in turn), `concurrency` at
a time, `max_new_tokens` each, at the config's temperature (greedy at 0; seed = the config's);
prints a table and writes http_bench.json to out_dir (and, from the command line, one JSON line
per row to --json_out). A request's tokens are the server's `usage.completion_tokens` (else its
token events), its first token the first event with a choice, whatever its text (a random
target's ids mostly decode to nothing).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import statistics
import time

from ddtree_jax.checkpoints import files


def _one(client, model: str, prompt: str, max_tokens: int, temperature: float = 0.0,
         seed: int = 0) -> dict:
  t0 = time.perf_counter()
  first = last = None
  chunks, acceptance, usage = 0, None, None
  sampling = {"seed": seed} if temperature > 0 else {}
  stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                     temperature=temperature, stream=True,
                                     stream_options={"include_usage": True}, **sampling)
  for event in stream:
    now = time.perf_counter()
    if event.choices:  # (a token event; its text may be empty: ids a tokenizer does not know)
      first = first or now
      last = now
      chunks += 1
    extra = event.model_extra or {}
    acceptance = (extra.get("ddtree") or {}).get("acceptance_lengths", acceptance)
    usage = event.usage or usage
  tokens = usage.completion_tokens if usage else chunks
  return {"ttft_s": (first or time.perf_counter()) - t0,
          "tpot_s": (last - first) / (tokens - 1) if first and tokens > 1 else None,
          "tokens": tokens, "seconds": time.perf_counter() - t0,
          "acceptance": acceptance}


def _pct(values, q):
  values = sorted(values)
  return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else None


def _append(path: str, rows) -> None:
  if path:
    with open(path, "a") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)


def run(cfg, label: str = "", json_out: str = "") -> dict:
  """One row per concurrency level of cfg.concurrency against cfg.endpoint."""
  import openai  # pylint: disable=import-outside-toplevel
  base = cfg.endpoint.rstrip("/")
  client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
  model = cfg.endpoint_model or client.models.list().data[0].id
  levels = [int(c) for c in str(cfg.concurrency).split(",") if c]
  prompts = list(cfg.prompts)
  rows = []
  for level in levels:
    n = max(cfg.requests_per_level, level)
    jobs = [prompts[i % len(prompts)] for i in range(n)]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(level) as pool:
      results = list(pool.map(lambda p: _one(client, model, p, cfg.max_new_tokens,
                                             cfg.temperature, cfg.seed), jobs))
    wall = time.perf_counter() - t0
    tpots = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
    acc = [a for r in results for a in (r["acceptance"] or [])]
    rows.append({"label": label, "mode": "http", "concurrency": level, "requests": n,
                 "tokens_per_second": sum(r["tokens"] for r in results) / wall,
                 "ttft_p50_ms": 1e3 * _pct([r["ttft_s"] for r in results], 0.5),
                 "ttft_p99_ms": 1e3 * _pct([r["ttft_s"] for r in results], 0.99),
                 "tpot_ms": 1e3 * statistics.median(tpots) if tpots else None,
                 "acceptance_length": statistics.mean(acc) if acc else None})
  print(f"\n{base} model {model!r}{' (' + label + ')' if label else ''}, "
        f"{cfg.max_new_tokens} tokens per request")
  print(f"{'concurrency':>11}{'requests':>9}{'tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'TPOT ms':>9}{'accept':>8}")
  for r in rows:
    tpot = "-" if r["tpot_ms"] is None else f"{r['tpot_ms']:.1f}"
    acc = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
    print(f"{r['concurrency']:>11}{r['requests']:>9}{r['tokens_per_second']:>10.1f}"
          f"{r['ttft_p50_ms']:>10.1f}{r['ttft_p99_ms']:>10.1f}{tpot:>9}{acc:>8}")
  os.makedirs(cfg.out_dir, exist_ok=True)
  path = os.path.join(cfg.out_dir, "http_bench.json")
  files.write_json(path, {"endpoint": base, "model": model, "rows": rows}, indent=1)
  print(f"wrote {path}")
  _append(json_out, rows)
  return {"rows": rows, "file": path}


def in_process(cfg, target, drafter, runs, capacity: int | None = None, threads: int = 8,
               label: str = ""):
  """In-process `generate`, one prompt at a time (concurrency 1), per (method, budget) of runs:
  a warm-up then cfg.repeats timed calls per prompt. tokens_per_second: tokens over the call's
  wall time (prefill included, as a client sees it); decode_tokens_per_second: the decode loop's.
  Rows are labelled ar, chain or the budget, after `label` and a colon when given."""
  import ddtree_jax as dj  # pylint: disable=import-outside-toplevel
  from experiments import workflow  # pylint: disable=import-outside-toplevel
  prompts = workflow.make_prompts(cfg, target, len(cfg.prompts))
  kws = [dict(workflow.generate_kwargs(cfg, m, b or None, drafter), stop_token_ids=(),
              cache_capacity=capacity) for m, b in runs]
  dj.compile_many(target, [([prompts[0]], kw) for kw in kws], threads)
  rows = []
  for (method, budget), kw in zip(runs, kws):
    e2e, dec, acc = [], [], []
    for p in prompts:
      dj.generate(target, [p], **kw)  # warm-up
      for _ in range(cfg.repeats):
        t0 = time.perf_counter()
        res = dj.generate(target, [p], **kw)
        e2e.append(len(res.tokens[0]) / (time.perf_counter() - t0))
        dec.append(res.stats["tokens_per_second"])
        acc += res.stats["acceptance_lengths"][0]
    name = str(budget) if budget else method
    rows.append({"label": f"{label}:{name}" if label else name, "mode": "in_process",
                 "method": method, "budget": budget, "concurrency": 1,
                 "tokens_per_second": statistics.median(e2e),
                 "decode_tokens_per_second": statistics.median(dec),
                 "acceptance_length": statistics.mean(acc) if acc else None})
    print(json.dumps(rows[-1]), flush=True)
  return rows


def parse_runs(spec: str) -> list[tuple[str, int | str]]:
  """--in_process's comma list (ar, chain, a DDTree budget or auto) as (method, budget)."""
  runs = []
  for x in filter(None, spec.split(",")):
    if x in ("ar", "chain"):
      runs.append((x, 0))
    elif x == "auto":
      runs.append(("ddtree", x))
    elif x.isdigit():
      runs.append(("ddtree", int(x)))
    else:
      raise ValueError(f"--in_process: {x!r} is not ar, chain, a DDTree budget or auto")
  return runs


def main(_):
  from absl import flags  # pylint: disable=import-outside-toplevel
  f = flags.FLAGS
  cfg = f.config
  if f.in_process:
    from experiments import workflow  # pylint: disable=import-outside-toplevel
    runs = parse_runs(f.in_process)
    target, drafter = workflow.load_models(cfg)
    if f.tokenizer:  # a random target's prompts encoded as the server encodes them
      from ddtree_jax.checkpoints import hf as checkpoint  # pylint: disable=import-outside-toplevel
      target = dataclasses.replace(target, tokenizer=checkpoint.load_tokenizer(f.tokenizer))
    _append(f.json_out, in_process(cfg, target, drafter, runs, f.capacity or None,
                                   label=f.label))
  else:
    run(cfg, f.label, f.json_out)


if __name__ == "__main__":
  from absl import flags as absl_flags
  from experiments import workflow as _workflow
  _workflow.define_config("configs/default.py")
  absl_flags.DEFINE_string("label", "", "names the server in the rows; with --in_process, "
                           "prefixes its runs' names (ar, chain, a DDTree budget) as LABEL:run")
  absl_flags.DEFINE_string("tokenizer", "", "with --in_process: encode the prompts with this "
                           "directory's tokenizer.json (a random target's, as the server's "
                           "serve.tokenizer does)")
  absl_flags.DEFINE_string("json_out", "", "append each row here as a JSON line")
  absl_flags.DEFINE_string("in_process", "", "instead of HTTP: in-process generate at "
                           "concurrency 1 for these runs (ar, chain, a DDTree budget or auto)")
  absl_flags.DEFINE_integer("capacity", 0, "in-process cache rows per sequence (the server's "
                            "serve.capacity; 0 = generate's default)")
  _workflow.run_app(main)
