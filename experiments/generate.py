"""The main job: load a target (and drafter), generate with each method, print text and a table.

  python -m experiments.generate --config=configs/default.py --config.methods=ar,chain,ddtree
  python -m experiments.generate ... --mesh_tp=8            # tensor parallel over 8 devices

Prints the first prompt with its completion once, then a table per method: tau, target forward
passes per 100 tokens, tokens/s, speed-up over the first method, and whether the output equals the
first method's; for budget=auto, the steps each budget was chosen and the drafts accepted against
those the drafter expected. The last line printed is one JSON object: {"results": [{method,
budget, tau, forwards_per_100_tokens, tokens_per_second, identical_to_first, ...}]}.
"""

import json

import jax

from experiments import workflow

import ddtree_jax as dj
from ddtree_jax import sharding

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


def main(_):
  cfg = _CONFIG.value
  plan = workflow.validate(cfg, baselines=False)  # methods, budgets, ... with the valid values
  mesh = sharding.mesh_from_flags()
  target, drafter = workflow.load_models(cfg, mesh)
  tok = target.tokenizer
  prompts = [workflow.encoder(target)(p) for p in cfg.prompts]
  results, reference = [], None
  for method, budget in plan.runs:
    kw = workflow.generate_kwargs(cfg, method, budget, drafter)
    dj.generate(target, prompts, **kw)  # warm-up: compile outside the timed run
    res = dj.generate(target, prompts, **kw)
    name = method if budget is None else f"{method}/B={budget}"
    if reference is None:
      reference = res.tokens
      text = tok.decode(res.tokens[0]) if tok else str(res.tokens[0])
      print(f"--- prompt 1 of {len(prompts)}, {name}\n{cfg.prompts[0]}{text}\n---")
    results.append(dict(method=method, budget=budget, tau=round(res.stats["tau"], 3),
                        forwards_per_100_tokens=round(forwards_per_100(res), 1),
                        tokens_per_second=round(res.stats["tokens_per_second"], 1),
                        identical_to_first=res.tokens == reference, **workflow.auto_summary(res)))
  base = results[0]["tokens_per_second"] or 1.0
  print(f"\n{'method':<14}{'tau':>7}{'fwd/100 tok':>13}{'tok/s':>10}{'speed-up':>10}{'same':>6}")
  for r in results:
    name = r["method"] if r["budget"] is None else f"{r['method']}/B={r['budget']}"
    print(f"{name:<14}{r['tau']:>7.2f}{r['forwards_per_100_tokens']:>13.1f}"
          f"{r['tokens_per_second']:>10.1f}{r['tokens_per_second'] / base:>9.2f}x"
          f"{str(r['identical_to_first']):>6}")
  for r in results:
    if "chosen" in r:
      print(f"\n{workflow.Plan.name(r['method'], r['budget'])}: steps per budget {r['chosen']} (0 = AR); "
            f"accepted {r['accepted_per_drafted_step']:.2f} drafts per drafted step, "
            f"{r['expected_per_drafted_step']:.2f} expected by the drafter")
  if jax.default_backend() == "cpu" and speculation_slower(results):
    print("\nOn a CPU a model this small is launch-bound: a verify of many tokens costs more than "
          "an AR step, so\nspeculation saves target forwards (fwd/100 tok) but not time here. "
          "The GPU figures are in README.md, Results.")
  print(json.dumps({"results": results}))


if __name__ == "__main__":
  workflow.run_app(main)
