"""Benchmark: Pallas tree attention vs attend_xla vs jax.nn.dot_product_attention (one layer).

Qwen3-8B-shaped attention (Hq=32, Hkv=8, D=128, bf16) over a cached prefix plus a tree of T new
tokens with a random ancestor mask. For every (batch, prefix, T) cell it prints the median time per
call, the bytes of K/V that must be read (valid prefix K+V plus new K/V), the achieved bandwidth,
the Pallas time over the floor of those bytes ('x floor': at the floors' bandwidth,
`floors.measure`, or --floor_bandwidth given; 'x spec': at the card's spec bandwidth), and the
same attention through attend_xla and through jax.nn.dot_product_attention (dense [T, S+T] mask;
'xla' and 'cudnn').

Timing: each implementation runs n times (n static, sized so a round takes ~10 ms) inside one
jitted lax.fori_loop whose carry is the query (q <- output), so calls are serialised on the device,
nothing can be hoisted, and there is no per-call host dispatch (as inside the engine's on-device
loop). The time is the median over rounds, divided by n.
The dense baselines get their inputs pre-arranged outside the loop ([B, S+T, Hkv, D] keys, a dense
mask): the time is the attention alone, a best case for them. The 'err' column is the max abs
difference of the Pallas output vs attend_xla after one call ('n/a' without xla). A Pallas time
under its floor ('< floor!') fails the run (`floors.check`).

  python -m experiments.perf.bench_attention          # full grid on a GPU (a few minutes, H200)
  python -m experiments.perf.bench_attention --smoke  # tiny shapes, interpret mode on CPU
"""

from __future__ import annotations

import statistics
import time
import warnings

from absl import app, flags
import numpy as np

import jax
import jax.numpy as jnp

from ddtree_jax.models.attention import attend_xla
from ddtree_jax.pallas.tree_attention import attention_config, tree_attention
from ddtree_jax import engine
from experiments.perf import common_flags, floors, harness

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

common_flags.define("smoke", "round_ms", "rounds", "floor_bandwidth")
flags.DEFINE_string("prefixes", "1024,4096,16384,32768", "prefix lengths")
flags.DEFINE_string("tokens", "16,32,64,128,256", "tree tokens T")
flags.DEFINE_string("batches", "1,8", "batch sizes")
flags.DEFINE_integer("hq", 32, "query heads")
flags.DEFINE_integer("hkv", 8, "kv heads")
flags.DEFINE_integer("head_dim", 128, "head dim")
flags.DEFINE_integer("capacity_slack", 0, "cache capacity S = prefix + slack (attend_xla and "
                     "the dense baselines pay for S, Pallas not)")
flags.DEFINE_string("impls", "pallas,xla,dpa_xla,dpa_cudnn", "implementations timed")
flags.DEFINE_integer("block_k", None, "tree_attention launch parameter (default: the rule's)")
flags.DEFINE_integer("block_rows", None, "tree_attention launch parameter")
flags.DEFINE_integer("num_splits", None, "tree_attention launch parameter")
flags.DEFINE_integer("num_warps", None, "tree_attention launch parameter")
flags.DEFINE_integer("num_stages", None, "tree_attention launch parameter")

SMOKE = dict(prefixes="64", tokens="4", batches="1", hq=4, hkv=2, head_dim=64, rounds=2,
             round_ms=1.0, impls="pallas,xla,dpa_xla")


def dense_inputs(k_cache, v_cache, prefix_len, k_new, v_new, mask):
  """Keys/values [B, S+T, Hkv, D] and a dense [B, 1, T, S+T] mask for dot_product_attention."""
  s, t = k_cache.shape[2], k_new.shape[1]
  k_all = jnp.concatenate([k_cache.transpose(0, 2, 1, 3), k_new], axis=1)
  v_all = jnp.concatenate([v_cache.transpose(0, 2, 1, 3), v_new], axis=1)
  pre = jnp.arange(s)[None, None, :] < prefix_len[:, None, None]          # [B, 1, S]
  full = jnp.concatenate([jnp.broadcast_to(pre, (pre.shape[0], t, s)), mask], axis=-1)
  return k_all, v_all, full[:, None]


def fmt(x, spec):
  """format(x, spec), or 'n/a' right-aligned to the same width."""
  if x is None:
    width = spec.split(".")[0]
    return format("n/a", ">" + width) if width.isdigit() else "n/a"
  return format(x, spec)


engine.define_compilation_cache_flags()


def main(_):
  args = common_flags.start(SMOKE)
  impls = args.impls.split(",")
  interpret = jax.default_backend() == "cpu"
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"interpret={interpret}")
  t_start = time.perf_counter()
  bw = floors.measure(args.smoke, args.floor_bandwidth)
  print(bw.describe())
  d, hq, hkv = args.head_dim, args.hq, args.hkv
  scale = d ** -0.5
  kw = dict(block_k=args.block_k, block_rows=args.block_rows, num_splits=args.num_splits,
            num_warps=args.num_warps, num_stages=args.num_stages)
  rng = np.random.default_rng(0)

  header = (f"{'B':>2} {'prefix':>6} {'T':>4} {'KV MB':>7} | {'pallas us':>9} {'GB/s':>6} "
            f"{'x floor':>7} {'x spec':>6} | {'xla us':>8} {'x/pal':>5} | {'dpa_xla':>8} "
            f"{'x/pal':>5} | {'cudnn us':>8} {'x/pal':>5} | {'err':>7} | splits,bt,bk")
  print(header)
  print("-" * len(header))
  rows = []
  for b in harness.ints(args.batches):
    for prefix in harness.ints(args.prefixes):
      for t in harness.ints(args.tokens):
        cell = harness.attention_inputs(rng, b, prefix, t, hq, hkv, d, args.capacity_slack)
        q, k_cache, v_cache, prefix_len, k_new, v_new, mask = cell
        kv_bytes = b * hkv * (prefix + t) * d * 2 * q.dtype.itemsize
        res, outs = {}, {}

        def pallas_step(qc, *c):
          return tree_attention(qc, *c, scale=scale, interpret=interpret, **kw)

        def xla_step(qc, *c):
          return attend_xla(qc, *c, scale=scale)

        consts = (k_cache, v_cache, prefix_len, k_new, v_new, mask)
        steps = {"pallas": (pallas_step, consts), "xla": (xla_step, consts)}
        if any(i.startswith("dpa") for i in impls):
          dense = jax.jit(dense_inputs)(*consts)
          for impl in ("xla", "cudnn"):
            steps[f"dpa_{impl}"] = (
                lambda qc, k, v, m, impl=impl: jax.nn.dot_product_attention(
                    qc, k, v, mask=m, scale=scale, implementation=impl), dense)
        for name in impls:
          step, c = steps[name]
          try:
            res[name], outs[name] = harness.fori_seconds(step, q, c, args.round_ms, args.rounds)
          except Exception as e:  # pylint: disable=broad-except
            res[name] = None
            print(f"  [{name} n/a: {type(e).__name__}: {str(e).splitlines()[0][:100]}]")
        err = None
        if outs.get("pallas") is not None and outs.get("xla") is not None:
          diff = outs["pallas"].astype(jnp.float32) - outs["xla"].astype(jnp.float32)
          err = float(jnp.abs(diff).max())
        cfg = attention_config(q.shape, k_cache.shape)
        if args.block_rows:
          cfg["block_t"] = max(1, args.block_rows // (1 << (hq // hkv - 1).bit_length()))
        pal = res.get("pallas")
        gbs = None if pal is None else kv_bytes / pal / 1e9
        ratio = lambda k: None if (pal is None or res.get(k) is None) else res[k] / pal
        us = lambda k: None if res.get(k) is None else res[k] * 1e6
        row = {"section": "attention", "batch": b, "prefix": prefix, "tokens": t}
        if pal is not None:
          floors.mark(row, pal * 1e3, kv_bytes, bw)
        print(f"{b:>2} {prefix:>6} {t:>4} {kv_bytes / 1e6:>7.1f} | {fmt(us('pallas'), '9.1f')} "
              f"{fmt(gbs, '6.0f')} {fmt(row.get('ratio_to_floor'), '7.2f')}"
              f"{floors.x_spec(row, width=7)} | {fmt(us('xla'), '8.1f')} "
              f"{fmt(ratio('xla'), '5.2f')} | {fmt(us('dpa_xla'), '8.1f')} "
              f"{fmt(ratio('dpa_xla'), '5.2f')} | "
              f"{fmt(us('dpa_cudnn'), '8.1f')} {fmt(ratio('dpa_cudnn'), '5.2f')} | "
              f"{fmt(err, '7.1e')} | {args.num_splits or cfg['num_splits']},{cfg['block_t']},"
              f"{args.block_k or cfg['block_k']}{floors.flag(row)}", flush=True)
        rows.append((row, res))
        del cell, consts, steps, outs
  # Summary: medians of the ratios over the grid.
  for k in ("xla", "dpa_xla", "dpa_cudnn"):
    rs = [res[k] / res["pallas"] for _, res in rows if res.get(k) and res.get("pallas")]
    if rs:
      print(f"median {k}/pallas time ratio over {len(rs)} cells: {statistics.median(rs):.2f}")
  fr = [row["ratio_to_floor"] for row, _ in rows if "ratio_to_floor" in row]
  if fr:
    print(f"median pallas time / its floor: {statistics.median(fr):.2f}")
  print(f"total wall time {time.perf_counter() - t_start:.0f} s")
  floors.check([row for row, _ in rows], bw)


if __name__ == "__main__":
  app.run(main)
