"""The MoE expert GEMMs (gate/up with its SwiGLU, then down) per weight format at Kimi K2.6's expert
shape (384 experts, top-8, hidden 7168, moe_intermediate 2048; random weights in the formats as
shipped: bf16, compressed-tensors W4A16 int4 in groups of 32 (`quant.random_int4`), DeepSeek-V3
block FP8 128x128 (`quant.random_fp8`)), for T tokens routed uniformly at random (T * 8 pairs).

  python -m experiments.perf.bench_quant_experts            # one H200, ~3 minutes
  python -m experiments.perf.bench_quant_experts --tokens=1,65 --formats=int4 \\
      --paths=pairs,pairs_swap --pair_blocks=16x64x256,16x32x256
  python -m experiments.perf.bench_quant_experts --tokens=1 --formats=int4,fp8 \\
      --sweep=64x256x4x3x0x0x1,64x256x4x2x1x1x1    # each pair kernel alone per launch
  python -m experiments.perf.bench_quant_experts --smoke    # tiny shapes on CPU (interpreted)

Paths (--paths; each format runs those that apply):
  decode       `moe_decode.moe_decode` at the engine's launch (`moe_decode.launch`: spans that fill
               the SMs): its gate/up kernel, then the down pair kernel and each
               token's combine (T <= --pair_tokens; experts given, weights 1: the in-kernel
               top-k is not timed here, bench_moe times it)
  pairs        `moe_ops.pair_ops`: one tile per pair, no sort (decode; T <= --pair_tokens);
               a quantized stack runs `quant_gemm.pair_matmul`, dequantized in registers
  grouped      `moe_ops.expert_ops` over the pairs sorted by expert (the sort and gather are
               done once, outside the timing); quantized: `quant_gemm.grouped_matmul`
  *_swap       the same with KernelTuning.moe_quant_swap flipped (quantized stacks only)
  xla          `moe.xla_gate_up` / `moe.xla_down`: ragged_dot, a quantized stack dequantized
               whole first
  xla_pairs    `moe.xla_pair_gate_up` / `xla_pair_down`: each pair's expert gathered and
               dequantized (T <= --pair_tokens)

Each row is timed as `harness.fori_seconds` times a chained step (x <- x + 1e-3 * experts(x), one
small elementwise kernel beside the GEMMs) and checked on the device: the first --check_pairs
pairs against a float32 reference from `quant.dequantize` (max abs error, and relative to the
reference's max; bf16 rounding of the gate/up output bounds it near 1e-2). The floor is the bytes
of the distinct experts the pairs touch (packed weights and scales) at the floors' bandwidth
(`floors.measure`, or --floor_bandwidth given), and x spec the same bytes at the card's spec
bandwidth; --sweep's rows likewise, per kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import json

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import engine
from ddtree_jax.kernels import KernelTuning
from ddtree_jax.models import decoder, moe, quant
from ddtree_jax.pallas import grouped_gemm, moe_decode, moe_ops
from experiments.perf import common_flags, floors, harness

common_flags.define("smoke", "rounds", "json_out", "floor_bandwidth", round_ms=20.0)
flags.DEFINE_integer("experts", 384, "routed experts E")
flags.DEFINE_integer("top_k", 8, "experts per token")
flags.DEFINE_integer("hidden", 7168, "hidden size H")
flags.DEFINE_integer("intermediate", 2048, "expert width I (moe_intermediate_size)")
flags.DEFINE_integer("group_size", 32, "int4 inputs per scale")
flags.DEFINE_string("fp8_block", "128,128", "fp8 scale block: inputs,outputs")
flags.DEFINE_string("tokens", "1,8,17,65", "token counts T (T * top_k pairs)")
flags.DEFINE_string("formats", "bf16,int4,fp8", "of bf16, int4, fp8")
flags.DEFINE_string("paths", "decode,pairs,grouped,xla,xla_pairs",
                    "of decode, pairs, grouped, decode_swap, pairs_swap, grouped_swap, xla, "
                    "xla_pairs")
flags.DEFINE_string("decode_launches", "", "decode paths' gate/up launches GUxBKxWARPS, comma list "
                    "('' = KernelTuning.moe_decode_launch / moe_decode_quant_launch)")
flags.DEFINE_integer("pair_tokens", 17, "pair paths at T <= this only")
flags.DEFINE_string("pair_blocks", "", "pair paths' tiles BMxBNxBK, comma list ('' = "
                    "KernelTuning.moe_pair_blocks)")
flags.DEFINE_string("grouped_blocks", "", "grouped paths' tiles BMxBNxBK, comma list ('' = "
                    "KernelTuning's rule for the step's pairs)")
flags.DEFINE_integer("check_pairs", 8, "pairs checked against the float32 reference")
flags.DEFINE_string("sweep", "", "instead: each pair kernel (gate/up, down) alone at each T and "
                    "format, per launch BNxBKxWARPSxSTAGESxSWAPxPREFETCHxASM of this comma list "
                    "(PREFETCH, ASM default 1; bf16: the float kernel, the last three ignored)")
FLAGS = flags.FLAGS

SMOKE = dict(experts=8, top_k=2, hidden=64, intermediate=32, fp8_block="32,32", tokens="1,3",
             round_ms=1.0, rounds=1, check_pairs=4)
ROWS = []


def emit(args, row):
  ROWS.append(row)
  print(json.dumps(row), flush=True)
  if args.json_out:
    with open(args.json_out, "a") as f:
      f.write(json.dumps(row) + "\n")


def make_stacks(fmt: str, args, key):
  """(w_gate_up [E, H, 2, I], w_down [E, I, H]) in format fmt, random."""
  e, h, i = args.experts, args.hidden, args.intermediate
  k1, k2 = jax.random.split(key)
  if fmt == "bf16":
    w = lambda k, s: (0.02 * jax.random.normal(k, s, jnp.float32)).astype(jnp.bfloat16)
  elif fmt == "int4":
    w = lambda k, s: quant.random_int4(k, s, group_size=args.group_size)
  elif fmt == "fp8":
    block = tuple(int(v) for v in args.fp8_block.split(","))
    w = lambda k, s: quant.random_fp8(k, s, block=block)
  else:
    raise app.UsageError(f"--formats: unknown {fmt!r}")
  return jax.block_until_ready((w(k1, (e, h, 2, i)), w(k2, (e, i, h))))


def route(t: int, args, seed: int):
  """experts [T, k] int32: each token's k distinct experts, uniformly at random."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(np.stack([rng.choice(args.experts, args.top_k, replace=False)
                               for _ in range(t)]).astype(np.int32))


def reference(x, wgu, wd, experts, pairs: int):
  """The first `pairs` pairs' outputs [pairs, H] in float32, from the dequantized experts."""
  k = experts.shape[1]
  ids = experts.reshape(-1)[:pairs]
  xs = x.astype(jnp.float32)[jnp.arange(pairs) // k]
  gu = jnp.einsum("ph,phsi->psi", xs, quant.dequantize(quant.take(wgu, ids), jnp.float32),
                  precision=jax.lax.Precision.HIGHEST)
  a = jax.nn.silu(gu[:, 0]) * gu[:, 1]
  return jnp.einsum("pi,pih->ph", a, quant.dequantize(quant.take(wd, ids), jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)


def blocks_list(text: str):
  return [tuple(int(v) for v in b.split("x")) for b in text.split(",")] if text else [None]


def cases(fmt: str, t: int, args):
  """(path, tiles, kind, ops) for the rows of one format and token count; kind is "pairs" or
  "grouped" (the ops' contract)."""
  quantized = fmt != "bf16"
  base = KernelTuning(interpret=None)
  for path in args.paths.split(","):
    swap = path.endswith("_swap")
    if swap and not quantized:
      continue
    tuning = dataclasses.replace(base, moe_quant_swap=not base.moe_quant_swap) if swap else base
    kind = path.removesuffix("_swap")
    if kind in ("decode", "pairs", "xla_pairs") and t > args.pair_tokens:
      continue
    if kind == "decode":
      routing = moe.Routing(args.top_k)
      for b in blocks_list(args.decode_launches):
        b = b or (tuning.moe_decode_quant_launch if quantized else tuning.moe_decode_launch)
        at = dataclasses.replace(tuning, moe_decode_launch=b, moe_decode_quant_launch=b)
        yield path, b, "decode", (
            lambda params, x, weights, experts, at=at, routing=routing: moe_decode.moe_decode(
                params, x, routing, weights, experts,
                **moe_decode.launch(at, params, x.shape[0] * routing.top_k, x.shape[1])))
    elif kind == "pairs":
      for b in blocks_list(args.pair_blocks):
        yield path, b or tuning.moe_pair_blocks, "pairs", moe_ops.pair_ops(tuning, b)
    elif kind == "grouped":
      for b in blocks_list(args.grouped_blocks):
        tiles = b or tuning.moe_blocks(t * args.top_k)
        yield path, tiles, "grouped", moe_ops.expert_ops(tuning, b)
    elif kind == "xla":
      yield path, None, "grouped", moe.ExpertOps()
    elif kind == "xla_pairs":
      yield path, None, "pairs", moe.PairOps()
    else:
      raise app.UsageError(f"--paths: unknown {path!r}")


def run_format(fmt: str, args, key, bw: floors.Bandwidth):
  """Every row of one format (its stacks alive only here: one format on the device at a time)."""
  wgu, wd = make_stacks(fmt, args, key)
  expert_bytes = (decoder.param_bytes(wgu) + decoder.param_bytes(wd)) / args.experts
  print(f"{fmt}: {expert_bytes / 1e6:.2f} MB per expert (weights and scales), stacks "
        f"{(decoder.param_bytes(wgu) + decoder.param_bytes(wd)) / 1e9:.2f} GB", flush=True)
  k = args.top_k
  for t in harness.ints(args.tokens):
    experts = route(t, args, seed=t)
    distinct = int(np.unique(np.asarray(experts)).size)
    x = (jax.random.normal(jax.random.fold_in(key, t), (t, args.hidden), jnp.float32)
         ).astype(jnp.bfloat16)
    pairs = min(args.check_pairs, t * k)
    want = np.asarray(reference(x, wgu, wd, experts, pairs))
    order, sizes = moe.sort_pairs(experts, args.experts)
    xs = x[order // k]
    where = np.argsort(np.asarray(order))[:pairs]   # each checked pair's sorted row
    router = jnp.zeros((args.hidden, args.experts), jnp.float32)  # (unused: experts given)
    ones = jnp.ones(experts.shape, jnp.bfloat16)
    for path, tiles, kind, ops in cases(fmt, t, args):
      if kind == "decode":
        fn = lambda x, wgu, wd, ex, ops=ops: ops(moe.MoEParams(router, wgu, wd), x,
                                                 weights=ones, experts=ex)
        step = lambda x, wgu, wd, ex, fn=fn: x + (1e-3 * fn(x, wgu, wd, ex)).astype(x.dtype)
        carry, consts = x, (wgu, wd, experts)
        rows = np.arange(pairs // k)  # tokens whose pairs are all checked: their sums
      elif kind == "pairs":
        fn = lambda x, wgu, wd, ex, ops=ops: ops.down(ops.gate_up(x, wgu, ex), wd, ex)
        step = lambda x, wgu, wd, ex, fn=fn: x + (1e-3 * fn(x, wgu, wd, ex).reshape(
            x.shape[0], k, -1).sum(1)).astype(x.dtype)
        carry, consts, rows = x, (wgu, wd, experts), np.arange(pairs)
      else:
        fn = lambda x, wgu, wd, sizes, ops=ops: ops.down(ops.gate_up(x, wgu, sizes), wd, sizes)
        step = lambda x, wgu, wd, sizes, fn=fn: x + (1e-3 * fn(x, wgu, wd, sizes)).astype(x.dtype)
        carry, consts, rows = xs, (wgu, wd, sizes), where
      row = dict(section="path", tokens=t, pairs=t * k, format=fmt, path=path, tiles=tiles,
                 distinct=distinct)
      try:
        got = np.asarray(jax.jit(fn)(carry, *consts), np.float32)[rows]
        sec, _ = harness.fori_seconds(step, carry, consts, args.round_ms, args.rounds)
      except Exception as err:  # pylint: disable=broad-except  (a failed launch is a row)
        emit(args, dict(row, error=str(err)[:400]))
        continue
      ref = want.reshape(-1, k, want.shape[-1])[:len(rows)].sum(1) if kind == "decode" else want
      err = float(np.max(np.abs(got - ref)))
      row.update(us=sec * 1e6, max_abs_err=err, rel_err=err / float(np.max(np.abs(ref))))
      emit(args, floors.mark(row, sec * 1e3, distinct * expert_bytes, bw))


def sweep(args, bw: floors.Bandwidth):
  """Each pair kernel alone per launch variant: (format, T, op, variant) -> us, vs its floor (a
  "sweep" row each, printed as a table line)."""
  from ddtree_jax.pallas import quant_gemm  # pylint: disable=import-outside-toplevel
  variants = [tuple(int(v) for v in text.split("x")) for text in args.sweep.split(",")]
  print(f"{'format':<6} {'T':>4} {'op':<8} {'BNxBKxWxSxSWxPFxA':<18} {'us':>8} {'floor us':>9} "
        f"{'ratio':>6} {'x spec':>6}")
  for n, fmt in enumerate(args.formats.split(",")):
    wgu, wd = make_stacks(fmt, args, jax.random.key(n))
    for t in harness.ints(args.tokens):
      experts = route(t, args, seed=t)
      distinct = int(np.unique(np.asarray(experts)).size)
      x = jax.random.normal(jax.random.key(t), (t, args.hidden), jnp.float32).astype(jnp.bfloat16)
      a = jnp.ones((t * args.top_k, args.intermediate), jnp.bfloat16)
      ops = (("gate_up", x, wgu, dict(rows_per_lhs=args.top_k, swiglu=True)),
             ("down", a, wd, {}))
      for name, lhs, w, kw in ops:
        nbytes = distinct * decoder.param_bytes(w) / args.experts
        for variant in variants:
          bn, bk, warps, stages, swap, prefetch, asm = variant + (1,) * (7 - len(variant))
          label = "x".join(map(str, (bn, bk, warps, stages, swap, prefetch, asm)))
          launch = dict(kw, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                        block_m=16)
          if quant.is_quantized(w):
            mm = functools.partial(quant_gemm.pair_matmul, swap=bool(swap),
                                   prefetch=bool(prefetch), asm=bool(asm), **launch)
          else:
            mm = functools.partial(grouped_gemm.pair_matmul, **launch)
          # (one scalar of the output feeds the next call: nothing is hoisted)
          step = lambda lhs, w, ex, mm=mm: lhs + (1e-6 * mm(lhs, w, ex.reshape(-1))[0, 0]
                                                  ).astype(lhs.dtype)
          try:
            sec, _ = harness.fori_seconds(step, lhs, (w, experts), args.round_ms, args.rounds)
          except Exception as err:  # pylint: disable=broad-except
            print(f"{fmt:<6} {t:>4} {name:<8} {label}: {str(err)[:200]}")
            continue
          r = floors.mark(dict(section="sweep", format=fmt, tokens=t, op=name, launch=label,
                               us=sec * 1e6), sec * 1e3, nbytes, bw)
          ROWS.append(r)
          print(f"{fmt:<6} {t:>4} {name:<8} {label:<18} {r['us']:>8.1f} "
                f"{r['floor_ms'] * 1e3:>9.1f} {r['ratio_to_floor']:>6.2f}"
                f"{floors.x_spec(r, width=7)}{floors.flag(r)}", flush=True)
    del wgu, wd


def print_table():
  print("\n== MoE expert GEMMs (gate/up + SwiGLU + down) vs the distinct experts' bytes floor")
  print(f"{'T':>4} {'format':<6} {'path':<13} {'tiles':<12} {'us':>9} {'experts':>8} "
        f"{'floor us':>9} {'ratio':>6} {'x spec':>6} {'max abs err':>12} {'rel err':>8}")
  for r in (r for r in ROWS if r["section"] == "path"):
    tiles = "x".join(map(str, r["tiles"])) if r["tiles"] else "-"
    head = f"{r['tokens']:>4} {r['format']:<6} {r['path']:<13} {tiles:<12}"
    if "error" in r:
      print(f"{head} error: {r['error'][:120]}")
      continue
    flag = "" if r["rel_err"] < 3e-2 else "  BAD"
    print(f"{head} {r['us']:>9.1f} {r['distinct']:>8} {r['floor_ms'] * 1e3:>9.1f} "
          f"{r['ratio_to_floor']:>6.2f}{floors.x_spec(r, width=7)} {r['max_abs_err']:>12.2e} "
          f"{r['rel_err']:>8.1e}{flag}{floors.flag(r)}")


engine.define_compilation_cache_flags(default=False)


def main(_):
  args = common_flags.start(SMOKE)
  dev = jax.devices()[0]
  print(f"device {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}; "
        f"E={args.experts} top-{args.top_k} H={args.hidden} I={args.intermediate}", flush=True)
  bw = floors.measure(args.smoke, args.floor_bandwidth)
  print(bw.describe(), flush=True)
  emit(args, bw.row())
  if args.sweep:
    sweep(args, bw)
  else:
    for n, fmt in enumerate(args.formats.split(",")):
      run_format(fmt, args, jax.random.key(n), bw)
    print_table()
  floors.check(ROWS)


if __name__ == "__main__":
  app.run(main)
