"""A Pallas (Triton) skinny GEMM for few rows, and one Qwen3 layer's GEMMs in the forms
bench_gemm.py times: flat 2-D matmuls, model.py's projections, the stacked-first layout model.py
used before 2026-11-30, and the flat layer on the skinny GEMM."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_jax import model
from ddtree_jax.config import ModelConfig


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
    q, k, v = model.project_norm_rope(layer, h, cos, sin, eps=eps)
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
