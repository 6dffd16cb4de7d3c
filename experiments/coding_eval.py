"""A five-problem coding check: generate each function body, run hidden tests in a sandbox.

  python -m experiments.coding_eval --config=configs/default.py
  python -m experiments.coding_eval --config=configs/qwen3_8b.py --config.target=/models/Qwen3-8B \
      --config.drafter=/models/Qwen3-8B-DFlash-b16 --config.budgets=8,32

Each problem is a prompt (signature + docstring, the model writing its newline) and hidden tests (inputs and
expected outputs). The model's completion is cut to the function body (indented lines, up to the
first dedent or a stop marker), appended to the prompt and executed by ddtree_jax.tools.sandbox: a fresh
`python -I -S` with an empty environment in a fresh temp dir, rlimits (CPU, memory, file size,
files), an audit hook blocking fork/exec/subprocess/sockets/ctypes and any write outside the temp
dir, a wall-clock kill of the process group and, where available, no network namespace. The
function's return values come back as JSON and are compared here. Runs every method / budget of
the config (T = temperature, default greedy) and prints a pass/fail table with tokens and tokens/s
per problem; writes coding_eval.json to out_dir; the last line printed is one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable

from experiments import workflow

from ddtree_jax.checkpoints import files
from ddtree_jax.tools import sandbox


@dataclasses.dataclass(frozen=True)
class Problem:
  name: str
  prompt: str                       # signature + docstring, without the final newline
  cases: tuple                      # argument tuples
  expected: tuple                   # expected return values
  canonical: str                    # a correct body (self-check and tests)


def _problem(name, signature, doc, cases, expected, canonical):
  # The model writes the docstring's newline itself: BPE code tokenizers merge a newline with
  # the next line's indentation, so a prompt ending in "\n" is a boundary they rarely saw.
  return Problem(name, f'def {name}{signature}:\n    """{doc}"""', tuple(cases), tuple(expected),
                 canonical)


PROBLEMS = {p.name: p for p in (
    _problem("is_palindrome", "(s: str) -> bool",
             "Return True if the string s reads the same forwards and backwards.",
             [("racecar",), ("abba",), ("abc",), ("",), ("a",), ("ab",), ("noon",), ("abca",)],
             [True, True, False, True, True, False, True, False],
             "    return s == s[::-1]\n"),
    _problem("fib", "(n: int) -> int",
             "Return the n-th Fibonacci number, with fib(0) = 0 and fib(1) = 1.",
             [(0,), (1,), (2,), (7,), (10,), (20,), (25,)], [0, 1, 1, 13, 55, 6765, 75025],
             "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"),
    _problem("merge_sorted", "(a: list, b: list) -> list",
             "Merge two sorted lists into one sorted list and return it.",
             [([1, 3, 5], [2, 4, 6]), ([], [1]), ([1, 2], []), ([], []), ([1, 1], [1]),
              ([-3, 0, 9], [-2, 5, 7, 11])],
             [[1, 2, 3, 4, 5, 6], [1], [1, 2], [], [1, 1, 1], [-3, -2, 0, 5, 7, 9, 11]],
             "    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
             "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n"
             "        else:\n            out.append(b[j])\n            j += 1\n"
             "    return out + a[i:] + b[j:]\n"),
    _problem("word_count", "(text: str) -> dict",
             "Return a dict mapping each whitespace-separated word of text to its number of "
             "occurrences.",
             [("a b a",), ("",), ("hello world hello",), ("x  y\nx\tz",), ("one",)],
             [{"a": 2, "b": 1}, {}, {"hello": 2, "world": 1}, {"x": 2, "y": 1, "z": 1},
              {"one": 1}],
             "    counts = {}\n    for w in text.split():\n        counts[w] = counts.get(w, 0) + 1\n"
             "    return counts\n"),
    _problem("gcd", "(a: int, b: int) -> int",
             "Return the greatest common divisor of the non-negative integers a and b "
             "(not both zero).",
             [(12, 18), (7, 5), (0, 9), (9, 0), (100, 10), (270, 192)], [6, 1, 9, 9, 10, 6],
             "    while b:\n        a, b = b, a % b\n    return a\n"),
)}

STOP_MARKERS = ("```", "<|endoftext|>", "<|im_end|>", "<|end_of_text|>", "<|eot_id|>",
                "\nif __name__")


def extract_body(completion: str) -> str:
  """The function body of a completion that follows the prompt: cut at the first stop marker,
  then keep the lines up to the first non-blank line that is not indented (a dedent)."""
  for stop in STOP_MARKERS:
    completion = completion.split(stop, 1)[0]
  body = []
  for line in completion.split("\n"):
    if line.strip() and not line[0].isspace():
      break
    body.append(line)
  return "\n".join(body).rstrip() + "\n"


def check(problem: Problem, completion: str, timeout_s: float = 5.0, memory_mb: int = 512):
  """(extracted body, sandbox.SandboxResult) for one completion of one problem."""
  body = extract_body(completion)
  if not body.startswith("\n"):  # a completion given from the next line on
    body = "\n" + body
  return body, sandbox.run_tests(problem.prompt + body, problem.name, problem.cases,
                                 problem.expected, timeout_s=timeout_s, memory_mb=memory_mb)


def evaluate(generate_fn: Callable[[Problem], dict], problems, timeout_s: float = 5.0,
             memory_mb: int = 512) -> list[dict]:
  """generate_fn(problem) -> {"text": completion after the prompt, "tokens": int,
  "tokens_per_second": float, "tau": float}; returns one row per problem."""
  rows = []
  for p in problems:
    gen = generate_fn(p)
    body, res = check(p, gen["text"], timeout_s, memory_mb)
    rows.append({"problem": p.name, "passed": res.passed, "status": res.status,
                 "detail": res.detail, "tokens": gen.get("tokens"),
                 "tokens_per_second": gen.get("tokens_per_second"), "tau": gen.get("tau"),
                 "sandbox_seconds": res.seconds, "isolation": list(res.isolation),
                 "completion": body})
  return rows


def print_table(rows) -> None:
  print(f"\n{'problem':<15}{'run':<13}{'result':<7}{'tokens':>7}{'tok/s':>10}{'tau':>6}  status")
  for r in rows:
    tps = "-" if r.get("tokens_per_second") is None else f"{r['tokens_per_second']:.1f}"
    tau = "-" if r.get("tau") is None else f"{r['tau']:.2f}"
    print(f"{r['problem']:<15}{r.get('run', '-'):<13}{'PASS' if r['passed'] else 'FAIL':<7}"
          f"{r.get('tokens') if r.get('tokens') is not None else '-':>7}{tps:>10}{tau:>6}  "
          f"{r['status']}")


def parse_problems(value) -> list[Problem]:
  names = [n.strip() for n in str(value).split(",") if n.strip()]
  bad = [n for n in names if n not in PROBLEMS]
  if bad or not names:
    raise workflow.ConfigError(f"unknown coding problem(s) {bad or value!r}; valid: "
                               f"{', '.join(PROBLEMS)}")
  return [PROBLEMS[n] for n in names]


def run_endpoint(cfg, problems) -> list[dict]:
  """The problems against an OpenAI-compatible server (cfg.endpoint), greedy completions."""
  import openai  # pylint: disable=import-outside-toplevel
  client = openai.OpenAI(base_url=cfg.endpoint.rstrip("/") + "/v1", api_key="none",
                         max_retries=0, timeout=600)
  model = cfg.endpoint_model or client.models.list().data[0].id

  def generate_fn(p):
    t0 = time.perf_counter()
    res = client.completions.create(model=model, prompt=p.prompt, temperature=0,
                                    max_tokens=cfg.coding.max_new_tokens)
    acc = (res.model_extra or {}).get("ddtree", {}).get("acceptance_lengths")
    n = res.usage.completion_tokens
    return {"text": res.choices[0].text, "tokens": n,
            "tokens_per_second": n / (time.perf_counter() - t0),
            "tau": sum(acc) / len(acc) if acc else None}
  t0 = time.perf_counter()
  rows = evaluate(generate_fn, problems, cfg.coding.timeout_s, cfg.coding.memory_mb)
  for r in rows:
    r.update(run="endpoint", method=model, budget=None)
  print_table(rows)
  print(f"\n{cfg.endpoint} ({model}): {sum(r['passed'] for r in rows)}/{len(rows)} passed")
  return rows, summarize(model, None, rows, time.perf_counter() - t0)


def summarize(method, budget, rows, seconds) -> dict:
  """One run's line of the summary: passed / total, mean tokens/s and tau (None where the rows
  have none, e.g. a server that reports no acceptance)."""
  mean = lambda key: (None if any(r[key] is None for r in rows)
                      else sum(r[key] for r in rows) / len(rows))
  return {"method": method, "budget": budget, "passed": sum(r["passed"] for r in rows),
          "total": len(rows), "tokens_per_second": mean("tokens_per_second"), "tau": mean("tau"),
          "seconds": seconds}


def run(cfg, mesh=None) -> dict:
  import ddtree_jax as dj  # pylint: disable=import-outside-toplevel
  problems = parse_problems(cfg.coding.problems)
  if cfg.endpoint:
    rows, summary = run_endpoint(cfg, problems)
    os.makedirs(cfg.out_dir, exist_ok=True)
    path = os.path.join(cfg.out_dir, "coding_eval.json")
    files.write_json(path, {"endpoint": cfg.endpoint, "summary": [summary], "rows": rows},
                     indent=1, default=str)
    return {"rows": rows, "summary": [summary], "file": path}
  plan = workflow.validate(cfg, baselines=False)
  target, drafter = workflow.load_models(cfg, mesh)
  if target.tokenizer is None:
    raise workflow.ConfigError("the coding eval needs a target with a tokenizer (tokenizer.json "
                               "in the target folder); random targets have none")
  enc, dec = workflow.encoder(target), workflow.decoder(target)
  rows, summary = [], []
  for method, budget in plan.runs:
    name = workflow.Plan.name(method, budget)
    kw = workflow.generate_kwargs(cfg, method, budget, drafter)
    kw["max_new_tokens"] = cfg.coding.max_new_tokens

    def generate_fn(p, kw=kw):
      res = dj.generate(target, [enc(p.prompt)], **kw)
      return {"text": dec(res.tokens[0]), "tokens": len(res.tokens[0]),
              "tokens_per_second": res.stats["tokens_per_second"], "tau": res.stats["tau"]}

    t0 = time.perf_counter()
    run_rows = evaluate(generate_fn, problems, cfg.coding.timeout_s, cfg.coding.memory_mb)
    for r in run_rows:
      r.update(run=name, method=method, budget=budget)
    rows += run_rows
    summary.append(summarize(method, budget, run_rows, time.perf_counter() - t0))
  print_table(rows)
  print(f"\n{'run':<13}{'passed':>8}{'tok/s':>10}{'tau':>7}")
  for s in summary:
    print(f"{workflow.Plan.name(s['method'], s['budget']):<13}{s['passed']:>5}/{s['total']:<2}"
          f"{s['tokens_per_second']:>10.1f}{s['tau']:>7.2f}")
  isolation = rows[0]["isolation"] if rows else []
  print(f"sandbox layers: {', '.join(isolation)}")
  os.makedirs(cfg.out_dir, exist_ok=True)
  path = os.path.join(cfg.out_dir, "coding_eval.json")
  files.write_json(path, {"target": target.path, "drafter": getattr(drafter, "path", None),
                          "config": cfg.to_dict(), "summary": summary, "rows": rows}, indent=1,
                   default=str)
  print(f"wrote {path}")
  return {"rows": rows, "summary": summary, "file": path}


def main(_):
  from ddtree_jax import sharding  # pylint: disable=import-outside-toplevel
  out = run(_CONFIG.value, sharding.mesh_from_flags())
  print(json.dumps({"results": out["summary"]}))


if __name__ == "__main__":
  from ddtree_jax import sharding as _sharding
  _CONFIG = workflow.define_config("configs/default.py")
  _sharding.define_mesh_flags()
  workflow.run_app(main)
