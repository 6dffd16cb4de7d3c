"""The OpenAI-compatible server: `/v1/completions`, `/v1/chat/completions` (streaming or not),
`/v1/models`, `/health`, `/metrics`, over decode slots with continuous batching.

  make serve                                                   # the bundled pair on CPU
  python -m experiments.serve --config=configs/serve.py --config.target=... --config.drafter=...
  python -m experiments.serve --config=configs/serve.py --config.random_target=True \
      --config.random_drafter=True --config.drafter= --config.dtype=bfloat16 \
      --config.serve.tokenizer=ddtree_jax/default_model/target   # Qwen3-8B's shape, random

Loads the pair, compiles every program (or reads them from JAX's persistent compilation cache:
a restart with the same shapes is ready in seconds), prints one "ready" line with the URL and
the warm-up seconds, then serves until interrupted. A random target has no tokenizer:
serve.tokenizer names a directory whose tokenizer.json (and tokenizer_config.json's chat
template) encodes text prompts and decodes the ids it knows.
"""

import os
import threading
import time

from absl import app, flags, logging
import uvicorn

import ddtree_jax as dj
from experiments import workflow
from ddtree_jax import chat, engine
from ddtree_jax.checkpoints import hf as checkpoint
from ddtree_jax.serving import server
from ddtree_jax.serving import slots


MAX_DEFAULT_CAPACITY = 4096  # serve.capacity 0: the model's positions, at most this many


def slot_config(cfg, max_positions: int | None = None) -> slots.SlotConfig:
  """The SlotConfig of cfg.serve (ValueError naming the field for a bad value). serve.capacity 0
  fits the model: its `max_positions` (at most MAX_DEFAULT_CAPACITY), with the prompt buckets
  below it."""
  s = cfg.serve
  capacity = s.capacity or min(max_positions or MAX_DEFAULT_CAPACITY, MAX_DEFAULT_CAPACITY)
  try:
    buckets = tuple(int(b) for b in str(s.prompt_buckets).split(",") if b)
  except ValueError:
    raise ValueError(f"SlotConfig.prompt_buckets must be comma-separated integers, got "
                     f"{s.prompt_buckets!r}") from None
  auto = str(s.budget) == "auto"
  try:
    budget = "auto" if auto else int(s.budget)
    budgets = tuple(int(b) for b in str(s.auto_budgets).split(",") if b)
    costs = tuple(float(c) for c in str(s.budget_costs).split(",") if c) or None
  except ValueError:
    raise ValueError(f"SlotConfig.budget must be an integer or 'auto', budgets integers and "
                     f"budget_costs numbers (comma lists), got {s.budget!r}, "
                     f"{s.auto_budgets!r}, {s.budget_costs!r}") from None
  if not s.capacity:  # a bucket as long as the whole cache leaves no room to generate
    buckets = tuple(b for b in buckets if b < capacity) or (capacity // 2,)
  return slots.SlotConfig(
      method=s.method, budget=budget, budgets=budgets, budget_costs=costs if auto else None,
      slots=s.slots, capacity=capacity,
      chunk_steps=s.chunk_steps, max_chunk_steps=s.max_chunk_steps,
      stream_steps=s.stream_steps, pipeline=s.pipeline,
      refill_wait=s.refill_wait, max_queue=s.max_queue, attention=cfg.attention or None,
      sampling=s.sampling, max_top_k=s.max_top_k, prompt_buckets=buckets)


def tokenizer_dir(cfg) -> str | None:
  """Where the server's tokenizer and chat template come from: serve.tokenizer, else the target's
  directory (None for a random target: token-id prompts only)."""
  if cfg.serve.tokenizer:
    if not os.path.exists(os.path.join(cfg.serve.tokenizer, "tokenizer.json")):
      raise workflow.ConfigError(f"serve.tokenizer {cfg.serve.tokenizer!r} has no "
                                 "tokenizer.json")
    return cfg.serve.tokenizer
  return None if cfg.random_target else cfg.target


def model_name(cfg) -> str:
  """The model's id when serve.model_name is unset: the bundled pair's name, random-<type> for
  a random target, else the checkpoint folder's name."""
  if cfg.random_target:
    return f"random-{cfg.shape.model_type}"
  if os.path.realpath(cfg.target) == os.path.realpath(os.path.join(dj.DEFAULT_MODEL_DIR,
                                                                   "target")):
    return BUNDLED_NAME
  return os.path.basename(os.path.normpath(cfg.target))


BUNDLED_NAME = "ddtree-jax-default"  # the bundled pair's model id


def build(cfg):
  """(engine warmed up but not started, FastAPI app, model name, warm-up seconds) for cfg."""
  slot_config(cfg)  # bad serve settings are named before the models load
  tok_dir = tokenizer_dir(cfg)
  if cfg.random_target and cfg.drafter:
    raise workflow.ConfigError(f"drafter {cfg.drafter!r} is a checkpoint's, random_target is set: "
                               "use --config.drafter= with --config.random_drafter=True (or "
                               "--config.serve.method=ar)")
  if cfg.drafter and cfg.random_drafter:
    raise workflow.ConfigError(f"both drafter={cfg.drafter!r} and random_drafter=True are set")
  target, drafter = workflow.load_models(cfg)
  tokenizer = checkpoint.load_tokenizer(tok_dir) if tok_dir else None
  eng = slots.SlotEngine(target, drafter,
                         slot_config(cfg, target.config.max_position_embeddings))
  warm = eng.warm_up()
  name = cfg.serve.model_name or model_name(cfg)
  template, special = chat.load_chat_template(tok_dir)
  api = server.make_app(eng, tokenizer, name, template, special,
                        strict_fields=cfg.serve.strict_fields)
  return eng, api, name, warm


def main(_):
  t0 = time.perf_counter()
  cache_dir = engine.compilation_cache_from_flags()
  cfg = flags.FLAGS.config
  s = cfg.serve
  try:
    eng, api, name, warm = build(cfg)
  except ValueError as e:  # SlotConfig's errors and workflow.ConfigError
    raise app.UsageError(f"--config.serve: {e}" if "SlotConfig" in str(e) else str(e)) from None
  eng.start()
  srv = uvicorn.Server(uvicorn.Config(api, host=s.host, port=s.port, log_level="warning"))
  thread = threading.Thread(target=srv.run, name="http", daemon=True)
  thread.start()
  while not srv.started and thread.is_alive():
    time.sleep(0.05)
  if not srv.started:
    eng.stop()
    raise app.UsageError(f"the server did not start on {s.host}:{s.port} (see the log above)")
  c = eng.config
  print(f"ready: http://{s.host}:{s.port}/v1 model {name!r}, {c.method}"
        + (f" B={c.budget}" if c.method == "ddtree" else "")
        + f", {c.slots} slots x {c.capacity} tokens, chunks of {c.chunk_steps}-"
        f"{c.max_chunk_steps} steps{' pipelined' if c.pipeline else ''}; programs ready in "
        f"{warm:.1f} s (compilation cache {cache_dir or 'off'}), started in "
        f"{time.perf_counter() - t0:.1f} s", flush=True)
  try:
    while thread.is_alive():
      thread.join(0.5)
  except KeyboardInterrupt:
    srv.should_exit = True
    thread.join(10)
  finally:
    eng.stop()
    logging.info("stopped")


if __name__ == "__main__":
  workflow.define_config("configs/serve.py")  # (also the compilation cache flags)
  app.run(main)
