"""The main job: load a target (and drafter), generate with each method, print text and a table.

  python -m experiments.generate --config=configs/default.py --config.methods=ar,chain,ddtree
  python -m experiments.generate ... --mesh_tp=8            # tensor parallel over 8 devices

The last line printed is one JSON object: {"results": [{method, budget, tau, tokens_per_second}]}.
"""

import json

from experiments import workflow

import ddtree_jax as dj
from ddtree_jax import sharding

_CONFIG = workflow.define_config("configs/default.py")
sharding.define_mesh_flags()  # --mesh_dp --mesh_tp, multi-host --coordinator_address etc.


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
      for p, out in zip(cfg.prompts, res.tokens):
        text = tok.decode(out) if tok else str(out)
        print(f"--- {name}\n{p}{text}")
    same = res.tokens == reference
    results.append(dict(method=method, budget=budget, tau=round(res.stats["tau"], 3),
                        tokens_per_second=round(res.stats["tokens_per_second"], 1),
                        identical_to_first=same))
  base = results[0]["tokens_per_second"] or 1.0
  print(f"\n{'method':<14}{'tau':>7}{'tok/s':>10}{'speed-up':>10}{'same':>6}")
  for r in results:
    name = r["method"] if r["budget"] is None else f"{r['method']}/B={r['budget']}"
    print(f"{name:<14}{r['tau']:>7.2f}{r['tokens_per_second']:>10.1f}"
          f"{r['tokens_per_second'] / base:>9.2f}x{str(r['identical_to_first']):>6}")
  print(json.dumps({"results": results}))


if __name__ == "__main__":
  workflow.run_app(main)
