"""The main job: load a target (and drafter), generate with each method, print text and a table.

  python experiments/generate.py --config=configs/default.py --config.methods=ar,chain,ddtree
  python experiments/generate.py ... --mesh_tp=8            # tensor parallel over 8 devices

The last line printed is one JSON object: {"results": [{method, budget, tau, tokens_per_second}]}.
"""

import json

from absl import app
from ml_collections import config_flags

import ddtree_jax as dj
from ddtree_jax import sharding

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "run configuration")
sharding.define_mesh_flags()  # --mesh_dp --mesh_tp, multi-host --coordinator_address etc.


def _runs(cfg):
  for method in [m.strip() for m in cfg.methods.split(",") if m.strip()]:
    if method == "ddtree":
      for b in [int(x) for x in str(cfg.budgets).split(",") if x.strip()]:
        yield method, b
    else:
      yield method, None


def main(_):
  cfg = _CONFIG.value
  mesh = sharding.mesh_from_flags()
  target = dj.load_target(cfg.target, dtype=cfg.dtype, mesh=mesh)
  drafter = dj.load_drafter(cfg.drafter, target) if cfg.drafter else None
  tok = target.tokenizer
  encode = (lambda s: tok.encode(s).ids) if tok else (lambda s: [ord(c) % target.config.vocab_size for c in s])
  prompts = [encode(p) for p in cfg.prompts]
  results, reference = [], None
  for method, budget in _runs(cfg):
    kw = dict(method=method, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
              drafter=drafter, budget=budget, attention=cfg.attention or None)
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
  app.run(main)
