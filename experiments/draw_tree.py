"""Draws one DDTree draft tree with its accepted path (PNG).

  python -m experiments.draw_tree --config=configs/default.py --config.budgets=32
  python -m experiments.draw_tree --config=configs/qwen3_8b.py --config.budgets=64 \
      --config.target=/models/Qwen3-8B --config.drafter=/models/Qwen3-8B-DFlash-b16

Prefills the first prompt of the config, runs one speculative step at the first budget (draft ->
tree -> verify -> accept, the engine's own stage functions) and writes out_dir/tree_B{budget}.png.
Without a drafter in the config a random one is used (--config.random_drafter=True is implied).
"""

import json
import os

from ddtree_jax.checkpoints import files
from experiments import workflow


def run(cfg, out_path=None) -> dict:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  from ddtree_jax.tools import viz  # pylint: disable=import-outside-toplevel
  if not cfg.drafter and not cfg.random_drafter:
    cfg.random_drafter = True
  if "ddtree" not in workflow.parse_methods(cfg.methods):
    cfg.methods = "ddtree"
  plan = workflow.validate(cfg, baselines=False)
  budget = plan.budgets[0]
  target, drafter = workflow.load_models(cfg)
  prompt = workflow.make_prompts(cfg, target, 1)[0]
  step = workflow.one_step(target, drafter, prompt, budget, attention=cfg.attention or "xla",
                           topk_cap=cfg.topk_cap or None)
  dec = workflow.decoder(target)
  ax = viz.draw_tree(step["tree"], step["path"], target.tokenizer)
  accepted = dec(step["emitted"][:-1]) if step["tau"] > 1 else ""
  ax.set_title(f"{ax.get_title()}\naccepted after the bonus: {accepted!r}", fontsize=9)
  out_path = out_path or os.path.join(cfg.out_dir, f"tree_B{budget}.png")
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  ax.figure.tight_layout()
  files.save_figure(ax.figure, out_path, dpi=120)
  plt.close(ax.figure)
  info = {"budget": budget, "tau": step["tau"], "bonus": step["bonus"],
          "path": step["path"].tolist(), "emitted": step["emitted"].tolist(), "png": out_path}
  print(f"prompt: {dec(prompt)!r}\nbonus (target's next token): {dec([step['bonus']])!r}\n"
        f"accepted path: tau {step['tau']} (root included); committed this step (accepted drafts + "
        f"the next bonus): {dec(step['emitted'])!r}\nwrote {out_path}")
  return info


def main(_):
  print(json.dumps(run(_CONFIG.value)))


if __name__ == "__main__":
  _CONFIG = workflow.define_config("configs/default.py")
  workflow.run_app(main)
