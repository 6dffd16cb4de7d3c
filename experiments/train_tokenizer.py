"""Step 1 of `make train`: byte-level BPE tokenizer + token caches of the corpus (the stdlib and
the project's dependencies' sources, ddtree_jax/training/data.py).

  python -m experiments.train_tokenizer --config=configs/train_target.py[:smoke]

Writes `workdir`/tokenizer.json and `workdir`/data/{train,heldout}.npy, corpus.json (idempotent).
"""

import time

from absl import app
from ml_collections import config_flags

from ddtree_jax.training import data

_CONFIG = config_flags.DEFINE_config_file("config", "configs/train_target.py", "run configuration")


def main(_):
  cfg = _CONFIG.value
  t0 = time.perf_counter()
  tok, train, heldout = data.prepare_corpus(cfg.workdir, cfg.data.vocab_size,
                                            cfg.data.heldout_fraction, cfg.data.max_files,
                                            cfg.data.stdlib_root, cfg.data.packages)
  print(f"tokenizer: vocab {tok.get_vocab_size()}, eos {tok.token_to_id(data.EOS)}, "
        f"mask {tok.token_to_id(data.MASK)}; tokens: train {len(train)}, held-out {len(heldout)} "
        f"({time.perf_counter() - t0:.1f} s) -> {cfg.workdir}", flush=True)


if __name__ == "__main__":
  app.run(main)
