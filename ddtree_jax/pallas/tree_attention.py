"""Pallas (Triton GPU) kernel for tree attention over a cached prefix: split-K flash decoding.

Same contract as ``ddtree_jax.models.attention.attend_xla``: every query token sees the cached prefix rows
``[0, prefix_len[b])`` of its own sequence plus the new tokens its row of ``new_mask`` allows. One
kernel serves prefill, AR decode (T=1), tree verification (T = budget+1) and the drafter block.

Layout of the work
------------------
* One program handles one KV head ``h`` of one sequence ``b`` and a block of ``block_t`` new tokens.
  Its query rows are those tokens times the ``G = Hq / Hkv`` query heads that share ``h`` (row
  ``t * Gp + g``; ``Gp`` = G rounded up to a power of two), so the prefix K/V of ``h`` is read once
  for all of them. The flash-decoding trick: queries of one sequence share the prefix, so the
  ``[T, prefix]`` mask is never materialised; the prefix is masked by ``prefix_len`` alone.
* The keys are cut into ``num_splits`` equal runs of blocks (split-K): the valid prefix's blocks of
  ``block_k`` keys, then the new keys' blocks of ``block_n`` (under ``new_mask``). So a short prefix
  in a large cache costs little, a long prefix is spread over many SMs, and the new keys are one
  more share of the work rather than extra work for one split. Each split walks its blocks (loops
  whose trip counts depend on ``prefix_len``) with an online softmax in float32.
* Each split writes a normalised partial output and its log-sum-exp; ``merge_splits`` (one XLA
  loop fusion, elementwise over the splits) combines them.
  With one split the kernel writes the final output directly.

Grid: ``(row_blocks, num_splits, B, Hkv)``. The row-block axis varies fastest in launch order, so
the programs that read the same K/V chunk run together and share it through L2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_jax.pallas.tuning import DEFAULT_SM_COUNT, KernelTuning

NEG_INF = -1e30  # finite, so fully masked rows never produce inf - inf = NaN
LOG2_E = 1.4426950408889634  # scores are kept in base 2 in the kernel: exp2 is the fast path


def _next_pow2(x: int) -> int:
  return 1 << max(0, int(x) - 1).bit_length()


def _and(*masks):
  """AND of the masks that are not None (None = all True); None if all are None."""
  masks = [m for m in masks if m is not None]
  if not masks:
    return None
  out = masks[0]
  for m in masks[1:]:
    out = out & m
  return out


def _cdiv(a, b: int):
  """Ceil division of a non-negative traced int32 by a static positive int."""
  return lax.div(a + (b - 1), jnp.int32(b))


def split_blocks(split, prefix_blocks, new_blocks, num_splits):
  """Split `split`'s share of the key blocks: the prefix's blocks [0, P) then the new keys' [0, N),
  counted as one run [0, P + N) cut into num_splits equal parts (the last ones may be short or
  empty). Returns (prefix_lo, prefix_hi, new_lo, new_hi), each range possibly empty."""
  total = prefix_blocks + new_blocks
  per_split = _cdiv(total, num_splits)
  lo = jnp.minimum(split * per_split, total)
  hi = jnp.minimum(lo + per_split, total)
  return (jnp.minimum(lo, prefix_blocks), jnp.minimum(hi, prefix_blocks),
          jnp.maximum(lo, prefix_blocks) - prefix_blocks,
          jnp.maximum(hi, prefix_blocks) - prefix_blocks)


def _online_softmax_step(carry, scores, v, visible=None):
  """One flash step. scores [R, K] f32 in log2 units (masked = NEG_INF), v [K, Dp]; carry (m, l, acc)."""
  m, l, acc = carry
  m_new = jnp.maximum(m, scores.max(axis=1))
  alpha = jnp.exp2(m - m_new)
  p = jnp.exp2(scores - m_new[:, None])
  if visible is not None:  # a row may see nothing in this block: zero it explicitly
    p = jnp.where(visible, p, 0.0)
  l = alpha * l + p.sum(axis=1)
  pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                       preferred_element_type=jnp.float32)
  return m_new, l, acc * alpha[:, None] + pv


def _qk(q, k, scale):
  """q [R, Dp] . k [K, Dp]^T -> [R, K] float32 scores times `scale` (softmax scale * log2 e)."""
  s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  return s * scale


def _kernel(plen_ref, layer_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref, *out_refs,
            scale, t_len, g, gp, d, dp, cap, block_t, block_k, block_n, num_splits, stacked):
  """One (row block, split, batch, kv head) program.

  Refs (batch and kv head already selected by the BlockSpecs):
    plen_ref [] int32; layer_ref [] int32; q_ref [T, G, D]; k_ref, v_ref [S, D] (or, when
    `stacked`, [L, S, D]: every layer, layer_ref picks one); kn_ref, vn_ref [T, D]; mask_ref [T, T]
    outputs: o_ref [T, G, D] (plus lse_ref [T, G] float32 when num_splits > 1).
  """
  # The layer is a runtime index, so every layer runs the same kernel (one compile, not L). Triton
  # loads take one indexer, hence the layer goes into the same .at[] as the key block.
  layer = layer_ref[()]
  prefix_rows = lambda ref, start: ref.at[(layer,) * stacked + (pl.ds(start, block_k), pl.ds(0, dp))]
  r, split = pl.program_id(0), pl.program_id(1)
  rows = block_t * gp
  t0 = r * block_t
  t_ok = (t0 + jnp.arange(block_t)) < t_len                      # [block_t]
  g_ok = (jnp.arange(gp) < g) if gp != g else None                # [Gp]
  d_ok = (jnp.arange(dp) < d) if dp != d else None                # [Dp]
  d_ok2 = None if d_ok is None else d_ok[None, :]

  q_mask = _and(t_ok[:, None, None], None if g_ok is None else g_ok[None, :, None],
                None if d_ok is None else d_ok[None, None, :])
  q = plgpu.load(q_ref.at[pl.ds(t0, block_t), pl.ds(0, gp), pl.ds(0, dp)], mask=q_mask, other=0)
  q = q.reshape(rows, dp)

  carry = (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
           jnp.zeros((rows, dp), jnp.float32))

  # ---- this split's share of the key blocks ----
  plen = jnp.clip(plen_ref[()], 0, cap)
  prefix_lo, prefix_hi, new_lo, new_hi = split_blocks(split, _cdiv(plen, block_k),
                                                      pl.cdiv(t_len, block_n), num_splits)

  def prefix_block(i, carry):
    # One loop with masked loads everywhere: an unmasked loop over the full blocks plus a masked
    # tail was tried, and was slower on the H200.
    start = i * block_k
    key_ok = (start + jnp.arange(block_k)) < plen                 # [block_k]
    kv_mask = _and(key_ok[:, None], d_ok2)
    k = plgpu.load(prefix_rows(k_ref, start), mask=kv_mask, other=0)
    v = plgpu.load(prefix_rows(v_ref, start), mask=kv_mask, other=0)
    scores = jnp.where(key_ok[None, :], _qk(q, k, scale), NEG_INF)
    # Every entered block has a valid key, so each row's running max is finite afterwards and
    # masked keys get exp2(NEG_INF - m) = 0: no explicit zeroing needed here.
    return _online_softmax_step(carry, scores, v)

  carry = lax.fori_loop(prefix_lo, prefix_hi, prefix_block, carry)

  def new_block(j, carry):
    start = j * block_n
    key_ok = (start + jnp.arange(block_n)) < t_len                # [block_n]
    kv_mask = _and(key_ok[:, None], d_ok2)
    k = plgpu.load(kn_ref.at[pl.ds(start, block_n), pl.ds(0, dp)], mask=kv_mask, other=0)
    v = plgpu.load(vn_ref.at[pl.ds(start, block_n), pl.ds(0, dp)], mask=kv_mask, other=0)
    vis = plgpu.load(mask_ref.at[pl.ds(t0, block_t), pl.ds(start, block_n)],
                     mask=t_ok[:, None] & key_ok[None, :], other=False)  # [block_t, block_n]
    vis = jnp.broadcast_to(vis[:, None, :], (block_t, gp, block_n)).reshape(rows, block_n)
    scores = jnp.where(vis, _qk(q, k, scale), NEG_INF)
    return _online_softmax_step(carry, scores, v, visible=vis)

  m, l, acc = lax.fori_loop(new_lo, new_hi, new_block, carry)

  # ---- write this split's normalised output (and its log-sum-exp) ----
  has_keys = l > 0.0                                              # False for fully masked rows
  o = acc / jnp.where(has_keys, l, 1.0)[:, None]
  o_ref = out_refs[0]
  out_mask = _and(t_ok[:, None, None], None if g_ok is None else g_ok[None, :, None],
                  None if d_ok is None else d_ok[None, None, :])
  plgpu.store(o_ref.at[pl.ds(t0, block_t), pl.ds(0, gp), pl.ds(0, dp)],
              o.reshape(block_t, gp, dp).astype(o_ref.dtype), mask=out_mask)
  if num_splits > 1:
    lse_ref = out_refs[1]
    # Natural-log LSE for the merge (m is in log2 units).
    lse = jnp.where(has_keys, (m + jnp.log2(jnp.where(has_keys, l, 1.0))) / LOG2_E, NEG_INF)
    plgpu.store(lse_ref.at[pl.ds(t0, block_t), pl.ds(0, gp)], lse.reshape(block_t, gp),
                mask=_and(t_ok[:, None], None if g_ok is None else g_ok[None, :]))


def default_config(batch, t_len, hq, hkv, cap, head_dim, *, sm_count=DEFAULT_SM_COUNT):
  """The launch rule: (block_t, block_k, block_n, num_splits, num_warps, num_stages), fitted to
  H200 measurements (experiments/perf/sweep_attention.py; docs/findings/attention-kernel.md)."""
  g = hq // hkv
  gp = _next_pow2(g)
  sm = sm_count
  # Query rows per program: 128 (8 warps) once that still fills about a wave without split-K
  # (big trees at batch > 1 are compute-bound), else up to 64 (4 warps).
  big = t_len * gp * batch * hkv >= 128 * (3 * sm // 4)
  rows = max(16, min(128 if big else 64, _next_pow2(t_len * gp)), gp)
  block_t = rows // gp
  block_k = 128 if rows <= 32 else 64
  block_n = min(block_k, max(16, _next_pow2(t_len)))
  row_blocks = pl.cdiv(t_len, block_t)
  base = row_blocks * batch * hkv
  # Split-K over the key blocks (the new keys' blocks count too, `split_blocks`). Few query rows
  # (decode, drafter block: memory-bound) want about one wave of programs; trees never want one
  # split, two once a split has >= 128 programs, else one full wave (a partial second wave is
  # slow) or chunks of ~1024 keys in long caches, whichever splits more, >= 3 key blocks each.
  key_blocks = pl.cdiv(cap, block_k) + pl.cdiv(t_len, block_n)
  if t_len * g <= 64:
    num_splits = max(1, min(pl.cdiv(sm, base), key_blocks, 64))
  elif base >= 128:
    num_splits = 2
  else:
    num_splits = max(2, min(max(sm // base, cap // 1024), key_blocks // 3, 64))
  num_warps = 4 if rows <= 64 else 8
  num_stages = 2 if block_k * head_dim >= 128 * 128 else 3
  return block_t, block_k, block_n, num_splits, num_warps, num_stages


LAUNCH_NAMES = ("block_t", "block_k", "block_n", "num_splits", "num_warps", "num_stages")


def launch_config(batch, t_len, hq, hkv, cap, head_dim, tuning: KernelTuning = KernelTuning()):
  """`default_config` on the tuning's SM count, with its `tree_launch` parameters replacing the
  rule's for trees (more than 64 query rows per kv head). Returns {LAUNCH_NAMES: value}."""
  cfg = dict(zip(LAUNCH_NAMES, default_config(batch, t_len, hq, hkv, cap, head_dim,
                                              sm_count=tuning.device_sm_count())))
  if tuning.tree_launch and t_len * (hq // hkv) > 64:
    cfg.update(tuning.tree_launch)
    cfg["block_n"] = min(cfg["block_k"], max(16, _next_pow2(t_len)))
  return cfg


@functools.partial(jax.jit, static_argnames=("scale", "layer", "interpret", "block_k", "num_splits",
                                             "block_rows", "num_warps", "num_stages", "tuning"))
def tree_attention(q, k_cache, v_cache, prefix_len, k_new, v_new, new_mask, *, scale, layer=None,
                   interpret=None, block_k=None, num_splits=None, block_rows=None,
                   num_warps=None, num_stages=None, tuning: KernelTuning = KernelTuning()):
  """Masked attention of T new tokens over a cached prefix plus themselves (Pallas/Triton).

  Args:
    q: [B, T, Hq, D] queries (RoPE applied).
    k_cache, v_cache: [B, Hkv, S, D] cached prefix keys/values (S = static capacity), or every
      layer's [L, B, Hkv, S, D] with `layer` the one read (the kernel indexes it in place).
    prefix_len: [B] int32, valid prefix rows per sequence (clamped to [0, S]).
    k_new, v_new: [B, T, Hkv, D] keys/values of the new tokens.
    new_mask: [B, T, T] bool, new_mask[b, i, j]: query i may see new key j.
    scale: softmax scale (static).
    layer: static layer index into 5-D caches (None: 4-D caches).
    interpret: None = interpret mode on a CPU default backend, compiled Triton otherwise.
    block_k: prefix keys per loop step (power of two >= 16); default by shape.
    num_splits: split-K factor over the key blocks (prefix and new); default by shape.
    block_rows: query rows (tokens x padded GQA group) per program, power of two >= 16.
    num_warps, num_stages: Triton launch parameters.
    tuning: the launch rule's SM count and tree override (`launch_config`), and interpret mode
      when `interpret` is None; the arguments above override it.
  Returns:
    [B, T, Hq, D] in q's dtype. Softmax statistics are float32. Rows that see no key give 0.
  """
  b, t_len, hq, d = q.shape
  hkv, cap = k_cache.shape[-3], k_cache.shape[-2]
  if k_cache.ndim != (4 if layer is None else 5) or (
      layer is not None and not 0 <= layer < k_cache.shape[0]):
    raise ValueError(f"caches of shape {k_cache.shape} do not fit layer={layer} "
                     "([B, Hkv, S, D] without a layer, [L, B, Hkv, S, D] with one)")
  if hq % hkv:
    raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv}")
  if not (q.dtype == k_cache.dtype == v_cache.dtype == k_new.dtype == v_new.dtype):
    raise ValueError("q, caches and new keys/values must share one dtype")
  g = hq // hkv
  gp, dp = _next_pow2(g), max(16, _next_pow2(d))

  bt, bk, bn, ns, nw, nst = launch_config(b, t_len, hq, hkv, cap, d, tuning).values()
  if block_rows is not None:
    if block_rows < 16 or block_rows & (block_rows - 1):
      raise ValueError(f"block_rows={block_rows} must be a power of two >= 16")
    bt = max(1, block_rows // gp)
  if block_k is not None:
    if block_k < 16 or block_k & (block_k - 1):
      raise ValueError(f"block_k={block_k} must be a power of two >= 16")
    bk = block_k
    bn = min(bk, max(16, _next_pow2(t_len)))
  ns = ns if num_splits is None else max(1, int(num_splits))
  nw = nw if num_warps is None else num_warps
  nst = nst if num_stages is None else num_stages
  if interpret is None:
    interpret = tuning.interpret
  if interpret is None:
    interpret = jax.default_backend() == "cpu"

  row_blocks = pl.cdiv(t_len, bt)
  kernel = functools.partial(
      _kernel, scale=float(scale) * LOG2_E, t_len=t_len, g=g, gp=gp, d=d, dp=dp, cap=cap,
      block_t=bt, block_k=bk, block_n=bn, num_splits=ns, stacked=layer is not None)

  # Index maps take the grid indices (row block, split, batch, kv head).
  if layer is None:
    cache_spec = pl.BlockSpec((None, None, cap, d), lambda r, s, i, h: (i, h, 0, 0))
  else:
    n_layers = k_cache.shape[0]
    cache_spec = pl.BlockSpec((n_layers, None, None, cap, d), lambda r, s, i, h: (0, i, h, 0, 0))
  in_specs = [
      pl.BlockSpec((None,), lambda r, s, i, h: (i,)),                       # prefix_len
      pl.BlockSpec((None,), lambda r, s, i, h: (0,)),                       # layer
      pl.BlockSpec((None, t_len, g, d), lambda r, s, i, h: (i, 0, h, 0)),   # q: G heads of h
      cache_spec,                                                           # k_cache
      cache_spec,                                                           # v_cache
      pl.BlockSpec((None, t_len, None, d), lambda r, s, i, h: (i, 0, h, 0)),  # k_new
      pl.BlockSpec((None, t_len, None, d), lambda r, s, i, h: (i, 0, h, 0)),  # v_new
      pl.BlockSpec((None, t_len, t_len), lambda r, s, i, h: (i, 0, 0)),     # new_mask
  ]
  if ns == 1:
    out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    out_specs = pl.BlockSpec((None, t_len, g, d), lambda r, s, i, h: (i, 0, h, 0))
  else:
    out_shape = (jax.ShapeDtypeStruct((b, ns, t_len, hq, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, ns, t_len, hq), jnp.float32))
    out_specs = (pl.BlockSpec((None, None, t_len, g, d), lambda r, s, i, h: (i, s, 0, h, 0)),
                 pl.BlockSpec((None, None, t_len, g), lambda r, s, i, h: (i, s, 0, h)))

  out = pl.pallas_call(
      kernel,
      grid=(row_blocks, ns, b, hkv),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=nw, num_stages=nst),
      interpret=interpret,
      name="tree_attention",
  )(prefix_len.astype(jnp.int32), jnp.full((1,), layer or 0, jnp.int32), q, k_cache, v_cache,
    k_new, v_new, new_mask.astype(jnp.bool_))

  if ns == 1:
    return out
  return merge_splits(*out).astype(q.dtype)


def merge_splits(o, lse):
  """Log-sum-exp merge of split-K partials: o [B, P, T, Hq, D] (each normalised over its split),
  lse [B, P, T, Hq] (NEG_INF where a split saw no key) -> [B, T, Hq, D] float32.

  Written over the P splits one by one (P is static), elementwise only: XLA:GPU fuses it with the
  cast after it into one loop kernel. A variadic `lax.reduce` over P was two kernels (the reduce,
  then the division and cast), max-then-exp-then-sum three. A split that saw no key weighs
  exp(NEG_INF - max) = 0 next to one that did; a row no split saw gives 0."""
  p = o.shape[1]
  m = lse[:, 0]
  for i in range(1, p):
    m = jnp.maximum(m, lse[:, i])
  acc, weight = 0.0, 0.0
  for i in range(p):
    e = jnp.exp(lse[:, i] - m)
    acc, weight = acc + o[:, i] * e[..., None], weight + e
  return acc / weight[..., None]


def attention_config(q_shape, cache_shape, tuning: KernelTuning = KernelTuning()):
  """The launch parameters tree_attention picks for q [B, T, Hq, D] over caches [B, Hkv, S, D]
  (logging, benchmarks)."""
  b, t_len, hq, d = q_shape
  _, hkv, cap, _ = cache_shape
  return launch_config(b, t_len, hq, hkv, cap, d, tuning)


__all__ = ["tree_attention", "attention_config", "default_config", "launch_config",
           "merge_splits", "split_blocks", "NEG_INF"]
