"""Benchmark: latent attention (MLA) on the Pallas kernel vs XLA's form, one layer, long prefixes.

DeepSeek-V3-architecture attention over a latent cache (kv_lora_rank C = 512 plus the RoPE key
R = 64 per token, one row for every head, bf16): N heads of absorbed queries [B, T, N, C + R]
over a cached prefix plus a tree of T new rows under a random ancestor mask. For each (heads,
prefix, T) cell: the median time per call of `pallas.latent_attention` (prefix splits by
KernelTuning's rule) and of `mla.attend_latent` (XLA), the latent bytes a call must read, the
bandwidth reached, the ratio to the floor at --floor_bandwidth, and the max difference of the
outputs. Timing as bench_attention: n calls chained in one jitted fori_loop (harness.fori_seconds).

  python -m experiments.perf.bench_latent           # one H200 (~1 min)
  python -m experiments.perf.bench_latent --smoke   # tiny shapes, interpret mode on CPU
"""

from __future__ import annotations

import json
import warnings

from absl import app, flags
import numpy as np

import jax
import jax.numpy as jnp

from ddtree_jax import engine, mla
from ddtree_jax.kernels import KernelTuning, Kernels
from experiments.perf import harness

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

flags.DEFINE_bool("smoke", False, "tiny shapes in interpret mode (CPU)")
flags.DEFINE_string("heads", "16,64,128", "query heads N (Moonlight 16, Kimi-K2 64, DeepSeek-V3 128)")
flags.DEFINE_string("prefixes", "4096,8192,16384,32768", "cached latent rows per sequence")
flags.DEFINE_string("tokens", "1,17,65", "new rows T (1 = decode; a tree of T - 1 drafts + root)")
flags.DEFINE_integer("batch", 1, "sequences")
flags.DEFINE_integer("latent", 512, "kv_lora_rank C")
flags.DEFINE_integer("rope", 64, "qk_rope_head_dim R")
flags.DEFINE_float("round_ms", 10.0, "target length of one timed round")
flags.DEFINE_integer("rounds", 5, "timed rounds (median)")
flags.DEFINE_float("floor_bandwidth", 4.3e12, "bytes per second of the floor")
flags.DEFINE_string("json_out", "", "append each row here as a JSON line")
FLAGS = flags.FLAGS

SMOKE = dict(heads="4", prefixes="96", tokens="1,5", latent=32, rope=16, round_ms=1.0, rounds=1)


def main(_):
  engine.compilation_cache_from_flags()
  a = harness.settings(FLAGS, SMOKE)
  c, r, b = a.latent, a.rope, a.batch
  scale = (128 + r) ** -0.5
  impls = {"pallas": Kernels("pallas", tuning=KernelTuning(latent_pallas=True,
                                                            interpret=True if a.smoke else None)).attend_latent,
           "xla": mla.attend_latent}
  rng = np.random.default_rng(0)
  print(f"devices {jax.devices()}  C {c}  R {r}  batch {b}")
  print(f"{'N':>4} {'prefix':>6} {'T':>4} {'MB':>7} | {'pallas us':>9} {'GB/s':>6} {'x floor':>7} | "
        f"{'xla us':>8} {'GB/s':>6} {'x floor':>7} | {'xla/pallas':>10} {'max diff':>9}", flush=True)
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
        row = {"heads": n, "prefix": prefix, "tokens": t, "batch": b, "bytes": nbytes}
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
        if len(outs) == 2:
          row["max_diff"] = float(jnp.abs(outs["pallas"] - outs["xla"]).max())
        cells = []
        for name in impls:
          us = row.get(f"{name}_us")
          cells.append(f"{us:>{9 if name == 'pallas' else 8}.1f} {nbytes / us / 1e3:>6.0f} "
                       f"{us * 1e-6 * a.floor_bandwidth / nbytes:>7.2f}" if us else
                       f"{'n/a':>{9 if name == 'pallas' else 8}} {'':>6} {'':>7}")
        ratio = (f"{row['xla_us'] / row['pallas_us']:>10.2f}" if len(outs) == 2 else f"{'':>10}")
        diff = f"{row['max_diff']:>9.1e}" if "max_diff" in row else f"{'':>9}"
        print(f"{n:>4} {prefix:>6} {t:>4} {nbytes / 1e6:>7.2f} | {cells[0]} | {cells[1]} | "
              f"{ratio} {diff}", flush=True)
        for name in impls:
          if f"{name}_error" in row:
            print(f"  [{name}: {row[f'{name}_error']}]", flush=True)
        if a.json_out:
          with open(a.json_out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  engine.define_compilation_cache_flags(default=False)
  app.run(main)
