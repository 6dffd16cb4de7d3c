"""Pallas (Triton GPU) kernel: the gated delta rule over a draft tree in one launch, the contract
of `gated_deltanet.tree` (its jnp reference).

XLA runs the reference as a dozen small kernels per layer (the N x N products, the decays, a
batched triangular solve, the state products), each a launch on a few hundred kilobytes. Here
one program holds one value head's share of the work: the nodes' keys, decays and write
strengths give the N x N system (I + A) delta = rhs with A nonzero only from a node to its
ancestors, so the forward substitution runs one generation of the tree at a time (depth + 1
steps, each one N x N product with the deltas so far, every node of that depth at once). A
series such as (I - A)(I + A^2)(I + A^4)... would avoid the loop but is unstable: its terms grow
binomially when neighbouring keys are alike. The committed state is read once, in column blocks
of `block_v` (one program per head and block).

Precision follows `jax_default_matmul_precision` as XLA's reference does: "highest" (float32,
the lossless tests' setting) gives IEEE products, anything else TF32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32
_EXACT = ("highest", "float32", "F32_F32_F32")


def _pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def supported(n: int, value_dim: int, block_v: int) -> bool:
  """Triton blocks are powers of two of at least 16: block_v must be one, and cover or divide the
  value width (narrower widths are padded and masked)."""
  return n >= 1 and block_v >= 16 and block_v & (block_v - 1) == 0 and (
      value_dim <= block_v or value_dim % block_v == 0)


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, anc_ref, o_ref, d_ref, gg_ref, *, n,
            n_pad, dk_pad, block_v, precision):
  h, c = pl.program_id(0), pl.program_id(1)
  v0 = c * block_v
  dk, dv = q_ref.shape[-1], v_ref.shape[-1]
  rows = jnp.arange(n_pad)
  ok = rows < n
  k_ok, v_ok = jnp.arange(dk_pad) < dk, v0 + jnp.arange(block_v) < dv
  dot = lambda a, b, ca=1, cb=0: jax.lax.dot_general(
      a, b, (((ca,), (cb,)), ((), ())), precision=precision, preferred_element_type=F32)
  nodes = lambda ref, c0, w, cols: plgpu.load(ref.at[pl.ds(0, n_pad), h, pl.ds(c0, w)],
                                              mask=ok[:, None] & cols[None, :], other=0.0)
  q, k = nodes(q_ref, 0, dk_pad, k_ok), nodes(k_ref, 0, dk_pad, k_ok)
  v = nodes(v_ref, v0, block_v, v_ok)
  g = plgpu.load(g_ref.at[pl.ds(0, n_pad), h], mask=ok, other=0.0)
  beta = plgpu.load(b_ref.at[pl.ds(0, n_pad), h], mask=ok, other=0.0)
  state = plgpu.load(s_ref.at[h, pl.ds(0, dk_pad), pl.ds(v0, block_v)],
                     mask=k_ok[:, None] & v_ok[None, :], other=0.0)
  anc = plgpu.load(anc_ref.at[pl.ds(0, n_pad), pl.ds(0, n_pad)],
                   mask=ok[:, None] & ok[None, :], other=0) > 0
  strict = anc & (rows[:, None] != rows[None, :])

  big_g = jnp.sum(jnp.where(anc, g[None, :], 0.0), axis=1)               # [n_pad]
  # exp(G_j - G_l) <= 1 for an ancestor l of j; other pairs masked (and kept finite)
  decay = jnp.exp(jnp.where(anc, big_g[:, None] - big_g[None, :], 0.0))
  a = jnp.where(strict, beta[:, None] * decay * dot(k, k, 1, 1), 0.0)
  rhs = beta[:, None] * (v - jnp.exp(big_g)[:, None] * dot(k, state))
  # forward substitution one generation at a time: a node's ancestors are all final before it
  depth = jnp.sum(anc.astype(F32), axis=1) - 1.0                        # padded rows: -1
  generation = lambda d, x: jnp.where((depth == d.astype(F32))[:, None], rhs - dot(a, x), x)
  x = jax.lax.fori_loop(1, jnp.max(depth).astype(jnp.int32) + 1, generation, rhs)
  qk = jnp.where(anc, decay * dot(q, k, 1, 1), 0.0)
  o = jnp.exp(big_g)[:, None] * dot(q, state) + dot(qk, x)
  out = lambda ref, a: plgpu.store(ref.at[pl.ds(0, n_pad), h, pl.ds(v0, block_v)], a,
                                   mask=ok[:, None] & v_ok[None, :])
  out(o_ref, o)
  out(d_ref, x)

  @pl.when(c == 0)
  def _():
    plgpu.store(gg_ref.at[pl.ds(0, n_pad), h], big_g, mask=ok)


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "interpret"))
def delta_tree(q, k, v, g, beta, state, ancestors, *, block_v: int = 64, num_warps: int = 4,
               interpret=None):
  """`gated_deltanet.tree` in one launch: q, k [N, H, dk], v [N, H, dv], g, beta [N, H], state
  [H, dk, dv], ancestors [N, N] bool -> (o [N, H, dv], delta [N, H, dv], G [N, H]) float32.
  Needs `supported(N, dv, block_v)`; vmap adds a batch axis to the grid.

  interpret: None = interpret mode on a CPU default backend, compiled Triton otherwise."""
  n, hv, dk = k.shape
  dv = v.shape[-1]
  if not supported(n, dv, block_v):
    raise ValueError(f"delta_tree: block_v {block_v} must be a power of two >= 16 that covers "
                     f"or divides the value width {dv}")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  exact = str(jax.config.jax_default_matmul_precision) in _EXACT
  precision = jax.lax.Precision.HIGHEST if exact else jax.lax.Precision.DEFAULT
  return pl.pallas_call(
      functools.partial(_kernel, n=n, n_pad=max(16, _pow2(n)), dk_pad=max(16, _pow2(dk)),
                        block_v=block_v, precision=precision),
      grid=(hv, pl.cdiv(dv, block_v)),
      out_shape=[jax.ShapeDtypeStruct((n, hv, dv), F32)] * 2 + [jax.ShapeDtypeStruct((n, hv), F32)],
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      name="delta_tree",
  )(*(a.astype(F32) for a in (q, k, v, g, beta, state)), ancestors.astype(jnp.int32))
