"""Sweep of the Pallas tree-attention launch parameters against the default rule, one layer.

For every (batch, prefix, T) cell: the time of the kernel with `default_config`'s parameters, the
time with every (block_rows, num_splits) of the grid, and the best of them. This is what the
split-K / block rule in ddtree_jax/pallas/tree_attention.py is fitted to. Same cells and timing as
bench_attention.py (n calls in one jitted fori_loop, median of rounds); a cell's programs are
compiled in threads first. The cache capacity is prefix + --capacity_slack, as in the engine.

  python experiments/sweep_attention.py                       # H200 (a few minutes)
  python experiments/sweep_attention.py --smoke               # tiny shapes, interpret mode on CPU
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import time

import numpy as np

import jax
from jax import lax

import bench_attention as ba
from ddtree_jax.pallas import attention_config, tree_attention


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--prefixes", type=ba._ints, default=[1024, 8192])
  p.add_argument("--tokens", type=ba._ints, default=[17, 33, 65, 129, 257])
  p.add_argument("--batches", type=ba._ints, default=[1, 8])
  p.add_argument("--block_rows", type=ba._ints, default=[64, 128])
  p.add_argument("--splits", type=ba._ints, default=[1, 2, 4, 8, 16, 32])
  p.add_argument("--block_ks", type=ba._ints, default=[],
                 help="also sweep the prefix keys per loop step (default: the rule's, by rows)")
  p.add_argument("--capacity_slack", type=int, default=256)
  p.add_argument("--round_ms", type=float, default=5.0)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--threads", type=int, default=16)
  p.add_argument("--json_out", default="")
  p.add_argument("--smoke", action="store_true")
  args = p.parse_args(argv)
  if args.smoke:
    args.prefixes, args.tokens, args.batches = [64], [4, 9], [1]
    args.block_rows, args.splits, args.round_ms, args.rounds = [16], [1, 2], 1.0, 1
  return args


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
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
  for b in args.batches:
    for prefix in args.prefixes:
      for t in args.tokens:
        q, *consts = ba.make_cell(rng, b, prefix, t, hq, hkv, d, args.capacity_slack)
        cfg = attention_config(q.shape, consts[0].shape)
        gp = 1 << (hq // hkv - 1).bit_length()
        # a grid point: (splits, rows) or, with --block_ks, (splits, rows, block_k)
        default = (cfg["num_splits"], cfg["block_t"] * gp) + ((cfg["block_k"],) * bool(args.block_ks))
        grid = [default] + [(s, r, *k) for r in args.block_rows for s in args.splits
                            for k in ([(k,) for k in args.block_ks] or [()])
                            if (s, r, *k) != default]

        def attend(qc, *c, sr):
          return tree_attention(qc, *c, scale=scale, interpret=interpret, num_splits=sr[0],
                                block_rows=sr[1], block_k=sr[2] if len(sr) > 2 else None)

        sec, _ = ba.time_loop(lambda qc, *c: attend(qc, *c, sr=default), q,
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
  main()
