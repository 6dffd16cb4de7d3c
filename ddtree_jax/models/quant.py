"""Expert stacks kept quantized on the device: what a mixture-of-experts layer reads each step is
its experts' bytes, so the format the checkpoint ships in (4 or 8 bits a weight) stays the format
in memory and the GEMM dequantizes. Three formats, each as published:

  Int4Experts  compressed-tensors `pack-quantized` W4A16 (Kimi K2.5 / K2.6): symmetric int4 in
               groups of `group_size` inputs, one scale per group and output channel.
  Fp8Experts   DeepSeek-V3's block-quantized FP8 (e4m3, one float32 scale per block of
               block[0] inputs x block[1] outputs).
  Mxfp4Experts gpt-oss's MXFP4 (OCP microscaling: e2m1 values two to a byte, one e8m0 exponent
               per block of 32 inputs).

A stack is [E, K, out...] like a float expert stack (K the contracted input dim: H for gate/up,
I for down; out... = (2, I) for gate/up, (H,) for down), so every leaf has the experts on axis 0
and a shard of experts is a slice of each leaf. `dequantize` is the reference every kernel is
checked against. A leaf: it imports nothing from the package.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

Array = jax.Array

INT4_OFFSET = 8   # stored nibble = value + 8 (compressed-tensors' unsigned packing)
NIBBLES = 8       # int4 values per int32 word


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int4Experts:
  """w[e, k, o...] = (nibble(k) - 8) * scale[e, k // group_size, o...], nibble(k) = bits
  4j..4j+3 of packed[e, k // 8, o...] with j = k % 8 (the lowest bits first, as on disk)."""
  packed: Array            # int32 [E, K/8, out...]
  scale: Array             # [E, K/group_size, out...] (bfloat16 as shipped)
  group_size: int = dataclasses.field(metadata=dict(static=True), default=32)

  @property
  def shape(self) -> tuple[int, ...]:
    """The float stack's shape [E, K, out...]."""
    s = self.packed.shape
    return (s[0], s[1] * NIBBLES) + tuple(s[2:])

  def with_leaves(self, fn) -> Int4Experts:
    return Int4Experts(packed=fn(self.packed), scale=fn(self.scale), group_size=self.group_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Fp8Experts:
  """w[e, k, o..., n] = q[e, k, o..., n] * scale[e, k // block[0], o..., n // block[1]]."""
  q: Array                 # float8_e4m3fn [E, K, out...]
  scale: Array             # float32 [E, ceil(K / block[0]), out[:-1]..., ceil(N / block[1])]
  block: tuple[int, int] = dataclasses.field(metadata=dict(static=True), default=(128, 128))

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.q.shape)

  def with_leaves(self, fn) -> Fp8Experts:
    return Fp8Experts(q=fn(self.q), scale=fn(self.scale), block=self.block)


# e2m1 by its 4 bits (sign, 2 exponent bits, 1 mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # inputs per e8m0 scale
E8M0_BIAS = 127


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Mxfp4Experts:
  """w[e, k, o...] = FP4_VALUES[nibble(k)] * 2 ** (scales[e, k // 32, o...] - 127), nibble(k)
  the low 4 bits of blocks[e, k // 2, o...] for even k, the high 4 for odd k (as gpt-oss ships
  them, the contracted dim moved before the outputs)."""
  blocks: Array            # uint8 [E, K/2, out...]
  scales: Array            # uint8 [E, K/32, out...]

  @property
  def shape(self) -> tuple[int, ...]:
    s = self.blocks.shape
    return (s[0], s[1] * 2) + tuple(s[2:])

  def with_leaves(self, fn) -> Mxfp4Experts:
    return Mxfp4Experts(blocks=fn(self.blocks), scales=fn(self.scales))


QUANTIZED = (Int4Experts, Fp8Experts, Mxfp4Experts)


def is_quantized(w) -> bool:
  return isinstance(w, QUANTIZED)


def _repeat_crop(s, repeats: int, axis: int, size: int):
  return jax.lax.slice_in_dim(jnp.repeat(s, repeats, axis=axis), 0, size, axis=axis)


def unpack_int4(packed):
  """int32 words [E, K/8, out...] -> the signed int4 values [E, K, out...] as int8."""
  shifts = (4 * jnp.arange(NIBBLES, dtype=jnp.int32)).reshape((1, 1, NIBBLES)
                                                                + (1,) * (packed.ndim - 2))
  nibbles = (packed[:, :, None] >> shifts) & 0xF          # arithmetic shift; the mask drops sign
  s = packed.shape
  return (nibbles.reshape((s[0], s[1] * NIBBLES) + tuple(s[2:])) - INT4_OFFSET).astype(jnp.int8)


def e8m0_scale(scales):
  """uint8 e8m0 exponents -> float32 2 ** (s - 127), exactly (the float32 with those exponent
  bits; s = 0 is the subnormal 2 ** -127, s = 255 gives inf, as HF's ldexp)."""
  s = scales.astype(jnp.int32)
  normal = jax.lax.bitcast_convert_type(s << 23, jnp.float32)
  return jnp.where(s == 0, jnp.float32(2.0 ** -127), normal)


def unpack_fp4(blocks):
  """uint8 [E, K/2, out...] -> the e2m1 values [E, K, out...] float32 (low nibble first)."""
  lut = jnp.asarray(FP4_VALUES, jnp.float32)
  pair = jnp.stack([lut[blocks & 0xF], lut[blocks >> 4]], axis=2)   # [E, K/2, 2, out...]
  s = blocks.shape
  return pair.reshape((s[0], s[1] * 2) + tuple(s[2:]))


def dequantize(w, dtype):
  """The float stack [E, K, out...] in `dtype` (a float array passes through, cast): products
  formed in float32, then cast once."""
  if isinstance(w, Mxfp4Experts):
    scale = jnp.repeat(e8m0_scale(w.scales), MXFP4_BLOCK, axis=1)
    return (unpack_fp4(w.blocks) * scale).astype(dtype)
  if isinstance(w, Int4Experts):
    q = unpack_int4(w.packed).astype(jnp.float32)
    scale = jnp.repeat(w.scale.astype(jnp.float32), w.group_size, axis=1)
    return (q * scale).astype(dtype)
  if isinstance(w, Fp8Experts):
    k, n = w.q.shape[1], w.q.shape[-1]
    scale = _repeat_crop(w.scale.astype(jnp.float32), w.block[0], 1, k)
    scale = _repeat_crop(scale, w.block[1], scale.ndim - 1, n)
    return (w.q.astype(jnp.float32) * scale).astype(dtype)
  return w.astype(dtype)


def take(w, idx):
  """Experts idx [...] of a stack (float or quantized): every leaf indexed on axis 0."""
  if is_quantized(w):
    return w.with_leaves(lambda a: a[idx])
  return w[idx]


def split_sizes(w, axis: int) -> tuple[int, ...]:
  """Every leaf's size along `axis`: what a mesh axis that splits this dim of the float stack
  must divide (for a quantized stack also its packed words and its scale groups or blocks)."""
  if not is_quantized(w):
    return (w.shape[axis],)
  return tuple(a.shape[axis] for a in jax.tree.leaves(w))


def spec_like(w, spec):
  """One PartitionSpec for every leaf of a stack (their axes correspond one to one)."""
  return w.with_leaves(lambda _: spec) if is_quantized(w) else spec


# ------------------------------------------------------------ quantizing (tests, benchmarks)


def quantize_int4(w, group_size: int = 32) -> Int4Experts:
  """A float stack [E, K, out...] as symmetric int4 in groups of group_size inputs (scale
  max|w| / 7 per group and output, bfloat16), packed as compressed-tensors packs it."""
  w = jnp.asarray(w, jnp.float32)
  e, k = w.shape[:2]
  if k % group_size or group_size % NIBBLES:
    raise ValueError(f"quantize_int4: K={k} must be a multiple of group_size={group_size}, "
                     f"itself a multiple of {NIBBLES}")
  g = w.reshape((e, k // group_size, group_size) + w.shape[2:])
  amax = jnp.max(jnp.abs(g), axis=2)
  scale = jnp.where(amax > 0, amax / 7.0, 1.0).astype(jnp.bfloat16)
  q = jnp.clip(jnp.round(g / scale.astype(jnp.float32)[:, :, None]), -8, 7).astype(jnp.int32)
  return Int4Experts(packed=pack_int4(q.reshape(w.shape)), scale=scale, group_size=group_size)


def pack_int4(q):
  """Signed int4 values [E, K, out...] (ints in [-8, 7]) -> int32 words [E, K/8, out...]."""
  q = (jnp.asarray(q).astype(jnp.int32) + INT4_OFFSET).astype(jnp.uint32)
  s = q.shape
  q = (q & 0xF).reshape((s[0], s[1] // NIBBLES, NIBBLES) + tuple(s[2:]))
  shifts = (4 * jnp.arange(NIBBLES, dtype=jnp.uint32)).reshape((1, 1, NIBBLES)
                                                                 + (1,) * (len(s) - 2))
  return jax.lax.bitcast_convert_type(jnp.sum(q << shifts, axis=2, dtype=jnp.uint32), jnp.int32)


def quantize_fp8(w, block: tuple[int, int] = (128, 128)) -> Fp8Experts:
  """A float stack [E, K, out...] as e4m3 in blocks of block[0] inputs x block[1] outputs of the
  last dim (scale max|w| / 448 per block, float32), as DeepSeek-V3 ships its weights."""
  w = jnp.asarray(w, jnp.float32)
  k, n = w.shape[1], w.shape[-1]
  kb, nb = -(-k // block[0]), -(-n // block[1])
  pad = [(0, 0), (0, kb * block[0] - k)] + [(0, 0)] * (w.ndim - 3) + [(0, nb * block[1] - n)]
  p = jnp.pad(w, pad)
  blocks = p.reshape(p.shape[:1] + (kb, block[0]) + p.shape[2:-1] + (nb, block[1]))
  amax = jnp.max(jnp.abs(blocks), axis=(2, blocks.ndim - 1))
  scale = jnp.where(amax > 0, amax / float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max), 1.0)
  full = _repeat_crop(_repeat_crop(scale, block[0], 1, k), block[1], scale.ndim - 1, n)
  return Fp8Experts(q=(w / full).astype(jnp.float8_e4m3fn), scale=scale, block=tuple(block))


def random_int4(key, shape, group_size: int = 32, std: float = 0.02) -> Int4Experts:
  """Random packed int4 experts of float shape [E, K, out...] with scales near std / 3
  (benchmarks: the real format's bytes without a float copy of the stack)."""
  e, k = shape[:2]
  k1, k2 = jax.random.split(key)
  words = jax.random.bits(k1, (e, k // NIBBLES) + tuple(shape[2:]), jnp.uint32)
  scale = (std / 3) * (1 + 0.1 * jax.random.normal(k2, (e, k // group_size) + tuple(shape[2:])))
  return Int4Experts(packed=jax.lax.bitcast_convert_type(words, jnp.int32),
                     scale=scale.astype(jnp.bfloat16), group_size=group_size)


def random_fp8(key, shape, block: tuple[int, int] = (128, 128), std: float = 0.02) -> Fp8Experts:
  """Random e4m3 experts of float shape [E, K, out...] with block scales near std / 2."""
  k, n = shape[1], shape[-1]
  k1, k2 = jax.random.split(key)
  q = (2 * jax.random.normal(k1, shape, jnp.float32)).astype(jnp.float8_e4m3fn)
  sshape = (shape[0], -(-k // block[0])) + tuple(shape[2:-1]) + (-(-n // block[1]),)
  scale = (std / 2) * (1 + 0.1 * jax.random.normal(k2, sshape, jnp.float32))
  return Fp8Experts(q=q, scale=scale, block=tuple(block))


def host_int4_dequantize(packed: np.ndarray, scale: np.ndarray, group_size: int) -> np.ndarray:
  """One Linear's weight [out, in] in float32 from compressed-tensors' packed [out, in/8] int32
  and scale [out, in/group_size] (a layer the engine keeps in float: read on the host)."""
  words = np.asarray(packed, np.int32).view(np.uint32)
  nib = (words[:, :, None] >> (4 * np.arange(NIBBLES, dtype=np.uint32))) & 0xF
  q = nib.reshape(words.shape[0], -1).astype(np.float32) - INT4_OFFSET
  return q * np.repeat(np.asarray(scale, np.float32), group_size, axis=1)
