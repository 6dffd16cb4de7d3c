"""A request's prefill in the slot engine by prompt bucket: the bundled pair, float32, DDTree B=16,
1 slot x 512; the prompt "def fib(n):" (6 tokens) padded to 64 or to 16; the median of 20
prefills (+ insert), each read back; then in-process `generate`'s prefill of the same prompt
(padded to 16).

  python -m experiments.perf.bench_prefill_buckets
"""

import statistics
import time

import numpy as np

import ddtree_jax as dj
from ddtree_jax import engine
from ddtree_jax.request import GenerateOptions
from ddtree_jax.serving import programs as slot_programs
from ddtree_jax.serving import slots


def median_ms(fn, n=20):
  fn()
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return round(1e3 * statistics.median(times), 2)


def main():
  engine.enable_compilation_cache(engine.DEFAULT_CACHE_DIR)
  target, drafter = dj.load_default(dtype="float32")
  ids = target.tokenizer.encode("def fib(n):").ids
  for buckets in ((64, 256), (16, 64, 256)):
    eng = slots.SlotEngine(target, drafter, slots.SlotConfig(
        method="ddtree", budget=16, slots=1, capacity=512, prompt_buckets=buckets))
    eng.warm_up()
    options = GenerateOptions(max_new_tokens=64, stop_token_ids=())

    def prefill_and_insert(eng=eng, options=options):
      one = eng._prefill(ids, options)  # pylint: disable=protected-access
      eng.state = slot_programs.insert(eng.state, one, 0)
      return np.asarray(one.bonus)
    print(f"buckets {buckets}: prefill + insert {median_ms(prefill_and_insert)} ms")
  kw = dict(method="ddtree", drafter=drafter, budget=16, max_new_tokens=64, stop_token_ids=(),
            cache_capacity=512)
  dj.generate(target, [ids], **kw)
  stats = dj.generate(target, [ids], **kw).stats
  print(f"generate: prefill {1e3 * stats['prefill_seconds']:.2f} ms, decode "
        f"{1e3 * stats['decode_seconds']:.2f} ms for 64 tokens")


if __name__ == "__main__":
  main()
