"""Pallas (Triton GPU) expert GEMMs whose weights stay quantized in memory: `grouped_matmul` and
`pair_matmul` with `grouped_gemm`'s contracts and tile scheme (tiles that never straddle a group,
from `grouped_gemm.tiles`, or one tile per pair; swiglu fused; float32 accumulators; activations
float32 or bfloat16, the compute dtype; output in lhs's dtype), but rhs a `quant.Int4Experts` or
`quant.Fp8Experts`. Each weight byte is read from HBM once per tile and dequantized in registers:
XLA does not fuse dequantization into its GEMM, so the float stack it would build costs 4x (int4)
or 2x (fp8) the bytes, written and read again.

W4A16 (Int4Experts, compressed-tensors order: nibble j of packed word r is input 8r + j). A K
step loads a tile of block_k / 8 packed words [words, block_n] and runs one dot per nibble plane
j: plane j is inputs 8r + j, so it dots against the activation columns j, j + 8, j + 16, ...,
gathered with index arrays (no in-kernel reshape or interleave, which Pallas's Triton lowering
lacks, and none of the activations permuted in XLA: no extra launch). A plane's dot contracts
over the words, so a tile needs >= 16 words (Triton's least K): block_k >= 128 inputs. The group
of input 8r + j is r // (group_size / 8) for every j (group_size a multiple of 8), so one scale
tile, gathered per word row, serves all 8 planes; it multiplies the weights before the dot (a dot
spans several groups). The weight (nibble - 8) * scale is rounded once to the compute dtype, as
`quant.dequantize` rounds it. With bfloat16 activations on the GPU a plane is dequantized in PTX
(`_int4_plane_asm`: two words a register, packed bfloat16 arithmetic, about half the
instructions of the float32 form); otherwise (float32, interpret mode) in float32, a nibble
turned float without a conversion instruction: its bits or'ed into 2^23's mantissa, less
2^23 + 8. Dequantizing costs more instructions than the bytes take to arrive, so the int4 kernels
run above their bytes floor (about half the bfloat16 kernels' time, not a quarter).

FP8 (Fp8Experts, e4m3 with a float32 scale per block[0] inputs x block[1] outputs). A K step
loads e4m3 tiles of the largest power of two dividing block[0] (at most block_k; several per
step up to block_k), converts them to the compute dtype (exact: e4m3 fits bfloat16), dots each
and scales the float32 product per column by its block's scale: a tile lies in one scale row;
any block[1] (and K or N not a multiple of the block) works, the column scales are gathered.

Options (static): swap computes the tile transposed (the dequantized weights the dot's left
operand); prefetch loads the next step's weight tiles into registers by hand instead of leaving
the loop to Triton's pipeliner (num_stages). The defaults are the faster of each at Kimi-K2's
decode shapes on an H200 (experiments/perf/bench_quant_experts.py --sweep).

Offsets into an operand past 2^32 bytes are 64-bit (Pallas's Triton lowering picks them by the
operand's bytes), so a Kimi-K2 layer's packed int4 stack (~5.5 GB) or a DeepSeek-V3 one in fp8
takes the same kernels. That rule is short for 1-byte elements: an e4m3 stack of 2^31 to 2^32
bytes gets 32-bit element offsets past 2^31, which the GPU sign-extends; such a stack is refused
(`supported`; `moe_ops.expert_ops` / `pair_ops` then run XLA's form).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_jax.models import quant
from ddtree_jax.pallas import grouped_gemm

NIBBLES = quant.NIBBLES
MIN_DOT = 16                 # Triton's least dot dimension
_MAGIC = 0x4B000000          # float32 bits of 2^23: a nibble or'ed in is 2^23 + nibble
_MAGIC_OFFSET = float(2 ** 23 + quant.INT4_OFFSET)
COMPUTE_DTYPES = (jnp.float32, jnp.bfloat16)
# Triton pipeline stages where the caller names none (the sweep's pick: module docstring)
DEFAULT_STAGES = {quant.Int4Experts: 3, quant.Fp8Experts: 2}


def supported(w, dtype=None) -> bool:
  """Whether these kernels take the quantized stack `w` (an e4m3 stack of 2^31 to 2^32 bytes
  would be indexed with 32-bit offsets that the GPU sign-extends: module docstring), and
  activations of `dtype` where given (float32 or bfloat16: the compute dtypes)."""
  if dtype is not None and jnp.dtype(dtype) not in map(jnp.dtype, COMPUTE_DTYPES):
    return False
  if isinstance(w, quant.Fp8Experts):
    size = w.q.size * jnp.dtype(w.q.dtype).itemsize
    return not 2 ** 31 < size <= 2 ** 32
  return isinstance(w, quant.Int4Experts)


def _pow2_at_most(n: int) -> int:
  return 1 << (max(n, 1).bit_length() - 1)


class Tile:
  """A tile's orientation. Plain: the dot is x [block_m, k] @ w [k, block_n] -> [block_m,
  block_n]. swap: w^T [block_n, k] @ x^T [k, block_m] -> [block_n, block_m], the dequantized
  weights the dot's left operand (the one Triton's wgmma can take from registers) and the few
  rows its narrow side. Loads index with arrays in either order (interpret mode has no strided
  or mixed indexing), so a transposed tile is loaded as such, not transposed in registers."""

  def __init__(self, swap: bool, rows, row_ok, n0, cols, col_ok):
    self.swap, self.rows, self.row_ok = swap, rows, row_ok
    self.n0, self.cols, self.col_ok = n0, cols, col_ok

  def pair(self, a, b):
    """[a, b] index arrays or masks broadcast to the plain [len a, len b] tile or its swap."""
    return (a[None, :], b[:, None]) if self.swap else (a[:, None], b[None, :])

  def x(self, ref, k, k_ok):
    """Activation rows x columns k: [block_m, k] (swap: [k, block_m])."""
    r, c = self.pair(self.rows, k)
    mr, mc = self.pair(self.row_ok, k_ok)
    return plgpu.load(ref.at[r, c], mask=mr & mc, other=0)

  def w(self, ref, g, k0, k_ok, c0, other=0, row=None):
    """Weights (or scales) at rows k0 + arange(len k_ok) (row: each its own row) and columns c0
    + cols: [k, block_n] (swap: [block_n, k])."""
    mk, mc = self.pair(k_ok, self.col_ok)
    size = k_ok.shape[0]
    if not self.swap and row is None:  # (contiguous slices: the float kernels' loads)
      idx = (g, pl.ds(k0, size), pl.ds(c0 + self.n0, self.cols.shape[0]))
    else:
      idx = (g, *self.pair(k0 + jnp.arange(size) if row is None else row, c0 + self.cols))
    return plgpu.load(ref.at[idx], mask=mk & mc, other=other)

  def dot(self, x, w):
    return _dot(w, x) if self.swap else _dot(x, w)

  def per_col(self, v):
    """A [block_n] vector broadcast over the tile's rows."""
    return v[:, None] if self.swap else v[None, :]


_PLANE_MASK = 0x000F000F   # bits 0-3 and 16-19: a nibble in each 16-bit half
_BF16_128 = 0x43004300     # bfloat16 128 in each half: 128 + nibble once the nibble is or'ed in


def _plane_bytes(j: int) -> tuple[int, int]:
  """(prmt selector, right shift) that bring nibble j of two words a, b to bits 0-3 (a's) and
  16-19 (b's): byte j // 2 of a to bytes 0 and 1, of b to bytes 2 and 3, then an odd nibble
  down by 4."""
  b = j // 2
  return b | b << 4 | (4 + b) << 8 | (4 + b) << 12, 4 * (j % 2)


def _int4_plane_asm(packed, scale, j: int):
  """bfloat16 (nibble j of packed - 8) * scale in PTX, two words at a time: the nibble of both
  into one register (prmt, shr), or'ed into bfloat16 128's mantissa (lop3), less 136, times the
  scales (two packed bfloat16 FMAs; the first is exact, the second rounds once, as
  `quant.dequantize` does): about 2.5 instructions a weight where the float32 form takes 5."""
  sel, shift = _plane_bytes(j)
  asm = ("{ .reg .b32 t, one, off, nz; mov.b32 one, 0x3F803F80; mov.b32 off, 0xC308C308; "
         f"mov.b32 nz, 0x80008000; prmt.b32 t, $1, $2, {sel:#06x}; "
         + (f"shr.b32 t, t, {shift}; " if shift else "")
         + f"lop3.b32 t, t, {_PLANE_MASK:#010x}, {_BF16_128:#010x}, 0xEA; "   # (t & m) | c
         "fma.rn.bf16x2 t, t, one, off; fma.rn.bf16x2 $0, t, $3, nz; }")
  [out] = plgpu.elementwise_inline_asm(
      asm, args=[packed, scale], constraints="=r,r,r,r", pack=2,
      result_shape_dtypes=[jax.ShapeDtypeStruct(packed.shape, jnp.bfloat16)])
  return out


def int4_step(refs, g, tile, halves, *, block_k, k_dim, group_words, asm, **_):
  """The int4 K step as (load, compute): block_k packed words and their scales per output half,
  then 8 nibble-plane dots per half (asm: each plane dequantized by `_int4_plane_asm`)."""
  x_ref, w_ref, s_ref = refs

  def words(i):
    word = i * block_k + jnp.arange(block_k)
    return word, word < k_dim

  def load(i):
    word, ok = words(i)
    group = jnp.minimum(word, k_dim - 1) // group_words   # each word's scale group
    return ([tile.w(w_ref, g, i * block_k, ok, c0) for c0 in halves],
            [tile.w(s_ref, g, i * block_k, ok, c0, row=group) for c0 in halves])

  def compute(i, tiles, accs):
    (packed, scale), accs = tiles, list(accs)
    word, ok = words(i)
    if asm:
      scale = [s.astype(jnp.bfloat16) for s in scale]
    else:
      scale = [s.astype(jnp.float32) for s in scale]
    for j in range(NIBBLES):
      x = tile.x(x_ref, NIBBLES * word + j, ok)   # inputs 8r + j of this tile's words r
      for h, p in enumerate(packed):
        if asm:
          w = _int4_plane_asm(p, scale[h], j)
        else:
          nibble = ((p >> (4 * j)) if j else p) & 0xF
          q = lax.bitcast_convert_type(nibble | _MAGIC, jnp.float32) - _MAGIC_OFFSET
          w = (q * scale[h]).astype(x.dtype)
        accs[h] = accs[h] + tile.dot(x, w)
    return tuple(accs)
  return load, compute


def fp8_step(refs, g, tile, halves, *, n_dim, block_k, subs, k_dim, scale_block, scale_cols,
              **_):
  """The fp8 K step as (load, compute): `subs` e4m3 tiles of block_k inputs (each in one scale
  row) and their column scales per output half, then a dot per tile scaled per column."""
  x_ref, w_ref, s_ref = refs
  bk, bn = scale_block
  scol = jnp.minimum(tile.cols, n_dim - 1) // bn   # each column's scale block
  zero = jnp.zeros((), w_ref.dtype)

  def inputs(i, u):
    k0 = (i * subs + u) * block_k
    k = k0 + jnp.arange(block_k)
    return k0, k, k < k_dim

  def load(i):
    out = []
    for u in range(subs):
      k0, _, ok = inputs(i, u)
      srow = jnp.minimum(k0, k_dim - 1) // bk
      out.append([(tile.w(w_ref, g, k0, ok, c0, other=zero),
                   plgpu.load(s_ref.at[g, srow, scol + h * scale_cols], mask=tile.col_ok,
                              other=0)) for h, c0 in enumerate(halves)])
    return out

  def compute(i, tiles, accs):
    accs = list(accs)
    for u, per_half in enumerate(tiles):
      _, k, ok = inputs(i, u)
      x = tile.x(x_ref, k, ok)
      for h, (q, s) in enumerate(per_half):
        accs[h] = accs[h] + tile.dot(x, q.astype(x.dtype)) * tile.per_col(s)
    return tuple(accs)
  return load, compute


def _dot(a, b):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _kernel(*refs, step_fn, block_m, block_n, span, k_steps, n_dim, swiglu, pair_div, swap,
            prefetch, **meta):
  """One tile (`grouped_gemm._kernel`'s scheme) over quantized weights: rows [r0, r0 + rows) of
  x times group g's dequantized weights, written from row out0 (pair_div: pair t, x's row
  t // pair_div)."""
  if pair_div:
    group_ref, rows_ref, *ops, o_ref = refs
  else:
    group_ref, row0_ref, rows_ref, out0_ref, *ops, o_ref = refs
  t = pl.program_id(0)  # (program ids outside the `when`: interpret mode)
  rows, n0 = rows_ref[()], pl.program_id(1) * span

  @pl.when(rows > 0)
  def _():
    g = group_ref[()]
    r0, o0 = (t // pair_div, t) if pair_div else (row0_ref[()], out0_ref[()])
    row_ok = jnp.arange(block_m) < rows
    cols = n0 + jnp.arange(block_n)
    col_ok = (jnp.arange(block_n) < span) & (cols < n_dim)
    tile = Tile(swap, r0 + jnp.arange(block_m), row_ok, n0, cols, col_ok)
    # swiglu: columns [0, N) of the stack are the gate, [N, 2N) the up projection
    halves = (0, n_dim) if swiglu else (0,)
    load, compute = step_fn(ops, g, tile, halves, n_dim=n_dim, **meta)
    zero = jnp.zeros((block_n, block_m) if swap else (block_m, block_n), jnp.float32)
    accs = (zero,) * len(halves)
    if prefetch:
      # the next step's weight tiles load (into registers) while this one's compute: the
      # loads stay in flight whether or not Triton's pipeliner takes this loop
      def body(i, carry):
        accs, tiles = carry
        upcoming = load(i + 1)  # (past the last step: all masked, nothing read)
        return compute(i, tiles, accs), upcoming
      # (a traced first step: its slices may run past K, masked, which static ones may not)
      accs, _ = lax.fori_loop(0, k_steps, body, (accs, load(t * 0)))
    else:
      accs = lax.fori_loop(0, k_steps, lambda i, accs: compute(i, load(i), accs), accs)
    out = jax.nn.silu(accs[0]) * accs[1] if swiglu else accs[0]
    r, c = tile.pair(o0 + jnp.arange(block_m), cols)
    mr, mc = tile.pair(row_ok, tile.col_ok)
    plgpu.store(o_ref.at[r, c], out.astype(o_ref.dtype), mask=mr & mc)


def operands(lhs, rhs, swiglu: bool, block_k: int, asm: bool, name: str):
  """(weights [E, K', N'], scales [E, ., N''], k_steps, n_dim, step_fn, its static meta): the
  stack flattened to 2-D per expert (gate | up side by side with swiglu), shapes checked."""
  if not supported(rhs):
    raise ValueError(f"{name}: rhs must be a quant.Int4Experts or a quant.Fp8Experts whose e4m3 "
                     f"stack is not 2^31 to 2^32 bytes (module docstring), got {type(rhs)}")
  if lhs.ndim != 2 or jnp.dtype(lhs.dtype) not in map(jnp.dtype, COMPUTE_DTYPES):
    raise ValueError(f"{name}: lhs must be [M, K] float32 or bfloat16, got {lhs.shape} "
                     f"{lhs.dtype}")
  shape = rhs.shape
  want = 4 if swiglu else 3
  if len(shape) != want or (swiglu and shape[2] != 2):
    raise ValueError(f"{name}(swiglu={swiglu}): rhs must be "
                     f"{'[E, K, 2, N]' if swiglu else '[E, K, N]'}, got {shape}")
  if shape[1] != lhs.shape[1]:
    raise ValueError(f"{name}: lhs {lhs.shape}, rhs {shape} do not match")
  flat = lambda a: a.reshape(a.shape[0], a.shape[1], -1)
  n_dim = shape[-1]
  if isinstance(rhs, quant.Int4Experts):
    gs = rhs.group_size
    if gs % NIBBLES or shape[1] % gs or rhs.scale.shape[1] * gs != shape[1]:
      raise ValueError(f"{name}: int4 group_size {gs} must be a multiple of {NIBBLES} dividing "
                       f"K={shape[1]} (scale {rhs.scale.shape})")
    words = max(block_k // NIBBLES, MIN_DOT)
    if words & (words - 1):
      raise ValueError(f"{name}: int4 block_k {block_k} must be a power of two")
    k_words = shape[1] // NIBBLES
    # (the PTX form: bfloat16 activations on the GPU, bfloat16 scales)
    asm = asm and lhs.dtype == jnp.bfloat16 and rhs.scale.dtype == jnp.bfloat16
    meta = dict(block_k=words, k_dim=k_words, group_words=gs // NIBBLES, asm=asm)
    return (flat(rhs.packed), flat(rhs.scale), -(-k_words // words), n_dim, int4_step, meta)
  bk, bn = rhs.block
  step_k = min(_pow2_at_most(block_k), bk & -bk)  # a power of two dividing bk
  subs = max(1, _pow2_at_most(block_k) // step_k)  # tiles per step: block_k inputs in all
  if step_k < MIN_DOT:
    raise ValueError(f"{name}: fp8 block {rhs.block}: block[0] needs a power-of-two divisor "
                     f">= {MIN_DOT} (a K step must lie in one scale row)")
  scale_cols = -(-n_dim // bn)
  want_scale = (shape[0], -(-shape[1] // bk)) + shape[2:-1] + (scale_cols,)
  if tuple(rhs.scale.shape) != want_scale:
    raise ValueError(f"{name}: fp8 scale {rhs.scale.shape} does not fit q {shape} in blocks "
                     f"{rhs.block} ({want_scale})")
  meta = dict(block_k=step_k, subs=subs, k_dim=shape[1], scale_block=(bk, bn),
              scale_cols=scale_cols)
  return (flat(rhs.q), flat(rhs.scale).astype(jnp.float32), -(-shape[1] // (step_k * subs)),
          n_dim, fp8_step, meta)


def _launch(group, rows, lhs, rhs, m_out, *, row0=None, out0=None, pair_div=0, block_m,
            block_n, block_k, num_warps, num_stages, swiglu, swap, prefetch, asm, interpret,
            name, span=None):
  """The tiles' pallas_call: lhs [M, K], rhs quantized [E, K, N] (swiglu [E, K, 2, N]) ->
  [m_out, N]; per tile its group and rows, and its first row and output row or pair_div."""
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  if num_stages is None:
    num_stages = DEFAULT_STAGES[type(rhs)]
  w, s, k_steps, n_dim, step_fn, meta = operands(lhs, rhs, swiglu, block_k,
                                                  asm and not interpret, name)
  span = grouped_gemm.check_span(span, block_n)
  per_tile = (group, rows) if pair_div else (group, row0, rows, out0)
  scalar = pl.BlockSpec((None,), lambda t, n: (t,))
  whole = lambda shape: pl.BlockSpec(shape, lambda t, n: (0,) * len(shape))
  return pl.pallas_call(
      functools.partial(_kernel, step_fn=step_fn, block_m=block_m, block_n=block_n, span=span,
                        k_steps=k_steps, n_dim=n_dim, swiglu=swiglu, pair_div=pair_div,
                        swap=swap, prefetch=prefetch, **meta),
      grid=(group.shape[0], pl.cdiv(n_dim, span)),
      in_specs=[scalar] * len(per_tile) + [whole(a.shape) for a in (lhs, w, s)],
      out_specs=whole((m_out, n_dim)),
      out_shape=jax.ShapeDtypeStruct((m_out, n_dim), lhs.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=f"{name}_{'int4' if isinstance(rhs, quant.Int4Experts) else 'fp8'}",
  )(*per_tile, lhs, w, s)


_STATIC = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "swiglu", "swap",
           "prefetch", "asm", "interpret")


def _experts(rhs) -> int:
  return rhs.shape[0]


@functools.partial(jax.jit, static_argnames=_STATIC)
def grouped_matmul(lhs, rhs, group_sizes, *, block_m: int = 16, block_n: int = 128,
                   block_k: int = 128, num_warps: int = 4, num_stages: int | None = None,
                   swiglu: bool = False, swap: bool = False, prefetch: bool = False,
                   asm: bool = True, interpret=None):
  """`grouped_gemm.grouped_matmul` over a quantized stack: lhs [M, K] float32 or bfloat16, rhs
  Int4Experts / Fp8Experts of float shape [E, K, N] (swiglu: [E, K, 2, N] -> silu(gate) * up),
  group_sizes [E] (summing to at most M) -> [M, N] in lhs's dtype; rows past sum(group_sizes)
  are not written. block_k: inputs per K step (int4: a power of two, at least 128, since a nibble
  plane's dot needs 16 words; fp8: rounded down to a power of two, in tiles of the largest one
  dividing block[0]). num_stages None: DEFAULT_STAGES; swap, prefetch: the module docstring;
  asm: int4 planes dequantized in PTX where that applies (bfloat16 activations on the GPU)."""
  if group_sizes.shape != (_experts(rhs),):
    raise ValueError(f"grouped_matmul: lhs {lhs.shape}, rhs {rhs.shape}, group_sizes "
                     f"{group_sizes.shape} do not match")
  group, row0, rows = grouped_gemm.tiles(group_sizes, lhs.shape[0], block_m)
  return _launch(group, rows, lhs, rhs, lhs.shape[0], row0=row0, out0=row0, block_m=block_m,
                 block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                 swiglu=swiglu, swap=swap, prefetch=prefetch, asm=asm, interpret=interpret,
                 name="grouped_matmul")


@functools.partial(jax.jit, static_argnames=_STATIC + ("rows_per_lhs", "span"))
def pair_matmul(lhs, rhs, groups, *, here=None, rows_per_lhs: int = 1, block_m: int = 16,
                block_n: int = 64, block_k: int = 256, num_warps: int = 4,
                num_stages: int | None = None, swiglu: bool = False, swap: bool = False,
                prefetch: bool = False, asm: bool = True, span: int | None = None,
                interpret=None):
  """`grouped_gemm.pair_matmul` over a quantized stack: lhs [M, K], rhs as grouped_matmul's,
  groups [P] int -> [P, N], row p = lhs[p // rows_per_lhs] @ rhs[groups[p]]; a pair of group E
  (held elsewhere) is not computed and its row is undefined; here as
  `grouped_gemm.pair_matmul`'s, and span. Launch options as grouped_matmul's."""
  e = _experts(rhs)
  if groups.ndim != 1 or rows_per_lhs < 1 or -(-groups.shape[0] // rows_per_lhs) > lhs.shape[0]:
    raise ValueError(f"pair_matmul: groups {groups.shape} with rows_per_lhs={rows_per_lhs} do "
                     f"not fit lhs {lhs.shape}")
  if here is None:
    here = (groups < e).astype(jnp.int32)
    groups = jnp.minimum(groups, e - 1)
  return _launch(groups.astype(jnp.int32), here.astype(jnp.int32), lhs, rhs, groups.shape[0],
                 pair_div=rows_per_lhs, block_m=block_m, block_n=block_n, block_k=block_k,
                 num_warps=num_warps, num_stages=num_stages, swiglu=swiglu, swap=swap,
                 prefetch=prefetch, asm=asm, interpret=interpret, name="pair_matmul", span=span)
