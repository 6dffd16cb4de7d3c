"""Benchmark: latent attention (MLA) on the Pallas kernel vs XLA's form, one layer, long prefixes.

DeepSeek-V3-architecture attention over a latent cache (kv_lora_rank C = 512 plus the RoPE key
R = 64 per token, one row for every head, bf16): N heads of absorbed queries [B, T, N, C + R]
over a cached prefix plus a tree of T new rows under a random ancestor mask. For each (heads,
prefix, T) cell: the median time per call of `mla.attend_latent` (XLA) and of
`pallas.latent_attention` under each --pallas launch (splits and blocks as KernelTuning), the
latent bytes a call must read, the bandwidth reached, the ratio to the floor at the floors'
bandwidth (`floors.measure`, or --floor_bandwidth given) and at the card's spec bandwidth (x
spec; row keys prefixed by the impl's name), and the max difference of the outputs. Timing as
bench_attention: n calls chained in one jitted fori_loop (harness.fori_seconds).

  python -m experiments.perf.bench_latent           # one H200 (~1 min)
  python -m experiments.perf.bench_latent --smoke   # tiny shapes, interpret mode on CPU
"""

from __future__ import annotations

import warnings

from absl import app, flags
import numpy as np

import jax
import jax.numpy as jnp

from ddtree_jax import engine
from ddtree_jax.models import mla
from ddtree_jax.kernels import Kernels
from experiments.perf import common_flags, floors, harness

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

common_flags.define("smoke", "batch", "round_ms", "rounds", "floor_bandwidth", "json_out")
flags.DEFINE_string("heads", "16,64,128", "query heads N (Moonlight 16, Kimi-K2 64, DeepSeek-V3 128)")
flags.DEFINE_string("prefixes", "4096,8192,16384,32768", "cached latent rows per sequence")
flags.DEFINE_string("tokens", "1,17,65", "new rows T (1 = decode; a tree of T - 1 drafts + root)")
flags.DEFINE_integer("latent", 512, "kv_lora_rank C")
flags.DEFINE_integer("rope", 64, "qk_rope_head_dim R")
flags.DEFINE_string("pallas", "128x64", "comma list of Pallas launches, each SPLIT_ROWSx"
                    "MAX_SPLITS[:BLOCK_QxBLOCK_KxWARPSxSTAGES] (KernelTuning's "
                    "latent_split_rows, latent_max_splits and latent_launch, whose default "
                    "fills in a missing launch), each timed wherever it runs")

SMOKE = dict(heads="4", prefixes="96", tokens="1,5", latent=32, rope=16, round_ms=1.0, rounds=1,
             pallas="32x4,16x8:16x16x4x1")


def main(_):
  a = common_flags.start(SMOKE)
  c, r, b = a.latent, a.rope, a.batch
  scale = (128 + r) ** -0.5
  impls = {"xla": mla.attend_latent}
  for v in a.pallas.split(","):
    impls[f"pallas:{v}"] = Kernels("pallas", tuning=harness.latent_tuning(
        v, True if a.smoke else None)).attend_latent
  rng = np.random.default_rng(0)
  print(f"devices {jax.devices()}  C {c}  R {r}  batch {b}; pallas:SPLIT_ROWSxMAX_SPLITS"
        f"[:BLOCK_QxBLOCK_KxWARPSxSTAGES]")
  bw = floors.measure(a.smoke, a.floor_bandwidth)
  print(bw.describe(), flush=True)
  rows = []
  common_flags.keep_row(rows, bw.row(), a.json_out, echo=False)
  print(f"{'N':>4} {'prefix':>6} {'T':>4} {'MB':>7} {'impl':>28} {'us':>8} {'GB/s':>6} "
        f"{'x floor':>7} {'x spec':>7} {'xla/this':>8} {'max diff':>9}", flush=True)
  for n in harness.ints(a.heads):
    for prefix in harness.ints(a.prefixes):
      for t in harness.ints(a.tokens):
        ks = jax.random.split(jax.random.key(int(rng.integers(2**31))), 3)
        q = jax.random.normal(ks[0], (b, t, n, c + r), jnp.bfloat16)
        cache = jax.random.normal(ks[1], (b, 1, prefix + 64, c + r), jnp.bfloat16)
        new = jax.random.normal(ks[2], (b, t, 1, c + r), jnp.bfloat16)
        lens = jnp.full((b,), prefix, jnp.int32)
        mask = jnp.asarray(harness.random_tree_mask(rng, b, t))
        nbytes = b * (prefix + t) * (c + r) * 2 + 2 * q.nbytes
        row = {"section": "latent", "heads": n, "prefix": prefix, "tokens": t, "batch": b,
               "bytes": nbytes}
        outs = {}
        for name, fn in impls.items():
          def step(q, cache, lens, new, mask, fn=fn):
            out = fn(q, cache, lens, new, mask, scale=scale, value_dim=c)
            return jnp.concatenate([out, q[..., c:]], axis=-1)  # chain the calls through q
          try:
            sec, out = harness.fori_seconds(step, q, (cache, lens, new, mask), a.round_ms,
                                            a.rounds)
            row[f"{name}_us"] = sec * 1e6
            outs[name] = out[..., :c].astype(jnp.float32)
          except Exception as err:  # pylint: disable=broad-except  (a failed lowering is a row)
            row[f"{name}_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        for name in impls:
          us = row.get(f"{name}_us")
          if name in outs and "xla" in outs and name != "xla":
            row[f"{name}_max_diff"] = float(jnp.abs(outs[name] - outs["xla"]).max())
          head = f"{n:>4} {prefix:>6} {t:>4} {nbytes / 1e6:>7.2f} {name:>28}"
          if us is None:
            print(f"{head} {'fails':>8}  [{row[f'{name}_error']}]", flush=True)
            continue
          floors.mark(row, us * 1e-3, nbytes, bw, prefix=f"{name}_")
          ratio = f"{row['xla_us'] / us:>8.2f}" if "xla_us" in row else f"{'':>8}"
          diff = row.get(f"{name}_max_diff")
          print(f"{head} {us:>8.1f} {nbytes / us / 1e3:>6.0f} "
                f"{row[f'{name}_ratio_to_floor']:>7.2f}{floors.x_spec(row, f'{name}_')} {ratio} "
                f"{'' if diff is None else f'{diff:.1e}':>9}{floors.flag(row, f'{name}_')}",
                flush=True)
        common_flags.keep_row(rows, row, a.json_out, echo=False)
  floors.check(rows)


if __name__ == "__main__":
  engine.define_compilation_cache_flags(default=False)
  app.run(main)
