"""The OpenAI-compatible server: `/v1/completions`, `/v1/chat/completions` (streaming or not),
`/v1/models`, `/health`, `/metrics`, over decode slots with continuous batching.

  make serve                                                   # the bundled pair on CPU
  python -m experiments.serve --config=configs/serve.py --config.target=... --config.drafter=...

Loads the pair, compiles every program (or reads them from JAX's persistent compilation cache:
a restart with the same shapes is ready in seconds), prints one "ready" line with the URL and
the warm-up seconds, then serves until interrupted.
"""

import os
import threading
import time

from absl import app, logging
import uvicorn

from experiments import workflow
from ddtree_jax import engine, server, slots

_CONFIG = workflow.define_config("configs/serve.py")  # (also the compilation cache flags)


def main(_):
  t0 = time.perf_counter()
  cache_dir = engine.compilation_cache_from_flags()
  cfg = _CONFIG.value
  s = cfg.serve
  try:
    slot_cfg = slots.SlotConfig(
        method=s.method, budget=s.budget, slots=s.slots, capacity=s.capacity,
        chunk_steps=s.chunk_steps, max_queue=s.max_queue, attention=cfg.attention or None,
        sampling=bool(s.sampling), max_top_k=s.max_top_k,
        prompt_buckets=tuple(int(b) for b in str(s.prompt_buckets).split(",") if b))
  except ValueError as e:
    raise app.UsageError(f"--config.serve: {e}") from None
  target, drafter = workflow.load_models(cfg)
  eng = slots.SlotEngine(target, drafter, slot_cfg)
  warm = eng.warm_up()
  eng.start()
  name = s.model_name or os.path.basename(os.path.normpath(cfg.target))
  template, special = server.load_chat_template(None if cfg.random_target else cfg.target)
  api = server.make_app(eng, target.tokenizer, name, template, special)
  srv = uvicorn.Server(uvicorn.Config(api, host=s.host, port=s.port, log_level="warning"))
  thread = threading.Thread(target=srv.run, name="http", daemon=True)
  thread.start()
  while not srv.started and thread.is_alive():
    time.sleep(0.05)
  if not srv.started:
    eng.stop()
    raise app.UsageError(f"the server did not start on {s.host}:{s.port} (see the log above)")
  print(f"ready: http://{s.host}:{s.port}/v1 model {name!r}, {slot_cfg.method}"
        + (f" B={slot_cfg.budget}" if slot_cfg.method == "ddtree" else "")
        + f", {slot_cfg.slots} slots x {slot_cfg.capacity} tokens; programs ready in "
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
  app.run(main)
