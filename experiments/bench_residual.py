"""The o / down projection + residual add + next RMSNorm of a Qwen3-8B layer, XLA vs the Pallas
epilogue (`pallas.add_rms_norm.residual_norm`) at each split-K count, by row count.

XLA: x + a @ w (its GEMM, split-K chosen by its autotuner, then a sum + add kernel), then the
RMSNorm kernel. Pallas: the GEMM as an explicit batched dot over S slices of the contracted dim
(float32 partials), then one kernel for the sum, the add and the norm. Each step chains the site
over `--copies` distinct weight copies (so no weight stays in L2): x' feeds the next add and the
normed h' the next projection's input (tiled to the contracted dim, the same op for both sides);
the table gives microseconds per site. In the decode step the fused form gained more than this
isolated chain shows (WORKSPACE.md, fourteenth session): measure changes with profile_step.py.

  python experiments/bench_residual.py                    # H200, ~1 minute
  python experiments/bench_residual.py --smoke            # tiny shapes on CPU
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import bench_attention as ba
from ddtree_jax import model
from ddtree_jax.pallas import add_rms_norm as arn


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--rows", type=ba._ints, default=[1, 16, 33, 65, 130])
  p.add_argument("--splits", type=ba._ints, default=[1, 2, 4, 8, 16])
  p.add_argument("--hidden", type=int, default=4096)
  p.add_argument("--sites", default="o:4096,down:12288", help="name:contracted dim")
  p.add_argument("--copies", type=int, default=8)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--smoke", action="store_true")
  args = p.parse_args(argv)
  h, trips = args.hidden, 100
  if args.smoke:
    h, trips, args.copies = 64, 2, 2
    args.sites, args.rows, args.splits = "o:64,down:128", [1, 5], [1, 2]
  dt, eps = jnp.bfloat16, 1e-6
  keys = jax.random.split(jax.random.key(0), 4)
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; us per site "
        "(* = default_splits' pick)")
  print(f"{'site':>6} {'rows':>5} {'xla':>8} "
        + " ".join(f"{'S=' + str(s):>8}" for s in args.splits))
  for site in args.sites.split(","):
    name, c = site.split(":")
    c = int(c)
    ws = [(jax.random.normal(jax.random.fold_in(keys[0], i), (c, h), jnp.float32) * c ** -0.5)
          .astype(dt) for i in range(args.copies)]
    norm = jnp.ones((h,), dt)
    for m in args.rows:
      x = jax.random.normal(keys[1], (1, m, h), jnp.float32).astype(dt)
      a = jnp.tile(x, (1, 1, c // h))

      def chain(fn):
        def step(carry, *ws):
          x, hn = carry
          for w in ws:
            x, hn = fn(x, "btc,ch->bth", jnp.tile(hn, (1, 1, c // h)), w, norm, eps=eps)
          return x, hn
        return step

      want = model.residual_norm(x, "btc,ch->bth", a, ws[0], norm, eps=eps)
      row = [ba.time_loop(chain(model.residual_norm), (x, x), tuple(ws), 20.0, args.rounds,
                          trips)[0] / args.copies * 1e6]
      for s in args.splits:
        if c % s:
          row.append(float("nan"))
          continue
        fn = lambda *q, s=s, **kw: arn.residual_norm(*q, splits=s, **kw)
        got = fn(x, "btc,ch->bth", a, ws[0], norm, eps=eps)
        err = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w_.astype(jnp.float32))))
                  for g, w_ in zip(got, want))
        if err > 0.1:
          raise ValueError(f"{name} rows {m} S={s}: max abs error {err}")
        row.append(ba.time_loop(chain(fn), (x, x), tuple(ws), 20.0, args.rounds, trips)[0]
                   / args.copies * 1e6)
      rule = arn.default_splits(m, c)
      cells = " ".join(f"{v:>7.1f}{'*' if s == rule else ' '}"
                       for s, v in zip(args.splits, row[1:]))
      print(f"{name:>6} {m:>5} {row[0]:>8.1f} {cells}", flush=True)


if __name__ == "__main__":
  main()
