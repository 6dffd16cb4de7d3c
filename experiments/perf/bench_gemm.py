"""The GEMMs of one Qwen3-8B layer vs the number of rows M (tree nodes x batch), as XLA fuses them.

One step is a layer without attention (bf16, random weights), in three forms:
  flat:   the bare 2-D matmuls: qkv = x Wqkv; h = x + qkv[:, :D] Wo; g = h Wgate_up;
          x' = h + (silu(g1) * g2) Wdown (no norms, no RoPE).
  model:  the decoder's projections with its RMSNorms, q/k norms and RoPE; weights in its
          shapes [H, N, Dh], [H, 2, K, Dh], [N, Dh, H], [H, 2, I], [I, H]; attention is
          replaced by o = q + k + v (per group).
  sbt:    the same layer with the einsums the decoder used before 2026-11-30: k/v and gate/up
          stacked first ("sbtkd", "sbti"); the decoder now puts that axis after the tokens.
--formats instead times XLA's GEMM per weight format (bf16, int8 weight-only, W8A8 with the weight
[K, N] or K-major, fp8) for each GEMM of the layer alone (--gemms picks them, --vocab=V adds an
lm_head), with its error against the float32 product. Each runs n times in one jitted fori_loop
(harness.fori_seconds); the table gives us per layer (or GEMM) and the weight bandwidth it
reaches. The verify forward of budget B runs M = B + 1 rows per sequence, so this says which row
counts (and layouts) the GEMM backend handles badly.

  python -m experiments.perf.bench_gemm                       # H200, ~1 minute
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python -m experiments.perf.bench_gemm  # cuBLAS
  python -m experiments.perf.bench_gemm --formats=bf16,w8,w8a8,w8a8t,fp8 --rows=16,33
  python -m experiments.perf.bench_gemm --smoke               # tiny shapes on CPU
"""

from __future__ import annotations

import json
import os

from absl import app, flags
import jax
import jax.numpy as jnp

from ddtree_jax import engine
from ddtree_jax.models import ops
from ddtree_jax.models import decoder
from ddtree_jax.models import attention
from ddtree_jax.models.config import ModelConfig
from experiments.perf import common_flags, harness

common_flags.define("smoke", "rounds", "json_out", round_ms=20.0)
flags.DEFINE_string("rows", "1,16,17,32,33,48,64,65,80,96,128,129,192,256,257",
                    "row counts M (tree nodes x batch)")
flags.DEFINE_integer("hidden", 4096, "hidden size")
flags.DEFINE_integer("qkv", 6144, "q + k + v output columns")
flags.DEFINE_integer("intermediate", 12288, "MLP width")
flags.DEFINE_string("forms", "flat,model,sbt", "of flat, model, sbt")
flags.DEFINE_string("formats", "", "instead: XLA's GEMM per weight format, e.g. bf16,w8,w8a8,fp8")
flags.DEFINE_string("gemms", "", "--formats only these (qkv, o, gate_up, down, lm_head)")
flags.DEFINE_integer("vocab", 0, "--formats: also an lm_head [hidden, vocab]")

SMOKE = dict(rows="1,5", hidden=64, qkv=128, intermediate=128, round_ms=1.0, rounds=1)


def gemm_shapes(args):
  """The [K, N] of a layer's four weights, by name (the flat layer's order)."""
  d, f = args.hidden, args.intermediate
  shapes = {"qkv": (d, args.qkv), "o": (d, d), "gate_up": (d, 2 * f), "down": (f, d)}
  if args.vocab:
    shapes["lm_head"] = (d, args.vocab)
  return {k: v for k, v in shapes.items() if not args.gemms or k in args.gemms.split(",")}


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


def model_layer_step(x, layer, cos, sin, *, cfg, form):
  """[1, M, H] -> [1, M, H]: a target layer with attention replaced by o = q + k + v (per group).

  form "model": the decoder's functions; "sbt": the einsums it used before 2026-11-30, with
  the stacked k/v and gate/up axis first."""
  eps = cfg.rms_norm_eps
  h = ops.rms_norm(x, layer.input_norm, eps)
  if form == "model":
    q, k, v = attention.project_norm_rope(layer, h, cos, sin, eps=eps)
  else:
    q = ops.rms_norm(jnp.einsum("bth,hnd->btnd", h, layer.wq), layer.q_norm, eps)
    kv = jnp.einsum("bth,hskd->sbtkd", h, layer.wkv)
    q, k, v = ops.apply_rope(q, cos, sin), kv[0], kv[1]
    k = ops.apply_rope(ops.rms_norm(k, layer.k_norm, eps), cos, sin)
  o = q + jnp.repeat(k + v, q.shape[2] // k.shape[2], axis=2)
  if form == "model":
    x, h = ops.residual_norm(x, "btnd,ndh->bth", o, layer.wo, layer.post_norm, eps=eps)
    return decoder.mlp_block(layer, cfg, x, h, layer.input_norm)[0]
  x = x + jnp.einsum("btnd,ndh->bth", o, layer.wo)
  gu = jnp.einsum("bth,hsi->sbti", ops.rms_norm(x, layer.post_norm, eps), layer.w_gate_up)
  return x + jnp.einsum("bti,ih->bth", jax.nn.silu(gu[0]) * gu[1], layer.w_down)


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
# w8a8t is ops.dense itself (int8 weight stored K-major, [N, K], as ops.Int8Weight).
WEIGHT_FORMATS = {
    "bf16": (jnp.bfloat16, lambda x, w, sw: x @ w),
    "w8": (jnp.int8, _w8),
    "w8a8": (jnp.int8, lambda x, w, sw: _quantized(x, w, sw, 127.0, jnp.int8, jnp.int32)),
    "w8a8t": (jnp.int8, lambda x, w, sw: ops.dense("mk,kn->mn", x, ops.Int8Weight(w, sw))),
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
        if fmt.endswith("t"):  # stored K-major, [N, K] (ops.Int8Weight's layout)
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
  args = common_flags.start(SMOKE)
  args.rows = harness.ints(args.rows)
  d, f, dh = args.hidden, args.intermediate, 128 if args.hidden >= 1024 else 16
  nq, nkv = d // dh, (args.qkv - d) // (2 * dh)
  keys = jax.random.split(jax.random.key(0), 5)
  if args.formats:
    formats(args, keys)
    return
  flat = [(jax.random.normal(k, s, jnp.float32) * s[0] ** -0.5).astype(jnp.bfloat16)
          for k, s in zip(keys[1:], gemm_shapes(args).values())]
  # the same weights in the decoder's shapes (a bitcast of the flat ones: identical bytes)
  ones = lambda n: jnp.ones((n,), jnp.bfloat16)
  layer = decoder.LayerParams(
      input_norm=ones(d), wq=flat[0][:, :d].reshape(d, nq, dh),
      wkv=flat[0][:, d:].reshape(d, 2, nkv, dh), wo=flat[1].reshape(nq, dh, d), q_norm=ones(dh),
      k_norm=ones(dh), post_norm=ones(d), w_gate_up=flat[2].reshape(d, 2, f), w_down=flat[3])
  forms = {"flat": lambda m: (layer_step, flat, lambda x: x)}
  cfg = layer_config(d, f, nq, nkv, dh)
  for name in ("model", "sbt"):
    def make(m, name=name):
      cs = ops.rope_tables(cfg, jnp.arange(m)[None], jnp.bfloat16)
      return (lambda x, lp, *c: model_layer_step(x, lp, *c, cfg=cfg, form=name), (layer, *cs),
              lambda x: x[None])
    forms[name] = make
  weight_bytes = sum(w.nbytes for w in flat)
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, "
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
          fh.write(json.dumps(dict(rows=m, form=name, us=sec * 1e6,
                                   xla_flags=os.environ.get("XLA_FLAGS", ""))) + "\n")
    print(f"{m:>5} " + " ".join(cells), flush=True)


if __name__ == "__main__":
  app.run(main)
