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
them matched XLA within a few percent per layer (WORKSPACE.md, seventh session).
Each runs n times in one jitted fori_loop (bench_attention.time_loop); the table gives us per
layer and the weight bandwidth it reaches. The verify forward of budget B runs M = B + 1 rows per
sequence, so this says which row counts (and layouts) the GEMM backend handles badly.

  python experiments/bench_gemm.py                  # H200, ~1 minute
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python experiments/bench_gemm.py   # cuBLAS
  python experiments/bench_gemm.py --sweep --rows=1,33,65   # per GEMM, ~90 s
  python experiments/bench_gemm.py --smoke          # tiny shapes on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import bench_attention as ba
from ddtree_jax import model
from ddtree_jax.config import ModelConfig


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rows", type=ba._ints,
                 default=[1, 16, 17, 32, 33, 48, 64, 65, 80, 96, 128, 129, 192, 256, 257])
  p.add_argument("--hidden", type=int, default=4096)
  p.add_argument("--qkv", type=int, default=6144)
  p.add_argument("--intermediate", type=int, default=12288)
  p.add_argument("--forms", default="flat,model,sbt", help="of flat, model, sbt, pallas")
  p.add_argument("--pallas", default="",
                 help="skinny_matmul launch parameters, e.g. block_k=256,num_stages=3")
  p.add_argument("--sweep", action="store_true",
                 help="per GEMM of the layer: XLA's x @ w vs skinny_matmul launch configurations")
  p.add_argument("--formats", default="",
                 help="instead: XLA's GEMM per weight format, e.g. bf16,w8,w8a8,fp8")
  p.add_argument("--w8a8", action="store_true",
                 help="--sweep: model.dense's W8A8 (XLA) against skinny int8 x int8 GEMMs "
                      "(--variants=int8t,int8swap)")
  p.add_argument("--int8", action="store_true",
                 help="--sweep with int8 weights (+ per-column scale) against XLA's fused convert")
  p.add_argument("--variants", default=None,
                 help="--sweep skinny_matmul variants: plain, transposed, swap (default all "
                      "three); with --w8a8 int8t, int8swap (default both)")
  p.add_argument("--gemms", default="", help="--sweep only these (qkv, o, gate_up, down, lm_head)")
  p.add_argument("--vocab", type=int, default=0, help="--sweep also an lm_head [hidden, vocab]")
  p.add_argument("--round_ms", type=float, default=20.0)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--json_out", default="")
  p.add_argument("--smoke", action="store_true")
  args = p.parse_args(argv)
  int8_variants = {"int8t", "int8swap"}
  if args.variants is None:
    args.variants = ",".join(sorted(int8_variants)) if args.w8a8 else "plain,transposed,swap"
  if args.w8a8 and not set(args.variants.split(",")) <= int8_variants:
    raise ValueError(f"--w8a8 runs the int8 x int8 variants int8t, int8swap (K-major weights), "
                     f"not {args.variants!r}")
  if args.smoke:
    args.rows, args.hidden, args.qkv, args.intermediate = [1, 5], 64, 128, 128
    args.round_ms, args.rounds = 1.0, 1
  return args


def layer_config(hidden, intermediate, heads, kv_heads, head_dim):
  """The ModelConfig of one Qwen3 layer (what the projections, norms and RoPE read)."""
  return ModelConfig("qwen3", vocab_size=1, hidden_size=hidden, intermediate_size=intermediate,
                     num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                     rope_theta=1e6)


def layer_step(x, wqkv, wo, wgu, wd):
  """[M, D] -> [M, D]: the four GEMMs of a layer with their elementwise glue."""
  d, f = x.shape[1], wd.shape[0]
  qkv = x @ wqkv
  h = x + qkv[:, :d] @ wo
  g = h @ wgu
  return h + (jax.nn.silu(g[:, :f]) * g[:, f:]) @ wd


def _skinny_kernel(x_ref, w_ref, o_ref, *, m, mp, block_k, n_k, transposed, swap):
  """One (column block, K split) program: acc [mp, block_n] += x[:, k] @ w[k, cols] over its
  n_k blocks of block_k; w is [K, N], or [N, K] when `transposed` (rows of W^T contiguous).
  An int8 w is cast to x's dtype in registers (both int8: int8 x int8 -> int32). `swap`
  computes acc^T [block_n, mp] = w^T x^T, so the weight tile is the MMA's first operand (Hopper
  wgmma needs >= 64 rows there; x's 16-64 rows fit its N) and the output is transposed once at
  the end."""
  rows_ok = (jnp.arange(mp) < m)[:, None]
  k0 = pl.program_id(1) * n_k * block_k
  bn = w_ref.shape[0 if transposed else 1]
  w_k = 1 if transposed else 0  # w's contracting dim
  acc_t = jnp.int32 if x_ref.dtype == jnp.int8 else jnp.float32

  def body(i, acc):
    k = k0 + i * block_k
    x = plgpu.load(x_ref.at[pl.ds(0, mp), pl.ds(k, block_k)], mask=rows_ok, other=0)
    w = plgpu.load(w_ref.at[:, pl.ds(k, block_k)] if transposed
                   else w_ref.at[pl.ds(k, block_k), :]).astype(x.dtype)
    if swap:
      return acc + lax.dot_general(w, x, (((w_k,), (1,)), ((), ())), preferred_element_type=acc_t)
    return acc + lax.dot_general(x, w, (((1,), (w_k,)), ((), ())), preferred_element_type=acc_t)

  acc = lax.fori_loop(0, n_k, body, jnp.zeros((bn, mp) if swap else (mp, bn), acc_t))
  plgpu.store(o_ref.at[pl.ds(0, mp), :], (acc.T if swap else acc).astype(o_ref.dtype),
              mask=rows_ok)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "splits", "transposed",
                                             "swap", "num_warps", "num_stages", "interpret"))
def skinny_matmul(x, w, *, block_n=None, block_k=128, splits=1, transposed=False, swap=False,
                  num_warps=4, num_stages=None, interpret=None):
  """x [M, K] @ w [K, N] (or w [N, K] with `transposed`) -> [M, N] in x's dtype, float32
  accumulation; w bf16 or int8 (cast in the kernel; scale the output outside). x and w both
  int8 (W8A8): int32 accumulation and output. With splits > 1 each of `splits` programs per
  column block sums a K/splits slice into a float32 (int32) partial and the partials are added
  in jnp (XLA fuses that into the consumer). `swap`: see _skinny_kernel.
  block_n defaults to the largest power of two <= 128 that still gives >= 128 programs (about a
  wave on an H200); num_stages to as many (<= 4) as fit ~200 KB of shared memory (227 KB)."""
  m, k = x.shape
  n = w.shape[0 if transposed else 1]
  if block_n is None:
    block_n = 128
    while block_n > 16 and n // block_n * splits < 128:
      block_n //= 2
  block_k = min(block_k, k // splits)
  if n % block_n or k % (block_k * splits):
    raise ValueError(f"N={n}, K={k} must be multiples of block_n={block_n}, "
                     f"block_k={block_k} x splits={splits}")
  mp = max(16, 1 << (m - 1).bit_length())
  if num_stages is None:
    tile = (mp * x.dtype.itemsize + block_n * w.dtype.itemsize) * block_k
    num_stages = max(1, min(4, 200 * 1024 // tile))
  n_k = k // (block_k * splits)
  kernel = functools.partial(_skinny_kernel, m=m, mp=mp, block_k=block_k, n_k=n_k,
                             transposed=transposed, swap=swap)
  w_spec = (pl.BlockSpec((block_n, k), lambda j, s: (j, 0)) if transposed
            else pl.BlockSpec((k, block_n), lambda j, s: (0, j)))
  out_dtype = jnp.int32 if x.dtype == jnp.int8 else x.dtype if splits == 1 else jnp.float32
  out = pl.pallas_call(
      kernel, grid=(n // block_n, splits),
      in_specs=[pl.BlockSpec((m, k), lambda j, s: (0, 0)), w_spec],
      out_specs=pl.BlockSpec((None, m, block_n), lambda j, s: (s, 0, j)),
      out_shape=jax.ShapeDtypeStruct((splits, m, n), out_dtype),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=jax.default_backend() == "cpu" if interpret is None else interpret,
      name="skinny_matmul")(x, w)
  if splits == 1:
    return out[0]
  return out.sum(axis=0) if x.dtype == jnp.int8 else out.sum(axis=0).astype(x.dtype)


def pallas_layer_step(x, wqkv, wo, wgu, wd, **kw):
  """layer_step with every matmul a skinny_matmul (kw: its launch parameters)."""
  d, f = x.shape[1], wd.shape[0]
  mm = functools.partial(skinny_matmul, **kw)
  qkv = mm(x, wqkv)
  h = x + mm(qkv[:, :d], wo)
  g = mm(h, wgu)
  return h + mm(jax.nn.silu(g[:, :f]) * g[:, f:], wd)


def model_layer_step(x, layer, cos, sin, *, cfg, form):
  """[1, M, H] -> [1, M, H]: a target layer with attention replaced by o = q + k + v (per group).

  form "model": model.py's functions; "sbt": the einsums model.py used before 2026-11-30, with
  the stacked k/v and gate/up axis first."""
  eps = cfg.rms_norm_eps
  h = model.rms_norm(x, layer.input_norm, eps)
  if form == "model":
    q, k, v = model.project_qkv(layer, cfg, h, cos, sin)
  else:
    q = model.rms_norm(jnp.einsum("bth,hnd->btnd", h, layer.wq), layer.q_norm, eps)
    kv = jnp.einsum("bth,hskd->sbtkd", h, layer.wkv)
    q, k, v = model.apply_rope(q, cos, sin), kv[0], kv[1]
    k = model.apply_rope(model.rms_norm(k, layer.k_norm, eps), cos, sin)
  o = q + jnp.repeat(k + v, q.shape[2] // k.shape[2], axis=2)
  if form == "model":
    x, h = model.residual_norm(x, "btnd,ndh->bth", o, layer.wo, layer.post_norm, eps=eps)
    return model.mlp_block(layer, cfg, x, h, layer.input_norm)[0]
  x = x + jnp.einsum("btnd,ndh->bth", o, layer.wo)
  gu = jnp.einsum("bth,hsi->sbti", model.rms_norm(x, layer.post_norm, eps), layer.w_gate_up)
  return x + jnp.einsum("bti,ih->bth", jax.nn.silu(gu[0]) * gu[1], layer.w_down)


def sweep_configs(k, n, min_programs=120, variants="plain,transposed,swap"):
  """skinny_matmul launch configurations worth timing for w [K, N]: 120-4000 programs."""
  out = []
  kinds = {"plain": (False, False, (64, 128, 256)), "transposed": (True, False, (16, 32, 64)),
           "swap": (False, True, (64, 128, 256)),
           # W8A8 (int8 x and K-major int8 w): half the bytes per tile, so longer K blocks
           "int8t": (True, False, (32, 64, 128)), "int8swap": (True, True, (64, 128, 256))}
  for variant in variants.split(","):
    transposed, swap, block_ns = kinds[variant]
    for bn in block_ns:
      if variant.startswith("int8"):
        bks = (128, 256) if bn * 256 > 16384 else (256, 512)
      elif swap:
        bks = (64, 128) if bn == 256 else (128, 256)
      else:
        bks = ((64 if bn >= 256 else 128) if not transposed else (256 if bn <= 32 else 128),)
      for bk in bks:
        for s in (1, 2, 4, 8, 16):
          programs = n // bn * s
          if n % bn == 0 and k % (bk * s) == 0 and min_programs <= programs <= 4000:
            out.append(dict(block_n=bn, block_k=bk, splits=s, transposed=transposed, swap=swap,
                            num_warps=8 if bn * bk >= 256 * 64 and not transposed else 4))
  return out


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
      xla_s, _ = ba.time_loop(lambda x, w, s: fb(x, xla_mm(x, w, s)), x, (w, scale),
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
          sec, _ = ba.time_loop(lambda x, w, s: fb(x, mm(x, w, s)), x, (wc, scale),
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
        sec, _ = ba.time_loop(lambda x, w, s: fb(x, mm(x, w, s)), x, (wq, sw), args.round_ms,
                              args.rounds, trips)
        cells.append(f"{sec * 1e6:>9.1f} {wq.nbytes / sec / 1e9:>6.0f} {err:>7.1e}")
        rows.append(dict(gemm=name, rows=m, format=fmt, us=sec * 1e6, err=err))
      print(f"{name:>8} {m:>4} " + " ".join(cells), flush=True)
  return rows


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  d, f, dh = args.hidden, args.intermediate, 128 if args.hidden >= 1024 else 16
  nq, nkv = d // dh, (args.qkv - d) // (2 * dh)
  keys = jax.random.split(jax.random.key(0), 5)
  if args.sweep:
    return sweep(args, keys)
  if args.formats:
    return formats(args, keys)
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
      sec, _ = ba.time_loop(step, shape(x), weights, args.round_ms, args.rounds)
      cells.append(f"{sec * 1e6:>9.1f} {weight_bytes / sec / 1e9:>6.0f}")
      if args.json_out:
        with open(args.json_out, "a") as fh:
          fh.write(json.dumps(dict(rows=m, form=name, us=sec * 1e6, pallas=args.pallas,
                                   xla_flags=os.environ.get("XLA_FLAGS", ""))) + "\n")
    print(f"{m:>5} " + " ".join(cells), flush=True)


if __name__ == "__main__":
  main()
