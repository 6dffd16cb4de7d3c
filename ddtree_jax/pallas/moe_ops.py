"""The Pallas kernels of a mixture-of-experts layer as the stages `moe.grouped` and `moe.pairs`
take (`moe.ExpertOps`, `moe.PairOps`): float expert stacks on `grouped_gemm`'s kernels, quantized
ones (`quant.Int4Experts`, `quant.Fp8Experts`) on `quant_gemm`'s, XLA's forms where no kernel
takes the step (the tuning rule picks no tiles, or a stack the quantized kernels refuse)."""

from __future__ import annotations

import functools

from ddtree_jax.models import moe, quant
from ddtree_jax.pallas import grouped_gemm, quant_gemm


def _kernel_takes(w, dtype) -> bool:
  """Whether the Pallas kernels take the stack w with activations of `dtype`: a float one, or a
  quantized one that `quant_gemm` supports (XLA's form dequantizes the others, float16 too)."""
  return not quant.is_quantized(w) or quant_gemm.supported(w, dtype)


def expert_ops(tuning, blocks: tuple[int, int, int] | None = None):
  """`moe.ExpertOps` on the Pallas kernels: the gate/up GEMM with its SwiGLU fused, the down GEMM,
  the combine; tiles from `blocks` (block_m, block_n, block_k) or, when None, from
  `tuning.moe_blocks` (`kernels.KernelTuning`) for the step's pairs. Where the rule picks
  none the GEMMs are `lax.ragged_dot`'s. A quantized stack runs `quant_gemm.grouped_matmul`."""

  def launch(lhs, rhs):
    b = blocks or tuning.moe_blocks(lhs.shape[0])
    if b is None or not _kernel_takes(rhs, lhs.dtype):
      return None
    kw = dict(block_m=b[0], block_n=b[1], block_k=b[2], interpret=tuning.interpret)
    return dict(kw, swap=tuning.moe_quant_swap) if quant.is_quantized(rhs) else kw

  def matmul(w):
    return quant_gemm.grouped_matmul if quant.is_quantized(w) else grouped_gemm.grouped_matmul

  def gate_up(xs, w, sizes):
    kw = launch(xs, w)
    return (moe.xla_gate_up(xs, w, sizes) if kw is None
            else matmul(w)(xs, w, sizes, swiglu=True, **kw))

  def down(a, w, sizes):
    kw = launch(a, w)
    return moe.xla_down(a, w, sizes) if kw is None else matmul(w)(a, w, sizes, **kw)

  return moe.ExpertOps(gate_up=gate_up, down=down, combine=functools.partial(
      grouped_gemm.combine, interpret=tuning.interpret))


def pair_ops(tuning, blocks: tuple[int, int, int] | None = None):
  """`moe.PairOps` on `grouped_gemm.pair_matmul`: gate/up with its SwiGLU fused, then down, one tile per
  pair, tiles from `blocks` (block_m, block_n, block_k) or `tuning.moe_pair_blocks`. A quantized
  stack runs `quant_gemm.pair_matmul` (XLA's pair form where that kernel does not take it)."""
  b = blocks or tuning.moe_pair_blocks
  kw = dict(block_m=b[0], block_n=b[1], block_k=b[2], interpret=tuning.interpret)

  def matmul(w):
    if quant.is_quantized(w):
      return functools.partial(quant_gemm.pair_matmul, swap=tuning.moe_quant_swap)
    return grouped_gemm.pair_matmul

  def gate_up(x, w, experts):
    if not _kernel_takes(w, x.dtype):
      return moe.xla_pair_gate_up(x, w, experts)
    return matmul(w)(x, w, experts.reshape(-1), rows_per_lhs=experts.shape[1], swiglu=True,
                     **kw)

  def down(a, w, experts):
    if not _kernel_takes(w, a.dtype):
      return moe.xla_pair_down(a, w, experts)
    return matmul(w)(a, w, experts.reshape(-1), **kw)

  return moe.PairOps(gate_up=gate_up, down=down)
