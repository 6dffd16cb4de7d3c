"""The main job: load a target (and drafter), generate with each method, print text and a table.

  python -m experiments.generate --config=configs/default.py --config.methods=ar,chain,ddtree
  python -m experiments.generate ... --mesh_tp=8            # tensor parallel over 8 devices

Prints the first prompt with its completion once, then a table per method: tau, target forward
passes per 100 tokens, tokens/s, speed-up over the first method, and whether the output equals the
first method's; for budget=auto, the steps each budget was chosen and the drafts accepted against
those the drafter expected. On the bundled pair it first says what the pair is (sizes and
training, from its TRAINING.json) and after the table what the same command measured on a GPU
(the committed run in GPU_RUN). The last line printed is one JSON object: {"results": [{method,
budget, tau, forwards_per_100_tokens, tokens_per_second, identical_to_first, ...}]}.
"""

import hashlib
import json
import os
import textwrap

import jax
import numpy as np

from experiments import workflow

import ddtree_jax as dj
from ddtree_jax import sharding

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The bundled pair under this same command on one GPU: its log ends with this script's JSON line.
GPU_RUN = os.path.join(REPO, "experiments", "results", "headline-2026-12-01")
GPU_COMMAND = "python -m experiments.generate --config=configs/default.py"

_CONFIG = workflow.define_config("configs/default.py")
sharding.define_mesh_flags()  # --mesh_dp --mesh_tp, multi-host --coordinator_address etc.


def forwards_per_100(res) -> float:
  """Target forward passes per 100 new tokens, per sequence: the prefill plus one verify per
  round (AR: 100; the saving speculation makes whatever the machine)."""
  passes = sum(1 + len(a) for a in res.stats["acceptance_lengths"])
  return 100.0 * passes / max(sum(len(t) for t in res.tokens), 1)


def speculation_slower(results) -> bool:
  """Whether every method after the first (AR) ran fewer tokens/s than it: the CPU note is
  printed only while the table shows that."""
  return len(results) > 1 and all(r["tokens_per_second"] < results[0]["tokens_per_second"]
                                  for r in results[1:])


def round_costs(rows) -> str:
  """Each speculative row's round in AR steps (tau / its speed-up over the first row) for the
  tau tokens it kept, e.g. "a chain round cost 3.1 AR steps for 2.4 tokens"."""
  base = rows[0]["tokens_per_second"] or 1.0
  return "; ".join(
      f"a {workflow.Plan.name(r['method'], r['budget'])} round cost "
      f"{r['tau'] * base / max(r['tokens_per_second'], 1e-9):.1f} AR steps for {r['tau']:.2f} "
      f"tokens" for r in rows[1:])


def params_m(params) -> float:
  """Millions of parameters in a params pytree (quantized words count as stored)."""
  return sum(np.size(x) for x in jax.tree.leaves(params)) / 1e6


def describe_pair(target, drafter, training: dict) -> str:
  """What the bundled pair is, from the loaded models and its TRAINING.json."""
  t, d, corpus = training["target"], training["drafter"], training.get("corpus", {})
  vocab = corpus.get("settings", {}).get("vocab_size")
  return (f"The bundled pair (ddtree_jax/default_model, `make train`): a "
          f"{params_m(target.params):.1f}M-parameter Qwen3 code model"
          f"{f' (vocabulary {vocab})' if vocab else ''} trained {t['train_seconds']:.0f} s on "
          f"the Python standard library, and a {params_m(drafter.params):.1f}M-parameter DFlash "
          f"drafter trained {d['train_seconds']:.0f} s on its outputs. A toy: its completions "
          f"are not good Python (held-out loss {t['exported_heldout_loss']:.2f}); what it shows "
          f"is that every method below writes exactly AR's tokens, in fewer target forwards.")


def gpu_summary(run_dir: str) -> str | None:
  """The same command's table on a GPU, from the committed run's log (None if absent)."""
  log, gpus = os.path.join(run_dir, "demo.log"), os.path.join(run_dir, "gpus.txt")
  if not os.path.exists(log):
    return None
  with open(log) as f:
    rows = json.loads([ln for ln in f if ln.startswith('{"results"')][-1])["results"]
  card = "a GPU"
  if os.path.exists(gpus):
    with open(gpus) as f:
      card = f.read().splitlines()[-1].split(",")[0].strip()
  date = os.path.basename(run_dir).rsplit("-", 3)[-3:]
  base = rows[0]["tokens_per_second"]
  parts = [f"{workflow.Plan.name(r['method'], r['budget'])} {r['tokens_per_second'] / base:.2f}x"
           for r in rows[1:]]
  same = all(r["identical_to_first"] for r in rows)
  pair = "the same pair"
  recorded = os.path.join(run_dir, "drafter.sha256")  # the drafter that run used
  if os.path.exists(recorded):
    with open(recorded) as f, open(os.path.join(dj.DEFAULT_MODEL_DIR, "drafter",
                                                "model.safetensors"), "rb") as g:
      if f.read().strip() != hashlib.sha256(g.read()).hexdigest():
        pair = "the same target with the drafter shipped before this one"
  return (f"On one {card} ({'-'.join(date)}, `{GPU_COMMAND}`, float32, Pallas attention; "
          f"{os.path.relpath(log, REPO)}) {pair} ran AR at {base:.0f} tokens/s and "
          + ", ".join(parts) + " of it; " + round_costs(rows)
          + ("; every output identical to AR's." if same else "."))


def main(_):
  cfg = _CONFIG.value
  plan = workflow.validate(cfg, baselines=False)  # methods, budgets, ... with the valid values
  mesh = sharding.mesh_from_flags()
  target, drafter = workflow.load_models(cfg, mesh)
  tok = target.tokenizer
  bundled = drafter is not None and os.path.realpath(cfg.drafter) == os.path.realpath(
      os.path.join(dj.DEFAULT_MODEL_DIR, "drafter"))
  if bundled:
    with open(os.path.join(dj.DEFAULT_MODEL_DIR, "TRAINING.json")) as f:
      print(textwrap.fill(describe_pair(target, drafter, json.load(f)), 100) + "\n")
  prompts = [workflow.encoder(target)(p) for p in cfg.prompts]
  results, reference = [], None
  for method, budget in plan.runs:
    kw = workflow.generate_kwargs(cfg, method, budget, drafter)
    dj.generate(target, prompts, **kw)  # warm-up: compile outside the timed run
    runs = [dj.generate(target, prompts, **kw) for _ in range(cfg.repeats)]
    res = runs[-1]
    speeds = [r.stats["tokens_per_second"] for r in runs]
    name = method if budget is None else f"{method}/B={budget}"
    if reference is None:
      reference = res.tokens
      text = tok.decode(res.tokens[0]) if tok else str(res.tokens[0])
      print(f"--- prompt 1 of {len(prompts)}, {name}\n{cfg.prompts[0]}{text}\n---")
    results.append(dict(method=method, budget=budget, tau=round(res.stats["tau"], 3),
                        forwards_per_100_tokens=round(forwards_per_100(res), 1),
                        tokens_per_second=round(float(np.median(speeds)), 1),
                        tokens_per_second_range=[round(min(speeds), 1), round(max(speeds), 1)],
                        identical_to_first=res.tokens == reference, **workflow.auto_summary(res)))
  base = results[0]["tokens_per_second"] or 1.0
  print(f"\n{'method':<14}{'tau':>7}{'fwd/100 tok':>13}{'tok/s':>10}{'(range)':>17}"
        f"{'speed-up':>10}{'same':>6}")
  for r in results:
    name = r["method"] if r["budget"] is None else f"{r['method']}/B={r['budget']}"
    lo, hi = r["tokens_per_second_range"]
    print(f"{name:<14}{r['tau']:>7.2f}{r['forwards_per_100_tokens']:>13.1f}"
          f"{r['tokens_per_second']:>10.1f}{f'({lo:.0f}-{hi:.0f})':>17}"
          f"{r['tokens_per_second'] / base:>9.2f}x{str(r['identical_to_first']):>6}")
  print(textwrap.fill(f"(tok/s: the median of {cfg.repeats} timed runs and their range; tau and "
                      "fwd/100 tok do not depend on the machine's load, tok/s does, most on a "
                      "shared CPU)", 100))
  for r in results:
    if "chosen" in r:
      print(f"\n{workflow.Plan.name(r['method'], r['budget'])}: steps per budget {r['chosen']} (0 = AR); "
            f"accepted {r['accepted_per_drafted_step']:.2f} drafts per drafted step, "
            f"{r['expected_per_drafted_step']:.2f} expected by the drafter")
  if jax.default_backend() == "cpu" and speculation_slower(results):
    print("\n" + textwrap.fill(
        "On a CPU a step's time is its arithmetic, which grows with the tokens verified; here "
        f"{round_costs(results)}. For a model this small that is more than the tokens a round "
        "keeps, so speculation saves target forwards (fwd/100 tok) but not time. On a GPU a small "
        "model's step costs its launches and bytes, nearly the same for 1 token or 32, and the "
        "same rounds win.", 100))
  if cfg.temperature > 0:
    print("\n" + textwrap.fill(
        f"At temperature {cfg.temperature:g} every method draws samples of the target's own "
        "distribution, and different methods consume the random draws differently, so `same` "
        "compares two samples and is usually False. That speculative sampling follows "
        "the target's distribution is checked by distribution, not by equality "
        "(tests/test_sampling.py: the first tokens' joint law against the exact one).", 100))
  summary = gpu_summary(GPU_RUN) if bundled else None
  if summary:
    print("\n" + textwrap.fill(summary, 100))
  print(json.dumps({"results": results}))


if __name__ == "__main__":
  workflow.run_app(main)
