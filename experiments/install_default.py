"""Step 5 of `make train`: copies the exported pair into the package's default_model folder.

  python -m experiments.install_default --workdir=out/train_default --out=ddtree_jax/default_model

Checks that the pair loads (dj.load_target / dj.load_drafter), that the drafter's mask token is the
tokenizer's <|mask|>, and that everything fits `max_mb`; writes TRAINING.json (final metrics).
"""

import json
import os
import shutil

from absl import app
from absl import flags

import ddtree_jax as dj
from ddtree_jax.training import data

_WORKDIR = flags.DEFINE_string("workdir", "out/train_default", "training workdir")
_OUT = flags.DEFINE_string("out", "ddtree_jax/default_model", "install folder")
_MAX_MB = flags.DEFINE_float("max_mb", 40.0, "size cap of the installed pair (MB = 1e6 bytes)")

FILES = {"target": ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json"),
         "drafter": ("config.json", "model.safetensors")}


def main(_):
  src = {k: os.path.join(_WORKDIR.value, k, "hf") for k in FILES}
  size = sum(os.path.getsize(os.path.join(src[k], f)) for k, fs in FILES.items() for f in fs
             if os.path.exists(os.path.join(src[k], f)))
  if size > _MAX_MB.value * 1e6:
    raise SystemExit(f"the pair is {size / 1e6:.2f} MB > {_MAX_MB.value} MB: export in bfloat16 or "
                     "train a smaller model")
  target = dj.load_target(src["target"], dtype="float32")
  drafter = dj.load_drafter(src["drafter"], target)
  if drafter.config.mask_token_id != target.tokenizer.token_to_id(data.MASK):
    raise SystemExit("the drafter's mask_token_id is not the tokenizer's <|mask|>")
  tmp = _OUT.value.rstrip("/") + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  for k, fs in FILES.items():
    os.makedirs(os.path.join(tmp, k))
    for f in fs:
      if os.path.exists(os.path.join(src[k], f)):
        shutil.copy2(os.path.join(src[k], f), os.path.join(tmp, k, f))
  metrics = {}
  for k in ("target", "drafter"):
    path = os.path.join(_WORKDIR.value, k, "metrics.json")
    if os.path.exists(path):
      with open(path) as f:
        m = json.load(f)
      metrics[k] = {n: v for n, v in m.items() if n not in ("history", "evals", "export")}
  corpus = os.path.join(_WORKDIR.value, "data", "corpus.json")
  if os.path.exists(corpus):
    with open(corpus) as f:
      c = json.load(f)
    metrics["corpus"] = {n: c[n] for n in ("settings", "heldout_files", "train_tokens",
                                           "heldout_tokens", "train_bytes")}
  with open(os.path.join(tmp, "TRAINING.json"), "w") as f:
    json.dump(metrics, f, indent=1)
  shutil.rmtree(_OUT.value, ignore_errors=True)
  os.replace(tmp, _OUT.value)
  print(json.dumps({"stage": "install", "out": _OUT.value, "megabytes": round(size / 1e6, 3),
                    "target_layers": target.config.num_layers,
                    "drafter_layers": drafter.config.layers.num_layers}), flush=True)


if __name__ == "__main__":
  app.run(main)
