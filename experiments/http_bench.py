"""Measures any OpenAI-compatible server over HTTP (ddtree-jax's `experiments/serve.py`, SGLang,
vLLM) with the same code: streaming completions at each concurrency, time to first token,
time per output token, tokens/s, and the acceptance length when the server reports it
(ddtree-jax's `ddtree.acceptance_lengths`).

  python -m experiments.bench_matrix --config=configs/default.py \
      --config.endpoint=http://127.0.0.1:8000 --config.concurrency=1,4,16,32

Each level sends `requests_per_level` requests (the config's prompts, in turn), `concurrency` at
a time, greedy, `max_new_tokens` each; prints a table and writes http_bench.json to out_dir.
"""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import time

import openai

from ddtree_jax import files


def _one(client, model: str, prompt: str, max_tokens: int) -> dict:
  t0 = time.perf_counter()
  first = last = None
  chunks, acceptance, usage = 0, None, None
  stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, stream=True,
                                     stream_options={"include_usage": True})
  for event in stream:
    now = time.perf_counter()
    if event.choices and event.choices[0].text:
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


def run(cfg) -> dict:
  """One row per concurrency level of cfg.concurrency against cfg.endpoint."""
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
      results = list(pool.map(lambda p: _one(client, model, p, cfg.max_new_tokens), jobs))
    wall = time.perf_counter() - t0
    tpots = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
    acc = [a for r in results for a in (r["acceptance"] or [])]
    rows.append({"concurrency": level, "requests": n, "tokens_per_second":
                 sum(r["tokens"] for r in results) / wall,
                 "ttft_p50_ms": 1e3 * _pct([r["ttft_s"] for r in results], 0.5),
                 "ttft_p99_ms": 1e3 * _pct([r["ttft_s"] for r in results], 0.99),
                 "tpot_ms": 1e3 * statistics.median(tpots) if tpots else None,
                 "acceptance_length": statistics.mean(acc) if acc else None})
  print(f"\n{base} model {model!r}, {cfg.max_new_tokens} tokens per request")
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
  return {"rows": rows, "file": path}
