"""Drafter training's throughput at a model shape: the feature capture at regeneration and the
training step, from captured features (offline) and through the target (online).

  python -m experiments.perf.bench_drafter_training --shape=qwen3-8b   # one GPU, random weights
  python -m experiments.perf.bench_drafter_training --smoke            # tiny shapes on CPU

Random weights (the speed of a step does not depend on them; nothing here is a drafter's
quality): a target of the shape, its 5-layer DFlash drafter (harness.drafter_config), random
prompts of --prompt_len tokens. Capture: `training.capture.generate_with_features` on a batch of
--regen_batch prompts, --new_tokens each (the target's AR continuations and the tap features of
every committed token); tokens/s counts prompt and new tokens (the rows it stores), and the
stored bytes per million tokens are the features' at the target's dtype. Training: the jitted
step of `training.losses.drafter_loss` (AdamW, bf16 compute, float32 master weights) on batches
of --train_batch sequences of prompt_len + new_tokens tokens with --anchors blocks each, from
features in memory (offline) or through the frozen target (online); tokens/s counts the drafted
positions (batch x anchors x (block - 1)). Medians of --repeats timed calls after a warm-up.
Prints a table and one JSON line per row.
"""

from __future__ import annotations

import functools

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.checkpoints import hf
from ddtree_jax.request import GenerateOptions
from ddtree_jax.tools import profiling
from ddtree_jax.training import capture, data, loop as train_loop, losses
from experiments.perf import common_flags, harness

common_flags.define("small", "smoke", "shape", "json_out", repeats=3)
flags.DEFINE_integer("prompt_len", 512, "prompt tokens per sequence")
flags.DEFINE_integer("new_tokens", 512, "the target's new tokens per sequence")
flags.DEFINE_integer("regen_batch", 32, "sequences per capture call")
flags.DEFINE_integer("train_batch", 8, "sequences per training step")
flags.DEFINE_integer("anchors", 256, "drafted blocks per sequence per step")
flags.DEFINE_string("dtype", "bfloat16", "the target's weights")
SMOKE = dict(small=True, prompt_len=16, new_tokens=16, regen_batch=2, train_batch=2, anchors=8,
             repeats=1)


def main(_):
  args = common_flags.start(SMOKE)
  cfg = harness.target_config(args.small, args.shape)
  dtype = hf.parse_dtype(args.dtype)
  params = harness.random_target(cfg, jax.random.key(0), dtype=dtype)
  target = hf.Target(params=params, config=cfg, tokenizer=None, path=f"random:{args.shape}",
                     mesh=None, rules=None)
  dcfg = harness.drafter_config(cfg, args.small)
  rng = np.random.default_rng(0)
  print(f"device: {jax.devices()[0].device_kind}; {args.shape}, random {args.dtype} weights; "
        f"drafter {dcfg.layers.num_layers} layers, block {dcfg.block_size}, taps "
        f"{dcfg.target_layer_ids}", flush=True)
  rows = []

  # capture: the target's continuations and their features, as regeneration makes them
  prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist()
             for _ in range(args.regen_batch)]
  options = GenerateOptions(max_new_tokens=args.new_tokens, stop_token_ids=())
  out = {}

  def run_capture():
    out["new"], out["features"] = capture.generate_with_features(
        target, prompts, dcfg.target_layer_ids, options)
    return out["features"][0]
  seconds = profiling.median_seconds(run_capture, repeats=args.repeats)
  stored = sum(f.shape[0] for f in out["features"])
  width = out["features"][0].shape[1]
  per_million = 1e6 * width * jnp.dtype(dtype).itemsize
  common_flags.keep_row(rows, dict(stage="capture", shape=args.shape, batch=args.regen_batch,
                                   seconds=seconds, tokens_per_second=stored / seconds,
                                   feature_width=width, bytes_per_million_tokens=per_million),
                        args.json_out)

  # training: one step on batches of these sequences
  seqs = np.zeros((args.regen_batch, args.prompt_len + args.new_tokens), np.int32)
  lens = np.zeros((args.regen_batch,), np.int32)
  for i, (p, n) in enumerate(zip(prompts, out["new"])):
    s = p + n
    seqs[i, :len(s)], lens[i] = s, len(s)
  plens = np.full((args.regen_batch,), args.prompt_len, np.int32)
  feats = np.zeros(seqs.shape + (width,), out["features"][0].dtype)
  for i, f in enumerate(out["features"]):
    feats[i, :len(f)] = f
  dparams = losses.init_drafter_params(dcfg, jax.random.key(1), 0.02,
                                       final_norm=params.final_norm.astype(jnp.float32))
  tx = train_loop.make_optimizer(1.0, 0.9, 0.95, 0.01)
  b = data.drafter_batch(seqs, lens, plens, args.train_batch, args.anchors, 0, 0)
  chosen = b.pop("rows")
  batch = {k: jnp.asarray(v) for k, v in b.items()}
  drafted = args.train_batch * args.anchors * (dcfg.block_size - 1)
  for mode in ("offline", "online"):
    frozen = params if mode == "online" else params.__class__(
        embed=params.embed, layers=[], final_norm=params.final_norm, lm_head=params.lm_head,
        vocab_size=params.vocab_size)
    bt = dict(batch, features=jnp.asarray(feats[chosen])) if mode == "offline" else batch
    step = train_loop.make_step(functools.partial(
        losses.drafter_loss, dcfg=dcfg, tcfg=cfg, gamma=7.0, compute_dtype=jnp.bfloat16), tx)
    state = {"params": dparams, "opt_state": tx.init(dparams)}

    def run_step():
      nonlocal state
      state, loss, _ = step(state, frozen, bt, 1e-4)
      return loss
    seconds = profiling.median_seconds(run_step, repeats=args.repeats)
    common_flags.keep_row(rows, dict(stage=f"train ({mode})", shape=args.shape,
                                     batch=args.train_batch, seconds=seconds,
                                     tokens_per_second=drafted / seconds), args.json_out)
    dparams = state["params"]

  print(f"\n{'stage':<18}{'batch':>6}{'ms':>10}{'tokens/s':>12}  (random weights)")
  for r in rows:
    print(f"{r['stage']:<18}{r['batch']:>6}{1e3 * r['seconds']:>10.1f}"
          f"{r['tokens_per_second']:>12.0f}")
  print(f"captured features: {rows[0]['feature_width']} values a token, "
        f"{rows[0]['bytes_per_million_tokens'] / 1e9:.1f} GB per million tokens at {args.dtype}")


if __name__ == "__main__":
  from ddtree_jax import engine
  engine.define_compilation_cache_flags(default=False)
  app.run(main)
