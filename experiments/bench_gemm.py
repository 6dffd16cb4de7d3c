"""The GEMMs of one Qwen3-8B layer vs the number of rows M (tree nodes x batch), as XLA fuses them.

One step is a layer without attention (bf16, random weights), in three forms:
  flat:   the bare 2-D matmuls: qkv = x Wqkv; h = x + qkv[:, :D] Wo; g = h Wgate_up;
          x' = h + (silu(g1) * g2) Wdown (no norms, no RoPE).
  model:  model.py's projections with its RMSNorms, q/k norms and RoPE; weights in model.py's
          shapes [H, N, Dh], [H, 2, K, Dh], [N, Dh, H], [H, 2, I], [I, H]; attention is
          replaced by o = q + k + v (per group).
  sbt:    the same layer with the einsums model.py used before 2026-11-30: k/v and gate/up
          stacked first ("sbtkd", "sbti"); model.py now puts that axis after the tokens.
Each runs n times in one jitted fori_loop (bench_attention.time_loop); the table gives us per
layer and the weight bandwidth it reaches. The verify forward of budget B runs M = B + 1 rows per
sequence, so this says which row counts (and layouts) the GEMM backend handles badly.

  python experiments/bench_gemm.py                  # H200, ~1 minute
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python experiments/bench_gemm.py   # cuBLAS
  python experiments/bench_gemm.py --smoke          # tiny shapes on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

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
  p.add_argument("--forms", default="flat,model,sbt")
  p.add_argument("--round_ms", type=float, default=20.0)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--json_out", default="")
  p.add_argument("--smoke", action="store_true")
  args = p.parse_args(argv)
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
  x = x + model.output_projection(layer, q + jnp.repeat(k + v, q.shape[2] // k.shape[2], axis=2))
  if form == "model":
    return model.mlp_block(layer, cfg, x)
  gu = jnp.einsum("bth,hsi->sbti", model.rms_norm(x, layer.post_norm, eps), layer.w_gate_up)
  return x + jnp.einsum("bti,ih->bth", jax.nn.silu(gu[0]) * gu[1], layer.w_down)


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  d, f, dh = args.hidden, args.intermediate, 128 if args.hidden >= 1024 else 16
  nq, nkv = d // dh, (args.qkv - d) // (2 * dh)
  keys = jax.random.split(jax.random.key(0), 5)
  shapes = [(d, args.qkv), (d, d), (d, 2 * f), (f, d)]
  flat = [(jax.random.normal(k, s, jnp.float32) * s[0] ** -0.5).astype(jnp.bfloat16)
          for k, s in zip(keys[1:], shapes)]
  # the same weights in model.py's shapes (a bitcast of the flat ones: identical bytes)
  ones = lambda n: jnp.ones((n,), jnp.bfloat16)
  layer = model.LayerParams(
      input_norm=ones(d), wq=flat[0][:, :d].reshape(d, nq, dh),
      wkv=flat[0][:, d:].reshape(d, 2, nkv, dh), wo=flat[1].reshape(nq, dh, d), q_norm=ones(dh),
      k_norm=ones(dh), post_norm=ones(d), w_gate_up=flat[2].reshape(d, 2, f), w_down=flat[3])
  forms = {"flat": lambda m: (layer_step, flat, lambda x: x)}
  cfg = layer_config(d, f, nq, nkv, dh)
  for name in ("model", "sbt"):
    def make(m, name=name):
      cs = model.rope_tables(cfg, jnp.arange(m)[None], jnp.bfloat16)
      return (lambda x, lp, *c: model_layer_step(x, lp, *c, cfg=cfg, form=name), (layer, *cs),
              lambda x: x[None])
    forms[name] = make
  weight_bytes = sum(w.nbytes for w in flat)
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, weights {weight_bytes / 1e6:.0f} MB")
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
          fh.write(json.dumps(dict(rows=m, form=name, us=sec * 1e6,
                                   xla_flags=os.environ.get("XLA_FLAGS", ""))) + "\n")
    print(f"{m:>5} " + " ".join(cells), flush=True)


if __name__ == "__main__":
  main()
