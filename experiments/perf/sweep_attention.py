"""Sweep of the Pallas tree-attention launch parameters against the default rule, one layer.

For every (batch, prefix, T) cell: the time of the kernel with the rule's parameters, the
time with every (block_rows, num_splits) of the grid, and the best of them. This is what the
split-K / block rule in ddtree_jax/pallas/tree_attention.py is fitted to. Same cells and timing as
bench_attention.py (n calls in one jitted fori_loop, median of rounds); a cell's programs are
compiled in threads first. The cache capacity is prefix + --capacity_slack, as in the engine.

  python -m experiments.perf.sweep_attention            # H200 (a few minutes)
  python -m experiments.perf.sweep_attention --smoke    # tiny shapes, interpret mode on CPU
"""

from __future__ import annotations

import concurrent.futures
import json
import statistics
import time

from absl import app, flags
import numpy as np

import jax
from jax import lax

from ddtree_jax.pallas.tree_attention import attention_config, tree_attention
from ddtree_jax import engine
from experiments.perf import common_flags, harness

common_flags.define("smoke", "json_out", round_ms=5.0, rounds=3)
flags.DEFINE_string("prefixes", "1024,8192", "prefix lengths")
flags.DEFINE_string("tokens", "17,33,65,129,257", "tree tokens T")
flags.DEFINE_string("batches", "1,8", "batch sizes")
flags.DEFINE_string("block_rows", "64,128", "query rows per program of the grid")
flags.DEFINE_string("splits", "1,2,4,8,16,32", "split-K counts of the grid")
flags.DEFINE_string("block_ks", "", "also sweep the prefix keys per loop step (default: the "
                    "rule's, by rows)")
flags.DEFINE_integer("capacity_slack", 256, "cache capacity = prefix + slack")
flags.DEFINE_integer("threads", 16, "programs of a cell compiled concurrently")

SMOKE = dict(prefixes="64", tokens="4,9", batches="1", block_rows="16", splits="1,2",
             round_ms=1.0, rounds=1)


engine.define_compilation_cache_flags()


def main(_):
  args = common_flags.start(SMOKE)
  block_rows, splits, block_ks = (harness.ints(x) for x in (args.block_rows, args.splits,
                                                             args.block_ks))
  interpret = jax.default_backend() == "cpu"
  hq, hkv, d = (4, 2, 64) if args.smoke else (32, 8, 128)
  scale = d ** -0.5
  rng = np.random.default_rng(0)
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, Hq={hq} Hkv={hkv} D={d}, "
        f"capacity = prefix + {args.capacity_slack}")
  header = (f"{'B':>2} {'prefix':>6} {'T':>4} | {'default us':>10} {'(splits,rows[,bk])':>17} | "
            f"{'best us':>8} {'(splits,rows[,bk])':>17} {'default/best':>12}")
  print(header + "\n" + "-" * len(header))
  t_start = time.perf_counter()
  pool = concurrent.futures.ThreadPoolExecutor(args.threads)
  for b in harness.ints(args.batches):
    for prefix in harness.ints(args.prefixes):
      for t in harness.ints(args.tokens):
        q, *consts = harness.attention_inputs(rng, b, prefix, t, hq, hkv, d, args.capacity_slack)
        cfg = attention_config(q.shape, consts[0].shape)
        gp = 1 << (hq // hkv - 1).bit_length()
        # a grid point: (splits, rows) or, with --block_ks, (splits, rows, block_k)
        default = (cfg["num_splits"], cfg["block_t"] * gp) + ((cfg["block_k"],) * bool(block_ks))
        grid = [default] + [(s, r, *k) for r in block_rows for s in splits
                            for k in ([(k,) for k in block_ks] or [()])
                            if (s, r, *k) != default]

        def attend(qc, *c, sr):
          return tree_attention(qc, *c, scale=scale, interpret=interpret, num_splits=sr[0],
                                block_rows=sr[1], block_k=sr[2] if len(sr) > 2 else None)

        sec, _ = harness.fori_seconds(lambda qc, *c: attend(qc, *c, sr=default), q,
                              consts, args.round_ms, 1)
        n = int(min(max(args.round_ms * 1e-3 / sec, 3), 2000))

        def compiled(sr):
          fn = lambda qc, *c: lax.fori_loop(0, n, lambda i, x: attend(x, *c, sr=sr), qc)
          return jax.jit(fn).lower(q, *consts).compile()

        programs = list(pool.map(compiled, grid))
        times = {}
        for sr, prog in zip(grid, programs):
          jax.block_until_ready(prog(q, *consts))
          reps = []
          for _ in range(args.rounds):
            t0 = time.perf_counter()
            jax.block_until_ready(prog(q, *consts))
            reps.append((time.perf_counter() - t0) / n)
          times[sr] = statistics.median(reps)
        best = min(times, key=times.get)
        print(f"{b:>2} {prefix:>6} {t:>4} | {times[default] * 1e6:>10.1f} {str(default):>17} | "
              f"{times[best] * 1e6:>8.1f} {str(best):>17} {times[default] / times[best]:>12.2f}",
              flush=True)
        if args.json_out:
          with open(args.json_out, "a") as f:
            f.write(json.dumps(dict(batch=b, prefix=prefix, tokens=t, default=default,
                                    times_us={",".join(map(str, sr)): v * 1e6
                                              for sr, v in times.items()}))
                    + "\n")
  print(f"total wall time {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
  app.run(main)
