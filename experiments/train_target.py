"""Step 2 of `make train`: the default target, a small Qwen3 trained on the stdlib corpus.

  python -m experiments.train_target --config=configs/train_target.py[:smoke]

Trains with ddtree_jax.models.decoder's own forward (ddtree_jax.training.losses), resumes from the latest orbax
checkpoint in `workdir`/target/checkpoints, and exports a Hugging Face Qwen3 directory to
`workdir`/target/hf (loadable by dj.load_target). Also writes `workdir`/target/{metrics.json,
loss.png}. The last line printed is one JSON summary.
"""

import functools
import json
import os
import time

from absl import app
from ml_collections import config_flags

import jax
import jax.numpy as jnp
import numpy as np

import ddtree_jax as dj
from ddtree_jax import engine
from ddtree_jax.checkpoints import hf as checkpoint
from ddtree_jax.training import data
from ddtree_jax.checkpoints import export as hf_export
from ddtree_jax.models import decoder
from ddtree_jax.training import loop as train_loop
from ddtree_jax.training import losses as training
from ddtree_jax.models.config import ModelConfig

_CONFIG = config_flags.DEFINE_config_file("config", "configs/train_target.py", "run configuration")


def model_config(cfg, tokenizer) -> ModelConfig:
  m = cfg.model
  if tokenizer.get_vocab_size() > cfg.data.vocab_size:
    raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens > {cfg.data.vocab_size}")
  return ModelConfig(
      model_type="qwen3", vocab_size=cfg.data.vocab_size, hidden_size=m.hidden_size,
      intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
      num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, rms_norm_eps=m.rms_norm_eps,
      rope_theta=m.rope_theta, qk_norm=True, tie_word_embeddings=m.tie_word_embeddings,
      eos_token_ids=(tokenizer.token_to_id(data.EOS),), max_position_embeddings=m.seq_len)


def heldout_loss_fn(mcfg, windows, batch_size, compute_dtype):
  """params -> held-out metrics over fixed windows."""
  loss = jax.jit(functools.partial(training.target_loss, frozen=None, cfg=mcfg,
                                   compute_dtype=compute_dtype))
  chunks = [{"tokens": jnp.asarray(windows[i:i + batch_size])}
            for i in range(0, len(windows), batch_size)]
  return lambda params: train_loop.batched_eval(lambda b: loss(params, batch=b), chunks)


engine.define_compilation_cache_flags()


def main(_):
  engine.compilation_cache_from_flags()
  cfg = _CONFIG.value
  t0 = time.perf_counter()
  tok, train_tokens, heldout_tokens = data.prepare_corpus(
      cfg.workdir, cfg.data.vocab_size, cfg.data.heldout_fraction, cfg.data.max_files,
      cfg.data.stdlib_root, cfg.data.packages)
  mcfg = model_config(cfg, tok)
  tc = cfg.train
  length = cfg.model.seq_len + 1
  cdt = checkpoint.parse_dtype(tc.compute_dtype)
  params = decoder.init_params(mcfg, jax.random.key(cfg.seed), jnp.float32, cfg.model.init_std)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  print(f"target: {n_params / 1e6:.2f}M params, {len(train_tokens)} train tokens "
        f"({len(train_tokens) / (tc.batch_size * length):.0f} steps/epoch), "
        f"{len(heldout_tokens)} held-out tokens, backend {jax.default_backend()}", flush=True)
  windows = data.eval_windows(heldout_tokens, tc.eval_windows, length)
  eval_fn = heldout_loss_fn(mcfg, windows, tc.batch_size, cdt)
  out = os.path.join(cfg.workdir, "target")
  os.makedirs(out, exist_ok=True)
  params, summary = train_loop.train(
      name="target", workdir=out, params=params,
      loss_fn=functools.partial(training.target_loss, cfg=mcfg, compute_dtype=cdt), frozen=None,
      batch_fn=lambda step: {"tokens": data.window_batch(train_tokens, tc.batch_size, length,
                                                         cfg.seed, step)},
      eval_fn=eval_fn, tc=tc, tokens_per_step=tc.batch_size * cfg.model.seq_len)
  hf = hf_export.save_target_hf(os.path.join(out, "hf"), params, mcfg, tok, cfg.export.dtype)
  # The held-out loss of what ships: reload the export (float32 math) and evaluate it.
  shipped = dj.load_target(hf, dtype="float32")
  final = heldout_loss_fn(mcfg, windows, tc.batch_size, jnp.float32)(shipped.params)
  train_loop.plot_curve(summary, os.path.join(out, "loss.png"), "target (stdlib + dependencies BPE LM)")
  result = {"stage": "target", "params_m": round(n_params / 1e6, 3), "steps": summary["steps"],
            "total_steps": summary["total_steps"], "finished": summary["finished"],
            "final_train_loss": summary["final_train_loss"], "best": summary["best"],
            "exported_heldout_loss": final["loss"], "exported_heldout_accuracy": final["accuracy"],
            "train_seconds": round(summary["train_seconds"], 1),
            "wall_seconds": round(time.perf_counter() - t0, 1), "export": hf}
  train_loop.write_json(os.path.join(out, "metrics.json"), dict(result, history=summary["history"],
                                                              evals=summary["evals"]))
  print(json.dumps(result), flush=True)


if __name__ == "__main__":
  app.run(main)
