"""The GEMMs of one Qwen3-8B layer vs the number of rows M (tree nodes x batch), as XLA fuses them.

One step is a layer without attention (bf16, random weights), in three forms:
  flat:   the bare 2-D matmuls: qkv = x Wqkv; h = x + qkv[:, :D] Wo; g = h Wgate_up;
          x' = h + (silu(g1) * g2) Wdown (no norms, no RoPE).
  model:  model.py's projections with its RMSNorms, q/k norms and RoPE; weights in model.py's
          shapes [H, N, Dh], [H, 2, K, Dh], [N, Dh, H], [H, 2, I], [I, H]; attention is
          replaced by o = q + k + v (per group).
  sbt:    the same layer with the einsums model.py used before 2026-11-30: k/v and gate/up
          stacked first ("sbtkd", "sbti"); model.py now puts that axis after the tokens.
  pallas: the flat layer with each matmul a Pallas (Triton) skinny GEMM, `skinny_matmul`: one
          program per column block of W streams its [K, block_n] slab once (no split-K here). An
          experiment: can a plain kernel read the weights faster than XLA's picks at 33-129 rows?
--sweep instead times each GEMM of the layer alone (each configuration's result checked against
XLA's first; --int8: int8 weights with a per-column scale, as a quantized drafter's;
--variants=swap: the weight tile as the MMA's first operand; --vocab=V adds an lm_head),
XLA's x @ w against ~20 skinny_matmul
configurations (block_n, split-K into float32 partials, W stored [N, K]); on the H200 the best of
them matched XLA within a few percent per layer (WORKSPACE.md, Findings: GEMMs and the int8
drafter). Each runs n times in one jitted fori_loop (harness.fori_seconds); the table gives us per
layer and the weight bandwidth it reaches. The verify forward of budget B runs M = B + 1 rows per
sequence, so this says which row counts (and layouts) the GEMM backend handles badly.

  python -m experiments.perf.bench_gemm                       # H200, ~1 minute
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python -m experiments.perf.bench_gemm  # cuBLAS
  python -m experiments.perf.bench_gemm --sweep --rows=1,33,65  # per GEMM, ~90 s
  python -m experiments.perf.bench_gemm --smoke               # tiny shapes on CPU
"""

from __future__ import annotations

import functools
import json
import os

from absl import app, flags
import jax
import jax.numpy as jnp

from ddtree_jax import engine, model
from experiments.perf import harness
from experiments.perf.skinny_gemm import (layer_config, layer_step, model_layer_step,
                                          pallas_layer_step, skinny_matmul, sweep_configs)


flags.DEFINE_string("rows", "1,16,17,32,33,48,64,65,80,96,128,129,192,256,257",
                    "row counts M (tree nodes x batch)")
flags.DEFINE_integer("hidden", 4096, "hidden size")
flags.DEFINE_integer("qkv", 6144, "q + k + v output columns")
flags.DEFINE_integer("intermediate", 12288, "MLP width")
flags.DEFINE_string("forms", "flat,model,sbt", "of flat, model, sbt, pallas")
flags.DEFINE_string("pallas", "", "skinny_matmul launch parameters, e.g. block_k=256,num_stages=3")
flags.DEFINE_bool("sweep", False, "per GEMM of the layer: XLA's x @ w vs skinny_matmul launch "
                  "configurations")
flags.DEFINE_string("formats", "", "instead: XLA's GEMM per weight format, e.g. bf16,w8,w8a8,fp8")
flags.DEFINE_bool("w8a8", False, "--sweep: model.dense's W8A8 (XLA) against skinny int8 x int8 "
                  "GEMMs (--variants=int8t,int8swap)")
flags.DEFINE_bool("int8", False, "--sweep with int8 weights (+ per-column scale) against XLA's "
                  "fused convert")
flags.DEFINE_string("variants", None, "--sweep skinny_matmul variants: plain, transposed, swap "
                    "(default all three); with --w8a8 int8t, int8swap (default both)")
flags.DEFINE_string("gemms", "", "--sweep only these (qkv, o, gate_up, down, lm_head)")
flags.DEFINE_integer("vocab", 0, "--sweep also an lm_head [hidden, vocab]")
flags.DEFINE_float("round_ms", 20.0, "target duration of a timed round")
flags.DEFINE_integer("rounds", 5, "timed rounds (median)")
flags.DEFINE_string("json_out", "", "append rows here as JSON lines")
flags.DEFINE_bool("smoke", False, "tiny shapes on CPU")
FLAGS = flags.FLAGS

SMOKE = dict(rows="1,5", hidden=64, qkv=128, intermediate=128, round_ms=1.0, rounds=1)
INT8_VARIANTS = {"int8t", "int8swap"}


def parse_settings():
  """The flags with --smoke applied, rows as ints and the --variants default resolved."""
  args = harness.settings(FLAGS, SMOKE)
  args.rows = harness.ints(args.rows)
  if args.variants is None:
    args.variants = ",".join(sorted(INT8_VARIANTS)) if args.w8a8 else "plain,transposed,swap"
  if args.w8a8 and not set(args.variants.split(",")) <= INT8_VARIANTS:
    raise app.UsageError(f"--w8a8 runs the int8 x int8 variants int8t, int8swap (K-major "
                         f"weights), not {args.variants!r}")
  return args


def gemm_shapes(args):
  """The [K, N] of a layer's four weights, by name (the flat layer's order)."""
  d, f = args.hidden, args.intermediate
  shapes = {"qkv": (d, args.qkv), "o": (d, d), "gate_up": (d, 2 * f), "down": (f, d)}
  if args.vocab:
    shapes["lm_head"] = (d, args.vocab)
  return {k: v for k, v in shapes.items() if not args.gemms or k in args.gemms.split(",")}


def sweep(args, keys):
  """Per GEMM of a layer and per row count: XLA vs every skinny_matmul configuration."""
  min_programs = 1 if args.smoke else 120
  trips = 3 if args.smoke else 200  # fixed trip count: one compile per configuration
  # the step feeds a reduction of its output back into x, so nothing is loop-invariant
  fb = lambda x, y: x + (y.astype(jnp.float32).sum(-1, keepdims=True) * 1e-6).astype(x.dtype)
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print(f"{'gemm':>8} {'M':>4} {'xla us':>8} {'GB/s':>6} {'best us':>8} {'GB/s':>6} {'x':>5}  config")
  total = {}
  for name, (k, n) in gemm_shapes(args).items():
    w = (jax.random.normal(keys[1], (k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
    scale = jnp.ones((n,), jnp.float32)
    if args.int8 or args.w8a8:  # model.quantize_int8's values: int8 [K, N], float32 scale [N]
      qw = model.quantize_int8(w)
      w, scale = qw.q.T, qw.scale
    wt = jnp.asarray(w.T)
    # XLA's form of the GEMM. --w8a8: model.dense itself (W8A8, int8 weight K-major [N, K] as
    # model.Int8Weight stores it); --int8: weight-only int8 (the convert fused into the GEMM,
    # scale after); else bf16.
    if args.w8a8:
      w = wt
      xla_mm = lambda x, w, s: model.dense("mk,kn->mn", x, model.Int8Weight(w, s))
    elif args.int8:
      xla_mm = lambda x, w, s: (jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
                                * s).astype(x.dtype)
    else:
      xla_mm = lambda x, w, s: x @ w
    for m in args.rows:
      x = (jax.random.normal(keys[0], (m, k), jnp.float32) * 0.1).astype(jnp.bfloat16)
      rows = []
      xla_s, _ = harness.fori_seconds(lambda x, w, s: fb(x, xla_mm(x, w, s)), x, (w, scale),
                              args.round_ms, args.rounds, trips)
      rows.append(dict(gemm=name, rows=m, impl="xla", us=xla_s * 1e6))
      want = xla_mm(x, w, scale).astype(jnp.float32)
      for cfg in sweep_configs(k, n, min_programs, args.variants):
        mm = functools.partial(skinny_matmul, **cfg)
        if args.w8a8:
          mm = lambda x, w, s, mm=mm: _w8a8_skinny(mm, x, w, s)
        elif args.int8:
          mm = lambda x, w, s, mm=mm: (mm(x, w).astype(jnp.float32) * s).astype(x.dtype)
        else:
          mm = lambda x, w, s, mm=mm: mm(x, w)
        wc = w if args.w8a8 else wt if cfg["transposed"] else w
        try:
          err = float(jnp.max(jnp.abs(mm(x, wc, scale) - want)) / jnp.max(jnp.abs(want)))
          if err > 2e-2:
            raise ValueError(f"wrong result: relative error {err:.3g}")
          sec, _ = harness.fori_seconds(lambda x, w, s: fb(x, mm(x, w, s)), x, (wc, scale),
                                args.round_ms, args.rounds, trips)
        except Exception as e:  # pylint: disable=broad-except  (e.g. shared memory overflow)
          print(f"  {name} M={m} {cfg}: {type(e).__name__}: {str(e)[:120]}")
          continue
        rows.append(dict(gemm=name, rows=m, impl="pallas", us=sec * 1e6, **cfg))
      best = min(rows[1:], key=lambda r: r["us"], default=rows[0])
      gb = lambda us: k * n * w.dtype.itemsize / us / 1e3
      cfg = {key: best[key] for key in ("block_n", "block_k", "splits", "transposed", "swap",
                                        "num_warps") if key in best}
      print(f"{name:>8} {m:>4} {rows[0]['us']:>8.1f} {gb(rows[0]['us']):>6.0f} {best['us']:>8.1f} "
            f"{gb(best['us']):>6.0f} {rows[0]['us'] / best['us']:>5.2f}  {cfg}", flush=True)
      t = total.setdefault(m, [0.0, 0.0])
      t[0], t[1] = t[0] + rows[0]["us"], t[1] + best["us"]
      if args.json_out:
        with open(args.json_out, "a") as fh:
          fh.writelines(json.dumps(r) + "\n" for r in rows)
  for m, (xla_us, best_us) in total.items():
    print(f"layer M={m}: xla {xla_us:.1f} us, best skinny_matmul per GEMM {best_us:.1f} us")


def _w8a8_skinny(mm, x, w, sw):
  """model.dense's W8A8 with the int8 x int8 -> int32 GEMM a skinny_matmul (w K-major [N, K])."""
  q, s = _quant_rows(x, 127.0, jnp.int8)
  return (mm(q, w).astype(jnp.float32) * s * sw).astype(x.dtype)


def _quant_rows(x, qmax, dtype):
  """x [M, K] -> (x / s, s [M, 1]) with s = max|row| / qmax (dynamic per-row activation scale)."""
  s = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True), 1e-12) / qmax
  xs = x.astype(jnp.float32) / s
  return (jnp.round(xs) if dtype == jnp.int8 else xs).astype(dtype), s


def _w8(x, w, sw):
  """int8 weights [K, N] cast to x's dtype inside the GEMM (weight-only)."""
  y = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
  return (y * sw).astype(x.dtype)


def _quantized(x, w, sw, qmax, dtype, acc):
  """x quantized per row (_quant_rows) times the stored weight [K, N], both scales after."""
  q, s = _quant_rows(x, qmax, dtype)
  return (jnp.dot(q, w, preferred_element_type=acc).astype(jnp.float32) * s * sw).astype(x.dtype)


# XLA's GEMM by weight format (x bf16 [M, K] -> bf16 [M, N]); w is the stored weight, sw [N].
# w8a8t is model.dense itself (int8 weight stored K-major, [N, K], as model.Int8Weight).
WEIGHT_FORMATS = {
    "bf16": (jnp.bfloat16, lambda x, w, sw: x @ w),
    "w8": (jnp.int8, _w8),
    "w8a8": (jnp.int8, lambda x, w, sw: _quantized(x, w, sw, 127.0, jnp.int8, jnp.int32)),
    "w8a8t": (jnp.int8, lambda x, w, sw: model.dense("mk,kn->mn", x, model.Int8Weight(w, sw))),
    "fp8": (jnp.float8_e4m3fn,
            lambda x, w, sw: _quantized(x, w, sw, 448.0, jnp.float8_e4m3fn, jnp.float32)),
}


def formats(args, keys):
  """Per GEMM and row count: XLA's time for each weight format (bf16, int8 weight-only, int8
  weights and activations with W [K, N] or K-major [N, K] (w8a8t), fp8 e4m3 weights and
  activations), and its error against the float32 product."""
  trips = 3 if args.smoke else 200
  fb = lambda x, y: x + (y.astype(jnp.float32).sum(-1, keepdims=True) * 1e-6).astype(x.dtype)
  names = args.formats.split(",")
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  print(f"{'gemm':>8} {'M':>4} " + " ".join(f"{n + ' us':>9} {'GB/s':>6} {'err':>7}" for n in names))
  rows = []
  for name, (k, n) in gemm_shapes(args).items():
    w = jax.random.normal(keys[1], (k, n), jnp.float32) * k ** -0.5
    for m in args.rows:
      x = (jax.random.normal(keys[0], (m, k), jnp.float32) * 0.1).astype(jnp.bfloat16)
      want = (x.astype(jnp.float32) @ w)
      cells = []
      for fmt in names:
        dtype, mm = WEIGHT_FORMATS[fmt]
        if dtype == jnp.bfloat16:
          wq, sw = w.astype(dtype), jnp.ones((n,), jnp.float32)
        else:
          qmax = 127.0 if dtype == jnp.int8 else 448.0
          sw = jnp.max(jnp.abs(w), axis=0) / qmax
          wq = (jnp.round(w / sw) if dtype == jnp.int8 else w / sw).astype(dtype)
        if fmt.endswith("t"):  # stored K-major, [N, K] (model.Int8Weight's layout)
          wq = jnp.asarray(wq.T)
        err = float(jnp.max(jnp.abs(jax.jit(mm)(x, wq, sw).astype(jnp.float32) - want))
                    / jnp.max(jnp.abs(want)))
        sec, _ = harness.fori_seconds(lambda x, w, s: fb(x, mm(x, w, s)), x, (wq, sw), args.round_ms,
                              args.rounds, trips)
        cells.append(f"{sec * 1e6:>9.1f} {wq.nbytes / sec / 1e9:>6.0f} {err:>7.1e}")
        rows.append(dict(gemm=name, rows=m, format=fmt, us=sec * 1e6, err=err))
      print(f"{name:>8} {m:>4} " + " ".join(cells), flush=True)
  if args.json_out:
    with open(args.json_out, "a") as fh:
      fh.writelines(json.dumps(r) + "\n" for r in rows)
  return rows


engine.define_compilation_cache_flags()


def main(_):
  engine.compilation_cache_from_flags()
  args = parse_settings()
  d, f, dh = args.hidden, args.intermediate, 128 if args.hidden >= 1024 else 16
  nq, nkv = d // dh, (args.qkv - d) // (2 * dh)
  keys = jax.random.split(jax.random.key(0), 5)
  if args.sweep:
    sweep(args, keys)
    return
  if args.formats:
    formats(args, keys)
    return
  flat = [(jax.random.normal(k, s, jnp.float32) * s[0] ** -0.5).astype(jnp.bfloat16)
          for k, s in zip(keys[1:], gemm_shapes(args).values())]
  # the same weights in model.py's shapes (a bitcast of the flat ones: identical bytes)
  ones = lambda n: jnp.ones((n,), jnp.bfloat16)
  layer = model.LayerParams(
      input_norm=ones(d), wq=flat[0][:, :d].reshape(d, nq, dh),
      wkv=flat[0][:, d:].reshape(d, 2, nkv, dh), wo=flat[1].reshape(nq, dh, d), q_norm=ones(dh),
      k_norm=ones(dh), post_norm=ones(d), w_gate_up=flat[2].reshape(d, 2, f), w_down=flat[3])
  pallas_kw = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in args.pallas.split(",") if kv}
  forms = {"flat": lambda m: (layer_step, flat, lambda x: x),
           "pallas": lambda m: (functools.partial(pallas_layer_step, **pallas_kw), flat,
                                lambda x: x)}
  cfg = layer_config(d, f, nq, nkv, dh)
  for name in ("model", "sbt"):
    def make(m, name=name):
      cs = model.rope_tables(cfg, jnp.arange(m)[None], jnp.bfloat16)
      return (lambda x, lp, *c: model_layer_step(x, lp, *c, cfg=cfg, form=name), (layer, *cs),
              lambda x: x[None])
    forms[name] = make
  weight_bytes = sum(w.nbytes for w in flat)
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, pallas {args.pallas!r}, "
        f"weights {weight_bytes / 1e6:.0f} MB")
  names = args.forms.split(",")
  print(f"{'M':>5} " + " ".join(f"{n + ' us':>9} {'GB/s':>6}" for n in names))
  for m in args.rows:
    x = (jax.random.normal(keys[0], (m, d), jnp.float32) * 0.1).astype(jnp.bfloat16)
    cells = []
    for name in names:
      step, weights, shape = forms[name](m)
      sec, _ = harness.fori_seconds(step, shape(x), weights, args.round_ms, args.rounds)
      cells.append(f"{sec * 1e6:>9.1f} {weight_bytes / sec / 1e9:>6.0f}")
      if args.json_out:
        with open(args.json_out, "a") as fh:
          fh.write(json.dumps(dict(rows=m, form=name, us=sec * 1e6, pallas=args.pallas,
                                   xla_flags=os.environ.get("XLA_FLAGS", ""))) + "\n")
    print(f"{m:>5} " + " ".join(cells), flush=True)


if __name__ == "__main__":
  app.run(main)
