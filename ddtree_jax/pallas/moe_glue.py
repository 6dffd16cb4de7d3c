"""Pallas (Triton GPU) kernels around a mixture-of-experts layer's decode experts
(`pallas.moe_decode`): the router before them and the combine after them, each one launch where
XLA's forms take three.

  router_partials  the router's float32 logits as S partial sums over slices of the hidden dim,
                   [S, R, E] (IEEE float32 products, as `moe.router_logits`' HIGHEST precision):
                   one program per (row, block of experts, slice), so the 1 MB-a-layer router is
                   read by many SMs at once; whoever routes sums the S partials in slice order
                   (the gate/up kernel does, as it loads them). XLA's one-row router is a
                   split-K GEMM, the sum of its splits and a slice.
  combine_norm     each row's k pair outputs summed in rank order with their weights, plus the
                   shared experts' output where the layer has one, the residual add and the next
                   RMSNorm: (x', rms_norm(x')), one program per row. XLA's form is a clamp, the
                   sum with the add, and the norm's reduce and multiply.

The roundings are those of the XLA forms they replace (`moe.sum_pairs`, then `decoder.mlp_block`:
the mixture rounded to x's dtype, the shared experts added, the residual added, each rounded;
`ops.rms_norm`), so only the order of the float32 sums differs. Each has its jnp reference here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_jax.models import moe
from ddtree_jax.models.ops import rms_norm

F32 = jnp.float32


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def router_partials_reference(h, router, splits: int):
  """h [R, H], router [H, E] -> [S, R, E] float32: partial s sums inputs [s * H/S, (s+1) * H/S)."""
  r, hid = h.shape
  hs = h.astype(F32).reshape(r, splits, hid // splits)
  ws = router.astype(F32).reshape(splits, hid // splits, -1)
  return jnp.einsum("rsk,ske->sre", hs, ws, precision=lax.Precision.HIGHEST)


def _router_kernel(h_ref, w_ref, o_ref, *, block_h, block_e, depth, e_dim):
  r, c, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  cols = c * block_e + jnp.arange(block_e)
  col_ok = cols < e_dim

  def step(i, acc):
    k0 = s * depth + i * block_h
    x = plgpu.load(h_ref.at[r, pl.ds(k0, block_h)]).astype(F32)
    w = plgpu.load(w_ref.at[pl.ds(k0, block_h), pl.ds(c * block_e, block_e)],
                   mask=col_ok[None, :], other=0)
    return acc + jnp.sum(x[:, None] * w, axis=0)   # (CUDA cores: IEEE products, no TF32)
  acc = lax.fori_loop(0, depth // block_h, step, jnp.zeros((block_e,), F32))
  plgpu.store(o_ref.at[s, r, pl.ds(c * block_e, block_e)], acc, mask=col_ok)


def router_supported(hidden: int, splits: int, block_h: int) -> bool:
  """The kernel's slices: S divides H into slices of a multiple of block_h (a power of two)."""
  return (_pow2(splits) and _pow2(block_h) and hidden % splits == 0
          and (hidden // splits) % block_h == 0)


@functools.partial(jax.jit, static_argnames=("splits", "block_e", "block_h", "num_warps",
                                             "interpret"))
def router_partials(h, router, *, splits: int = 8, block_e: int = 32, block_h: int = 64,
                    num_warps: int = 4, interpret=None):
  """h [R, H] (any float dtype), router [H, E] float32 -> [S, R, E] float32 partial logits,
  `router_partials_reference`'s (their sum over S is `moe.router_logits`). Needs
  `router_supported(H, splits, block_h)`; block_e a power of two."""
  r, hid = h.shape
  e = router.shape[1]
  if router.shape[0] != hid or router.dtype != F32:
    raise ValueError(f"router_partials: router {router.shape} {router.dtype} must be float32 "
                     f"[{hid}, E]")
  if not router_supported(hid, splits, block_h) or not _pow2(block_e):
    raise ValueError(f"router_partials: H={hid} must split into {splits} slices of a multiple "
                     f"of block_h={block_h}, and splits, block_h, block_e={block_e} be powers "
                     "of two")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  whole = lambda shape: pl.BlockSpec(shape, lambda i, j, k: (0,) * len(shape))
  return pl.pallas_call(
      functools.partial(_router_kernel, block_h=block_h, block_e=block_e,
                        depth=hid // splits, e_dim=e),
      grid=(r, pl.cdiv(e, block_e), splits),
      in_specs=[whole(h.shape), whole(router.shape)],
      out_specs=whole((splits, r, e)),
      out_shape=jax.ShapeDtypeStruct((splits, r, e), F32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=3),
      interpret=interpret,
      name="moe_router",
  )(h, router)


def combine_norm_reference(y, weights, here, x, norm, extra=None, *, eps):
  """y [R*k, H] pair outputs (pair p = r * k + j), weights [R, k], here [R*k] (0: the pair is
  held elsewhere and adds nothing; its row may be garbage), x [R, H] the residual, norm [H],
  extra [R, H] (shared experts) or None -> (x', rms_norm(x', norm)), as `decoder.mlp_block`."""
  r, k = weights.shape
  experts = jnp.where(here.reshape(r, k) > 0, 0, 1)   # (1 = the one "elsewhere" id)
  out = moe.sum_pairs(y, weights, experts, 1).astype(x.dtype)
  if extra is not None:
    out = out + extra
  x = x + out.astype(x.dtype)
  return x, rms_norm(x, norm, eps)


def _combine_kernel(*refs, k, has_extra, eps, h_dim, lanes):
  y_ref, w_ref, here_ref, x_ref, n_ref = refs[:5]
  e_ref = refs[5] if has_extra else None
  xo_ref, ho_ref = refs[-2:]
  dt = xo_ref.dtype
  rnd = lambda v: v.astype(dt).astype(F32)
  r = pl.program_id(0)
  cols = jnp.arange(lanes)
  ok = cols < h_dim
  acc = jnp.zeros((lanes,), F32)
  for j in range(k):  # rank order, as moe.sum_pairs
    p = r * k + j
    row = plgpu.load(y_ref.at[p, cols], mask=ok, other=0).astype(F32)
    acc = jnp.where(here_ref[p] > 0, acc + w_ref[p] * row, acc)
  out = rnd(acc)
  if has_extra:
    out = rnd(out + plgpu.load(e_ref.at[r, cols], mask=ok, other=0).astype(F32))
  xn = rnd(plgpu.load(x_ref.at[r, cols], mask=ok, other=0).astype(F32) + out)
  inv = lax.rsqrt(jnp.sum(xn * xn) / h_dim + eps)
  plgpu.store(xo_ref.at[r, cols], xn.astype(dt), mask=ok)
  norm = plgpu.load(n_ref.at[cols], mask=ok, other=0).astype(F32)
  plgpu.store(ho_ref.at[r, cols], (norm * rnd(xn * inv)).astype(dt), mask=ok)


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "interpret"))
def combine_norm(y, weights, here, x, norm, extra=None, *, eps: float, num_warps: int = 8,
                 interpret=None):
  """`combine_norm_reference` in one launch, one program per row (the hidden dim in one block:
  H up to 16384). weights float32 (the router's, rounded to the compute dtype)."""
  r, k = weights.shape
  h_dim = x.shape[1]
  if y.shape != (r * k, h_dim) or here.shape != (r * k,) or norm.shape != (h_dim,):
    raise ValueError(f"combine_norm: y {y.shape}, weights {weights.shape}, here {here.shape}, "
                     f"x {x.shape}, norm {norm.shape} do not fit [R*k, H], [R, k], [R*k], "
                     "[R, H], [H]")
  if extra is not None and extra.shape != x.shape:
    raise ValueError(f"combine_norm: extra {extra.shape} must be x's {x.shape}")
  if h_dim > 16384:
    raise ValueError(f"combine_norm: hidden {h_dim} > 16384 does not fit one program")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  ins = [y, weights.reshape(-1).astype(F32), here.astype(jnp.int32), x, norm]
  if extra is not None:
    ins.append(extra)
  whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)
  return pl.pallas_call(
      functools.partial(_combine_kernel, k=k, has_extra=extra is not None, eps=eps,
                        h_dim=h_dim, lanes=pl.next_power_of_2(h_dim)),
      grid=(r,),
      in_specs=[whole(a) for a in ins],
      out_specs=[whole(x)] * 2,
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)] * 2,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="moe_combine_norm",
  )(*ins)
