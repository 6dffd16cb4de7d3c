"""The o / down projection + residual add + next RMSNorm of a Qwen3-8B layer, XLA vs the Pallas
epilogue (`pallas.add_rms_norm.residual_norm`) at each split-K count, by row count.

XLA: x + a @ w (its GEMM, split-K chosen by its autotuner, then a sum + add kernel), then the
RMSNorm kernel. Pallas: the GEMM as an explicit batched dot over S slices of the contracted dim
(float32 partials), then one kernel for the sum, the add and the norm. Each step chains the site
over `--copies` distinct weight copies (so no weight stays in L2): x' feeds the next add and the
normed h' the next projection's input (tiled to the contracted dim, the same op for both sides);
the table gives microseconds per site. In the decode step the fused form gained more than this
isolated chain shows (docs/findings/fused-glue-kernels.md): measure changes with
profile_step.py.

  python -m experiments.perf.bench_residual             # H200, ~1 minute
  python -m experiments.perf.bench_residual --smoke     # tiny shapes on CPU
"""

from __future__ import annotations

from absl import app, flags
import jax
import jax.numpy as jnp

from ddtree_jax import engine
from ddtree_jax.models import ops
from ddtree_jax.kernels import KernelTuning
from ddtree_jax.pallas import add_rms_norm as arn
from experiments.perf import common_flags, harness

common_flags.define("smoke", "rounds")
flags.DEFINE_string("rows", "1,16,33,65,130", "token rows")
flags.DEFINE_string("splits", "1,2,4,8,16", "split-K counts")
flags.DEFINE_integer("hidden", 4096, "hidden size")
flags.DEFINE_string("sites", "o:4096,down:12288", "name:contracted dim, comma-separated")
flags.DEFINE_integer("copies", 8, "distinct weight copies chained per step")

SMOKE = dict(hidden=64, copies=2, sites="o:64,down:128", rows="1,5", splits="1,2")


engine.define_compilation_cache_flags()


def main(_):
  args = common_flags.start(SMOKE)
  h, trips = args.hidden, 2 if args.smoke else 100
  rows, splits = harness.ints(args.rows), harness.ints(args.splits)
  rule = KernelTuning().residual_split_count
  dt, eps = jnp.bfloat16, 1e-6
  keys = jax.random.split(jax.random.key(0), 4)
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; us per site "
        "(* = KernelTuning's pick)")
  print(f"{'site':>6} {'rows':>5} {'xla':>8} "
        + " ".join(f"{'S=' + str(s):>8}" for s in splits))
  for site in args.sites.split(","):
    name, c = site.split(":")
    c = int(c)
    ws = [(jax.random.normal(jax.random.fold_in(keys[0], i), (c, h), jnp.float32) * c ** -0.5)
          .astype(dt) for i in range(args.copies)]
    norm = jnp.ones((h,), dt)
    for m in rows:
      x = jax.random.normal(keys[1], (1, m, h), jnp.float32).astype(dt)
      a = jnp.tile(x, (1, 1, c // h))

      def chain(fn):
        def step(carry, *ws):
          x, hn = carry
          for w in ws:
            x, hn = fn(x, "btc,ch->bth", jnp.tile(hn, (1, 1, c // h)), w, norm, eps=eps)
          return x, hn
        return step

      want = ops.residual_norm(x, "btc,ch->bth", a, ws[0], norm, eps=eps)
      row = [harness.fori_seconds(chain(ops.residual_norm), (x, x), tuple(ws), 20.0,
                                  args.rounds, trips)[0] / args.copies * 1e6]
      for s in splits:
        if c % s:
          row.append(float("nan"))
          continue
        fn = lambda *q, s=s, **kw: arn.residual_norm(*q, splits=s, **kw)
        got = fn(x, "btc,ch->bth", a, ws[0], norm, eps=eps)
        err = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w_.astype(jnp.float32))))
                  for g, w_ in zip(got, want))
        if err > 0.1:
          raise ValueError(f"{name} rows {m} S={s}: max abs error {err}")
        row.append(harness.fori_seconds(chain(fn), (x, x), tuple(ws), 20.0, args.rounds,
                                        trips)[0] / args.copies * 1e6)
      pick = rule(m, c)
      cells = " ".join(f"{v:>7.1f}{'*' if s == pick else ' '}" for s, v in zip(splits, row[1:]))
      print(f"{name:>6} {m:>5} {row[0]:>8.1f} {cells}", flush=True)


if __name__ == "__main__":
  app.run(main)
