"""The OpenAI-compatible server (`make serve`, experiments/serve.py): the bundled pair on CPU by
default, DDTree at one budget chosen at start, greedy or sampled per request.

  python -m experiments.serve --config=configs/serve.py --config.target=/models/Qwen3-8B \
      --config.drafter=/models/Qwen3-8B-DFlash-b16 --config.dtype=bfloat16 --config.serve.budget=32
  python -m experiments.serve --config=configs/serve.py --config.random_target=True \
      --config.random_drafter=True --config.drafter= --config.dtype=bfloat16 \
      --config.serve.tokenizer=ddtree_jax/default_model/target   # random Qwen3-8B shape

The serve.* defaults are `slots.SlotConfig`'s but capacity (fitted to the model) and
prompt_buckets (spelled as a comma list); a request's options are its own (`request.GenerateOptions`, the server's JSON).
"""

import importlib.util
import os

import ml_collections

from ddtree_jax.serving.slots import SlotConfig

_spec = importlib.util.spec_from_file_location(
    "ddtree_config_default", os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py"))
_default = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_default)


def get_config():
  c = _default.get_config()
  s = c.serve = ml_collections.ConfigDict()
  s.host = "127.0.0.1"
  s.port = 8000
  s.model_name = ""                 # "" = the target directory's name (ddtree-jax-default for
                                    # the bundled pair, random-qwen3 for a random target)
  s.tokenizer = ""                  # a directory with tokenizer.json: encodes prompts, decodes
                                    # ids ("" = the target's; a random target has none, e.g.
                                    # ddtree_jax/default_model/target; unknown ids decode to "")
  s.strict_fields = False           # a request body with fields the server does not read: False
                                    # logs them (WARNING) and serves it, True answers it 400
  d = SlotConfig  # (its class attributes: the fields' defaults)
  s.method = d.method if c.drafter else "ar"  # ar | chain | ddtree
  s.budget = str(d.budget)          # DDTree nodes per verify, fixed at start; or "auto": each
                                    # step chooses one of (0 = AR, for the slots decoding then):
  s.auto_budgets = ",".join(map(str, d.budgets))
  s.budget_costs = ""               # their seconds per step ("" = measured at start)
  s.slots = d.slots                 # decode slots (the batch of every decode step)
  s.capacity = 0                    # cache rows per slot: prompt + generated tokens (0: the
                                    # model's positions, at most 4096; buckets below it)
  s.chunk_steps = d.chunk_steps     # decode steps per chunk between two admissions
  s.max_chunk_steps = d.max_chunk_steps  # ... while requests come one at a time
  s.stream_steps = d.stream_steps   # ... while a streaming request decodes (1: each step's
                                    # tokens are sent as the step commits them)
  s.pipeline = d.pipeline           # ... and dispatch the next chunk before streaming the last
                                    # (on a GPU the dispatch waits for the chunk: no overlap)
  s.refill_wait = d.refill_wait     # after a chunk that ended requests, wait up to this fraction
                                    # of its time for new ones while slots are free
  s.prompt_buckets = ",".join(map(str, d.prompt_buckets))  # a prompt is padded to the first
                                    # bucket that fits it (one prefill program per bucket)
  s.max_queue = d.max_queue         # waiting requests; more are answered 429
  s.sampling = d.sampling           # per-request temperature / top_p / top_k / seed; False: a
                                    # greedy-only program (temperature > 0 is a 400)
  s.max_top_k = d.max_top_k         # the largest top_k a request may ask for
  return c
