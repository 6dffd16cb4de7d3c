"""The quantized expert GEMMs (`pallas.quant_gemm`, interpret mode on CPU): hand-packed int4 and
fp8 stacks read back exactly (nibble order, scale groups and blocks), the grouped and pair kernels
against `quant.dequantize` + a float GEMM, the MoE layer on quantized experts through
`moe_ops.expert_ops` / `pair_ops`, refused shapes, and the Triton lowering's 64-bit offsets
for a Kimi-K2-sized stack (lowered for an abstract H200, nothing allocated)."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ddtree_jax import kernels
from ddtree_jax.models import moe, quant
from ddtree_jax.pallas import moe_ops, quant_gemm
from helpers import abstract_h200_mesh, triton_custom_calls, verify_triton_ir

F32, BF16 = jnp.float32, jnp.bfloat16
HIGHEST = jax.lax.Precision.HIGHEST
FP8_BLOCK = (48, 24)  # K and N below are not multiples of it; 48 is no power of two


def _close(got, want, rel):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert got.shape == want.shape
  err = np.max(np.abs(got - want))
  assert err <= rel * np.max(np.abs(want)), (err, np.max(np.abs(want)))


def _stack(fmt, shape, seed):
  w = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
  return quant.quantize_int4(w, 32) if fmt == "int4" else quant.quantize_fp8(w, FP8_BLOCK)


def _hand_int4(e=2, k=256, n=24, group=32):
  """(Int4Experts packed by hand, its float32 stack): nibble values that differ with their
  position in the word, a different power-of-two scale per group."""
  kk, nn, ee = np.meshgrid(np.arange(k), np.arange(n), np.arange(e), indexing="ij")
  q = ((3 * kk + 5 * nn + 7 * ee) % 16 - 8).transpose(2, 0, 1)          # [e, k, n] in [-8, 7]
  words = np.zeros((e, k // 8, n), np.uint32)
  for j in range(8):                                # input 8r + j is nibble j of word r
    words |= (q[:, j::8, :] + 8).astype(np.uint32) << np.uint32(4 * j)
  scale = (2.0 ** -(np.arange(k // group) % 4))[None, :, None] * (
      1 + np.arange(n) / 32)[None, None, :] * (1 + np.arange(e))[:, None, None]
  w = q * np.repeat(scale, group, axis=1)
  return (quant.Int4Experts(packed=jnp.asarray(words.view(np.int32)),
                            scale=jnp.asarray(scale, BF16), group_size=group),
          w.astype(np.float32))


def _hand_fp8(e=2, k=80, n=72, block=(32, 32)):
  """(Fp8Experts built by hand, its float32 stack): e4m3 values in quarters, a scale per
  block, K and N not multiples of the block."""
  kk, nn, ee = np.meshgrid(np.arange(k), np.arange(n), np.arange(e), indexing="ij")
  vals = (((7 * kk + 3 * nn + 5 * ee) % 31 - 15) / 4).transpose(2, 0, 1).astype(np.float32)
  q = vals.astype(ml_dtypes.float8_e4m3fn)
  assert (q.astype(np.float32) == vals).all()       # quarters up to 3.75 are exact in e4m3
  kb, nb = -(-k // block[0]), -(-n // block[1])
  scale = (2.0 ** (np.arange(kb) - 1))[None, :, None] * (1 + np.arange(nb) / 8)[None, None, :] * (
      1 + np.arange(e))[:, None, None]
  full = np.repeat(np.repeat(scale, block[0], axis=1)[:, :k], block[1], axis=2)[:, :, :n]
  return (quant.Fp8Experts(q=jnp.asarray(q), scale=jnp.asarray(scale, F32), block=block),
          vals * full.astype(np.float32))


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_hand_built_stacks_read_back_exactly(fmt):
  """One-hot rows times a hand-built stack give its rows exactly, in both tile orientations and
  both kernels: a wrong nibble order, scale group or scale block would show."""
  w, want = _hand_int4() if fmt == "int4" else _hand_fp8()
  np.testing.assert_array_equal(np.asarray(quant.dequantize(w, F32)), want)  # the reference
  k = want.shape[1]
  eye = jnp.eye(k, dtype=F32)
  got = quant_gemm.grouped_matmul(eye, w, jnp.asarray([k, 0], jnp.int32), block_m=64,
                                  block_n=16, block_k=128)
  np.testing.assert_array_equal(np.asarray(got), want[0])
  got = quant_gemm.pair_matmul(eye, w, jnp.ones((k,), jnp.int32), block_n=16, block_k=128,
                               swap=True)
  np.testing.assert_array_equal(np.asarray(got), want[1])


def _ref_matmul(lhs, w, sizes):
  """ragged_dot on the dequantized stack, from lhs's dtype upcast (float32 products)."""
  wd = quant.dequantize(w, lhs.dtype).astype(F32)
  return jax.lax.ragged_dot(lhs.astype(F32), wd.reshape(wd.shape[0], wd.shape[1], -1), sizes,
                            precision=HIGHEST)


def _swiglu(gu):
  gu = gu.reshape(gu.shape[0], 2, -1)
  return jax.nn.silu(gu[:, 0]) * gu[:, 1]


# int4 in both tile orientations at both dtypes, fp8 likewise (swap: the transposed tile)
CASES = [("int4", F32, False), ("int4", BF16, True), ("fp8", F32, True), ("fp8", BF16, False)]


@pytest.mark.parametrize("fmt,dtype,swap", CASES)
def test_grouped_matmul_equals_dequantized_ragged_dot(fmt, dtype, swap):
  """Ragged groups (two empty, one of 21 rows > block_m), 4 rows past sum(sizes), K and N not
  multiples of the tiles or of fp8's scale blocks; gate/up with its SwiGLU and down."""
  rel = 1e-5 if dtype == F32 else 1e-2
  rng = np.random.default_rng(1)
  sizes = jnp.asarray([0, 21, 3, 0], jnp.int32)
  h, i = 160, 64
  xs = jnp.asarray(rng.normal(size=(28, h)), dtype)
  kw = dict(block_m=8, block_n=16, block_k=128, swap=swap)
  w_gate_up, w_down = _stack(fmt, (4, h, 2, i), 2), _stack(fmt, (4, i, h), 3)
  a = quant_gemm.grouped_matmul(xs, w_gate_up, sizes, swiglu=True, **kw)
  assert a.dtype == dtype
  _close(a[:24], _swiglu(_ref_matmul(xs, w_gate_up, sizes))[:24], rel)
  a = jnp.asarray(rng.normal(size=(28, i)), dtype)
  _close(quant_gemm.grouped_matmul(a, w_down, sizes, **kw)[:24],
         _ref_matmul(a, w_down, sizes)[:24], rel)


@pytest.mark.parametrize("fmt,dtype,swap", CASES)
def test_pair_matmul_rows_and_elsewhere_pairs(fmt, dtype, swap):
  """Row p = lhs[p // rows_per_lhs] @ rhs[groups[p]] (repeated and unordered groups); a pair of
  group E (held elsewhere) is skipped."""
  rel = 1e-5 if dtype == F32 else 1e-2
  rng = np.random.default_rng(4)
  e, h, i = 4, 160, 64
  groups = jnp.asarray([3, 0, 4, 3, 1, 4, 2, 0])                  # 4: elsewhere
  here = np.asarray(groups) < e
  x = jnp.asarray(rng.normal(size=(4, h)), dtype)
  kw = dict(block_n=16, block_k=128, swap=swap)
  w_gate_up, w_down = _stack(fmt, (e, h, 2, i), 5), _stack(fmt, (e, i, h), 6)
  wd = quant.dequantize(w_gate_up, dtype).astype(F32).reshape(e, h, 2 * i)
  got = quant_gemm.pair_matmul(x, w_gate_up, groups, rows_per_lhs=2, swiglu=True, **kw)
  want = _swiglu(jnp.einsum("ph,phn->pn", x.astype(F32)[np.arange(8) // 2],
                            wd[np.minimum(groups, e - 1)], precision=HIGHEST))
  _close(np.asarray(got)[here], np.asarray(want)[here], rel)
  a = jnp.asarray(rng.normal(size=(8, i)), dtype)
  wd = quant.dequantize(w_down, dtype).astype(F32)
  got = quant_gemm.pair_matmul(a, w_down, groups, **kw)
  want = jnp.einsum("pi,pih->ph", a.astype(F32), wd[np.minimum(groups, e - 1)],
                    precision=HIGHEST)
  _close(np.asarray(got)[here], np.asarray(want)[here], rel)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_moe_layer_on_quantized_experts(fmt):
  """Kernels("pallas").moe over quantized stacks, the decode kernel off (test_moe_decode.py has
  it): a decode step pair by pair and a larger one over the sorted pairs (`moe_ops.pair_ops` /
  `expert_ops` dispatch to quant_gemm), both equal to the reference on the dequantized experts,
  elsewhere pairs adding nothing."""
  key = jax.random.key(7)
  h, e, i = 160, 6, 64
  params = moe.init_params(key, h, e, i, F32, std=0.3)
  params = moe.MoEParams(router=params.router, w_gate_up=_stack(fmt, (e, h, 2, i), 8),
                         w_down=_stack(fmt, (e, i, h), 9))
  x = jax.random.normal(jax.random.fold_in(key, 1), (9, h), F32)
  routing = moe.Routing(2, norm_topk_prob=True)
  tuning = kernels.KernelTuning(moe_decode_quant_max=0, moe_quant_pair_max=4,
                                moe_pair_blocks=(16, 16, 128),
                                moe_launch=((1 << 30, 8, 16, 128),))
  layer = kernels.Kernels("pallas", tuning=tuning).moe
  for rows in (2, 9):  # 4 pairs pair by pair, 18 sorted
    w, ex = moe.route(params, x[:rows], routing)
    _close(layer(params, x[:rows], routing=routing), moe.reference(params, x[:rows], w, ex), 1e-5)
  w, ex = moe.route(params, x, routing)
  gone = jnp.where(ex == 2, e, ex)
  want = moe.reference(params, x, jnp.where(ex == 2, 0, w), ex)
  _close(moe.grouped(params, x, w, gone, ops=moe_ops.expert_ops(tuning)), want, 1e-5)


def test_refused_shapes_and_dtypes():
  x = jnp.zeros((4, 96), F32)
  sizes = jnp.asarray([2, 2], jnp.int32)
  odd_group = quant.Int4Experts(packed=jnp.zeros((2, 12, 8), jnp.int32),
                                scale=jnp.zeros((2, 8, 8), BF16), group_size=12)
  with pytest.raises(ValueError, match="group_size 12"):
    quant_gemm.grouped_matmul(x, odd_group, sizes)
  w = quant.quantize_int4(jnp.ones((2, 96, 8)), 32)
  with pytest.raises(ValueError, match="power of two"):
    quant_gemm.grouped_matmul(x, w, sizes, block_k=192)
  with pytest.raises(ValueError, match="float32 or bfloat16"):
    quant_gemm.grouped_matmul(x.astype(jnp.float16), w, sizes)
  with pytest.raises(ValueError, match="do not match"):
    quant_gemm.grouped_matmul(jnp.zeros((4, 64), F32), w, sizes)
  with pytest.raises(ValueError, match=r"\[E, K, 2, N\]"):
    quant_gemm.grouped_matmul(x, w, sizes, swiglu=True)
  fp8 = quant.quantize_fp8(jnp.ones((2, 96, 8)), (24, 32))
  with pytest.raises(ValueError, match="power-of-two divisor"):
    quant_gemm.pair_matmul(x, fp8, jnp.asarray([0, 1]))


def test_int4_plane_asm_bit_logic():
  """The PTX dequantization's integer steps (prmt's selector, the shift, lop3's mask and or),
  emulated: bfloat16 128 + nibble j of each of two words; less 136, the signed value."""
  rng = np.random.default_rng(0)
  a, b = (rng.integers(0, 2 ** 32, 256, dtype=np.uint64).astype(np.uint32) for _ in range(2))
  src = [(w >> np.uint32(8 * i)) & 0xFF for w in (a, b) for i in range(4)]  # prmt's 8 bytes
  mask, bf16_128 = quant_gemm._PLANE_MASK, quant_gemm._BF16_128  # pylint: disable=protected-access
  for j in range(8):
    sel, shift = quant_gemm._plane_bytes(j)  # pylint: disable=protected-access
    t = sum(src[(sel >> 4 * i) & 7] << np.uint32(8 * i) for i in range(4)).astype(np.uint32)
    t = ((t >> np.uint32(shift)) & np.uint32(mask)) | np.uint32(bf16_128)
    halves = np.stack([t & 0xFFFF, t >> 16]).astype(np.uint16).view(ml_dtypes.bfloat16)
    want = np.stack([(w >> np.uint32(4 * j)) & 0xF for w in (a, b)]).astype(np.float32) - 8
    np.testing.assert_array_equal(halves.astype(np.float32) - 136, want)


def _lower(fn, *args):
  with jax.sharding.use_abstract_mesh(abstract_h200_mesh()):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def _stack_offsets(fmt, experts, grouped):
  """The offset widths ("i32", "i64") of the weight tile loads in the Triton IR of Kimi-K2's
  gate/up (hidden 7168, I 2048) over `experts` experts, lowered for an abstract H200."""
  sds = jax.ShapeDtypeStruct
  h, i = 7168, 2048
  if fmt == "int4":
    w = quant.Int4Experts(sds((experts, h // 8, 2, i), jnp.int32),
                          sds((experts, h // 32, 2, i), BF16), 32)
    pointee = "i32"
  else:
    w = quant.Fp8Experts(sds((experts, h, 2, i), jnp.float8_e4m3fn),
                         sds((experts, h // 128, 2, i // 128), F32), (128, 128))
    pointee = "f8E4M3FN"
  x, ids = sds((64, h), BF16), sds((experts,) if grouped else (64,), jnp.int32)
  if grouped:
    fn = lambda x, w, s: quant_gemm.grouped_matmul(x, w, s, swiglu=True, interpret=False)
  else:
    fn = lambda x, w, g: quant_gemm.pair_matmul(x, w, g, rows_per_lhs=8, swiglu=True,
                                                interpret=False)
  calls = triton_custom_calls(_lower(fn, x, w, ids))
  assert len(calls) == 1
  asm = verify_triton_ir(calls[0])
  if asm is None:  # internal API moved: nothing to read the offsets from
    pytest.skip("the Triton module could not be parsed back")
  assert "tt.dot" in asm and "scf.for" in asm
  return set(re.findall(rf"tensor<\d+x\d+x!tt\.ptr<{pointee}>>, tensor<\d+x\d+x(i\d+)>", asm))


def test_int4_lowers_with_ptx_dequantization_for_bfloat16_only():
  """bfloat16 activations: every nibble plane of both halves through the PTX form; float32: the
  float32 form (no inline assembly)."""
  sds = jax.ShapeDtypeStruct
  w = quant.Int4Experts(sds((4, 32, 2, 64), jnp.int32), sds((4, 8, 2, 64), BF16), 32)
  for dtype, plane_asm in ((BF16, 16), (F32, 0)):
    fn = lambda x, w, g: quant_gemm.pair_matmul(x, w, g, rows_per_lhs=2, swiglu=True,
                                                interpret=False)
    [call] = triton_custom_calls(_lower(fn, sds((4, 256), dtype), w, sds((8,), jnp.int32)))
    asm = verify_triton_ir(call)
    if asm is None:
      pytest.skip("the Triton module could not be parsed back")
    assert asm.count("prmt.b32") == plane_asm


@pytest.mark.parametrize("fmt,grouped", [("int4", False), ("fp8", True)])
def test_stacks_past_4gb_get_64bit_offsets(fmt, grouped):
  """Kimi-K2's 384-expert gate/up stack (5.6 GB packed int4, 11 GB fp8) is indexed with 64-bit
  offsets; a stack of 8 experts with 32-bit ones."""
  assert _stack_offsets(fmt, 384, grouped) == {"i64"}
  assert _stack_offsets(fmt, 8, grouped) == {"i32"}


def test_fp8_stack_of_2_to_4_gib_is_left_to_xla():
  """An e4m3 stack of 2^31 to 2^32 bytes would get 32-bit offsets the GPU sign-extends: the
  kernels refuse it and the ops dispatch to XLA's dequantizing form (shapes only, nothing
  allocated)."""
  sds = jax.ShapeDtypeStruct
  small, window = ((e, 7168, 2048) for e in (8, 200))      # 0.12 GB, 2.9 GB
  stack = lambda shape: quant.Fp8Experts(sds(shape, jnp.float8_e4m3fn),
                                         sds((shape[0], 56, 16), F32), (128, 128))
  assert quant_gemm.supported(stack(small)) and not quant_gemm.supported(stack(window))
  assert moe_ops._kernel_takes(stack(small), BF16)  # pylint: disable=protected-access
  assert not moe_ops._kernel_takes(stack(window), BF16)  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="2\\^31 to 2\\^32"):
    jax.eval_shape(quant_gemm.pair_matmul, sds((8, 7168), BF16), stack(window),
                   sds((8,), jnp.int32))


def _rounded(w):
  """A quantized stack's weights rounded to bfloat16, then float32: what a dequantizer that
  multiplies in bfloat16 writes (compressed-tensors' with Kimi's bfloat16 scales)."""
  return quant.dequantize(w, BF16).astype(F32)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("path", ["xla", "pairs", "sorted", "decode"])
def test_each_format_computes_in_the_dtype_asked(fmt, path):
  """INT4 in groups of 32 and FP8 in 128x128 blocks, through XLA's form, the pair and sorted
  kernels and the decode kernel: float32 activations give the float32 dequantized layer to
  1e-5, a tolerance that weights rounded to bfloat16 miss by 10x or more (so a bfloat16
  product in the float32 path fails it); bfloat16 activations stay within bfloat16's rounding
  of it."""
  key = jax.random.key(11)
  h, e, i, rows = 256, 6, 256, 3
  base = moe.init_params(key, h, e, i, F32, std=0.3)
  w = jax.random.normal(jax.random.fold_in(key, 2), (e, h, 2, i), F32) * 0.3
  d = jax.random.normal(jax.random.fold_in(key, 3), (e, i, h), F32) * 0.3
  pack = ((lambda a: quant.quantize_int4(a, 32)) if fmt == "int4"
          else (lambda a: quant.quantize_fp8(a, (128, 128))))
  params = moe.MoEParams(router=base.router, w_gate_up=pack(w), w_down=pack(d))
  routing = moe.Routing(2, norm_topk_prob=True)
  x = jax.random.normal(jax.random.fold_in(key, 1), (rows, h), F32)
  weights, experts = moe.route(params, x, routing)
  exact = moe.MoEParams(params.router, quant.dequantize(params.w_gate_up, F32),
                        quant.dequantize(params.w_down, F32))
  rounded = moe.MoEParams(params.router, _rounded(params.w_gate_up), _rounded(params.w_down))
  with jax.default_matmul_precision("highest"):
    want = moe.reference(exact, x, weights, experts)
    off = moe.reference(rounded, x, weights, experts)
  scale = float(np.max(np.abs(want)))
  assert float(np.max(np.abs(off - want))) > 1e-4 * scale   # the tolerance tells them apart
  tuning = kernels.KernelTuning(
      moe_decode_quant_max=64 if path == "decode" else 0,
      moe_quant_pair_max=64 if path == "pairs" else 0, moe_pair_blocks=(16, 16, 128),
      moe_launch=((1 << 30, 8, 16, 128),), moe_decode_launch=(16, 128, 4))
  for dtype, rel in ((F32, 1e-5), (BF16, 5e-2)):
    xs = x.astype(dtype)
    if path == "xla":
      got = moe.reference(params, xs, weights.astype(dtype), experts)
    else:
      got = kernels.Kernels("pallas", tuning=tuning).moe(params, xs, routing=routing)
    assert got.dtype == dtype
    _close(got, want, rel)
