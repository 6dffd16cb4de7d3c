"""Pallas tree attention vs the plain-XLA reference (CPU: interpret mode) and CUDA lowering checks."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from ddtree_jax.models.attention import attend_xla
from ddtree_jax.pallas.tree_attention import split_blocks, tree_attention
from helpers import abstract_h200_mesh, triton_custom_calls, verify_triton_ir

pytestmark = pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated.*")

BUDGETS = [1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 512]


def _inputs(rng, b, t, hq, hkv, s, d, dtype, prefix_len=None, mask=None):
  """Random q/k/v, ragged prefix lengths and a random mask in which every row sees itself."""
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
  q, k_cache, v_cache = f(b, t, hq, d), f(b, hkv, s, d), f(b, hkv, s, d)
  k_new, v_new = f(b, t, hkv, d), f(b, t, hkv, d)
  if prefix_len is None:
    prefix_len = rng.integers(0, s + 1, size=b)
  if mask is None:
    mask = (rng.random((b, t, t)) < 0.5) | np.eye(t, dtype=bool)[None]
  return (q, k_cache, v_cache, jnp.asarray(prefix_len, jnp.int32), k_new, v_new,
          jnp.asarray(mask))


def _reference(*args, scale):
  """attend_xla with full-precision float32 dots (on a GPU, XLA may otherwise use TF32)."""
  with jax.default_matmul_precision("highest"):
    return attend_xla(*args, scale=scale)


def _assert_close(got, want, rel):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.all(np.isfinite(got))
  err, ref = np.abs(got - want).max(), np.abs(want).max()
  assert err <= rel * ref + 1e-6, f"max err {err} vs {rel} * {ref}"


# (B, T, Hq, Hkv, S, D, prefix lengths, num_splits); prefix lengths cover 0, S and odd values.
CASES = [
    (1, 1, 4, 1, 37, 64, [37], None),             # AR decode, G=4, odd S, full prefix
    (3, 1, 8, 1, 300, 128, [0, 300, 151], 4),      # decode, G=8, split-K, empty and full prefix
    (2, 3, 8, 2, 100, 64, [0, 99], 1),             # small tree, one split
    (2, 3, 8, 2, 100, 64, [57, 100], 3),           # small tree, split-K
    (2, 17, 4, 4, 129, 128, [129, 1], None),       # G=1, T just over a block
    (2, 33, 16, 4, 65, 64, [64, 33], 2),           # G=4, T=33, split-K
    (1, 33, 8, 1, 48, 128, [17], 1),               # G=8, T=33: several row blocks
    (2, 5, 6, 2, 40, 32, [40, 13], 2),             # G=3 (padded to 4), D=32
]


@pytest.mark.parametrize("b,t,hq,hkv,s,d,plen,splits", CASES)
def test_matches_reference_f32(b, t, hq, hkv, s, d, plen, splits):
  rng = np.random.default_rng(hash((b, t, hq, hkv, s, d)) % 2**32)
  args = _inputs(rng, b, t, hq, hkv, s, d, jnp.float32, prefix_len=plen)
  got = tree_attention(*args, scale=d ** -0.5, num_splits=splits)
  _assert_close(got, _reference(*args, scale=d ** -0.5), 1e-5)


@pytest.mark.parametrize("b,t,hq,hkv,s,d,plen,splits", [
    (2, 1, 32, 8, 200, 128, [200, 77], None),
    (2, 17, 8, 2, 99, 128, [0, 99], 2),
    (1, 33, 4, 1, 64, 64, [31], 1),
])
def test_matches_reference_bf16(b, t, hq, hkv, s, d, plen, splits):
  rng = np.random.default_rng(7 + t)
  args = _inputs(rng, b, t, hq, hkv, s, d, jnp.bfloat16, prefix_len=plen)
  got = tree_attention(*args, scale=d ** -0.5, num_splits=splits)
  assert got.dtype == jnp.bfloat16
  # Reference on the same bf16 values upcast to float32: XLA:CPU in jax 0.11.2 cannot run some
  # bf16 x bf16 -> f32 batched dots of attend_xla ("Unsupported element type for DotThunk").
  up = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
  want = _reference(*up, scale=d ** -0.5).astype(jnp.bfloat16)
  _assert_close(got, want, 1e-2)


def test_small_block_k_many_blocks():
  """block_k=16 forces many loop steps per split and a partial last block."""
  rng = np.random.default_rng(3)
  args = _inputs(rng, 2, 3, 4, 2, 90, 64, jnp.float32, prefix_len=[90, 45])
  got = tree_attention(*args, scale=0.125, block_k=16, num_splits=2)
  _assert_close(got, _reference(*args, scale=0.125), 1e-5)


@pytest.mark.parametrize("prefix_blocks,new_blocks", [(0, 1), (9, 1), (16, 1), (16, 2), (3, 5),
                                                     (40, 3)])
def test_split_blocks_cover_every_block_once(prefix_blocks, new_blocks):
  """Each key block lands in exactly one split, and no split runs past the blocks that exist
  (a split walking an empty block would cost the whole kernel a loop step)."""
  for num_splits in range(1, 20):
    seen_p, seen_n, longest = [], [], 0
    for s in range(num_splits):
      p_lo, p_hi, n_lo, n_hi = (int(x) for x in split_blocks(
          jnp.int32(s), jnp.int32(prefix_blocks), new_blocks, num_splits))
      assert 0 <= p_lo <= p_hi <= prefix_blocks and 0 <= n_lo <= n_hi <= new_blocks
      seen_p += range(p_lo, p_hi)
      seen_n += range(n_lo, n_hi)
      longest = max(longest, p_hi - p_lo + n_hi - n_lo)
    assert seen_p == list(range(prefix_blocks)) and seen_n == list(range(new_blocks))
    assert longest == -(-(prefix_blocks + new_blocks) // num_splits)


@pytest.mark.parametrize("splits", [2, 3, 5, 9])
def test_new_keys_shared_between_splits(splits):
  """The new keys' blocks are part of the split-K share: with block_k=16 a 40-token tree has 3
  new-key blocks after 1-2 prefix blocks, so splits hold a prefix and a new block, new blocks
  only, or nothing (9 splits)."""
  rng = np.random.default_rng(splits)
  args = _inputs(rng, 2, 40, 4, 1, 24, 32, jnp.float32, prefix_len=[10, 24])
  got = tree_attention(*args, scale=32 ** -0.5, block_k=16, num_splits=splits)
  _assert_close(got, _reference(*args, scale=32 ** -0.5), 1e-5)


def test_causal_mask_equals_causal_attention():
  """Prefix 0 and a causal new_mask == plain causal attention (jax.nn, computed independently)."""
  rng = np.random.default_rng(11)
  b, t, hq, hkv, d = 2, 19, 8, 2, 64
  causal = np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))
  q, kc, vc, plen, kn, vn, mask = _inputs(rng, b, t, hq, hkv, 16, d, jnp.float32,
                                          prefix_len=[0, 0], mask=causal)
  got = tree_attention(q, kc, vc, plen, kn, vn, mask, scale=d ** -0.5, num_splits=2)
  with jax.default_matmul_precision("highest"):
    want = jax.nn.dot_product_attention(q, kn, vn, is_causal=True, scale=d ** -0.5)
  _assert_close(got, want, 1e-5)


def test_tree_node_equals_its_ancestor_chain():
  """Node i of a tree sees prefix + its ancestors; same as the last row of that path run causally."""
  rng = np.random.default_rng(5)
  n, hq, hkv, s, d = 12, 8, 2, 50, 64
  parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
  vis = np.zeros((n, n), bool)
  for i in range(n):
    j = i
    while j >= 0:
      vis[i, j], j = True, parents[j]
  q, kc, vc, plen, kn, vn, mask = _inputs(rng, 1, n, hq, hkv, s, d, jnp.float32,
                                          prefix_len=[41], mask=vis[None])
  tree_out = tree_attention(q, kc, vc, plen, kn, vn, mask, scale=d ** -0.5)
  for node in (n - 1, n // 2):
    path = np.flatnonzero(vis[node])  # ancestors in topological order, node last
    causal = jnp.asarray(np.tril(np.ones((len(path), len(path)), bool))[None])
    chain = tree_attention(q[:, path], kc, vc, plen, kn[:, path], vn[:, path], causal,
                           scale=d ** -0.5)
    _assert_close(tree_out[:, node], chain[:, -1], 1e-5)


def test_masking_one_more_key_changes_output():
  rng = np.random.default_rng(9)
  b, t, hq, hkv, s, d = 1, 6, 4, 1, 30, 64
  full = np.broadcast_to(np.ones((t, t), bool), (b, t, t))
  args = list(_inputs(rng, b, t, hq, hkv, s, d, jnp.float32, prefix_len=[20], mask=full))
  base = np.asarray(tree_attention(*args, scale=0.125, num_splits=2))
  # Hide new key 2 from query 4: only row 4 changes.
  fewer = np.array(full)
  fewer[0, 4, 2] = False
  args_m = list(args)
  args_m[6] = jnp.asarray(fewer)
  out = np.asarray(tree_attention(*args_m, scale=0.125, num_splits=2))
  assert np.abs(out[:, 4] - base[:, 4]).max() > 1e-3
  np.testing.assert_array_equal(np.delete(out, 4, axis=1), np.delete(base, 4, axis=1))
  # Hide the last prefix row: every query changes.
  args_p = list(args)
  args_p[3] = jnp.asarray([19], jnp.int32)
  out = np.asarray(tree_attention(*args_p, scale=0.125, num_splits=2))
  assert np.abs(out - base).max(axis=(0, 2, 3)).min() > 1e-4


def test_fully_masked_rows_are_zero_not_nan():
  rng = np.random.default_rng(2)
  t = 4
  mask = np.eye(t, dtype=bool)[None]
  mask[0, 2, 2] = False  # query 2 sees nothing at all (prefix 0)
  args = _inputs(rng, 1, t, 4, 2, 20, 64, jnp.float32, prefix_len=[0], mask=mask)
  for splits in (1, 3):
    out = np.asarray(tree_attention(*args, scale=0.125, num_splits=splits))
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[:, 2], 0.0)
    _assert_close(np.delete(out, 2, axis=1),
                  np.delete(np.asarray(_reference(*args, scale=0.125)), 2, axis=1), 1e-5)


def test_merge_splits_equals_the_softmax_weighted_mean():
  """The merge equals exp-weighting the splits by their log-sum-exp, with splits
  that saw no key (lse NEG_INF, o 0) ignored and a row no split saw giving 0."""
  from ddtree_jax.pallas.tree_attention import NEG_INF, merge_splits
  rng = np.random.default_rng(5)
  o = rng.normal(size=(2, 5, 3, 4, 8)).astype(np.float32)
  lse = (rng.normal(size=(2, 5, 3, 4)) * 30).astype(np.float32)  # spreads beyond exp's range
  lse[0, 1:3, 0, 0] = NEG_INF
  o[0, 1:3, 0, 0] = 0.0
  lse[1, :, 2, 3] = NEG_INF  # a row that saw nothing
  o[1, :, 2, 3] = 0.0
  w = np.exp(lse - lse.max(axis=1, keepdims=True).astype(np.float64))
  want = (o * w[..., None]).sum(axis=1) / w.sum(axis=1)[..., None]
  got = np.asarray(merge_splits(jnp.asarray(o), jnp.asarray(lse)))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.all(got[1, 2, 3] == 0.0)
  keep = [0, 3, 4]  # the splits of row (0, 0, 0) that saw keys
  np.testing.assert_allclose(got[0, 0, 0], (o[0, keep, 0, 0] * w[0, keep, 0, 0, None]).sum(0)
                             / w[0, keep, 0, 0].sum(), rtol=1e-5)


def test_stacked_layer_caches_equal_one_layer():
  """A KVCache holds every layer in one [L, B, Hkv, S, D] array and attention reads layer `layer`
  in place: same output as the layer's own [B, Hkv, S, D] caches, in both implementations."""
  rng = np.random.default_rng(5)
  q, _, _, plen, kn, vn, mask = _inputs(rng, 2, 5, 8, 2, 40, 64, jnp.float32, prefix_len=[40, 9])
  ks = jnp.asarray(rng.standard_normal((3, 2, 2, 40, 64), dtype=np.float32))
  vs = jnp.asarray(rng.standard_normal((3, 2, 2, 40, 64), dtype=np.float32))
  for layer in (0, 2):
    one = (q, ks[layer], vs[layer], plen, kn, vn, mask)
    stacked = (q, ks, vs, plen, kn, vn, mask)
    want = _reference(*one, scale=0.125)
    _assert_close(tree_attention(*stacked, scale=0.125, layer=layer, num_splits=2), want, 1e-5)
    with jax.default_matmul_precision("highest"):
      _assert_close(attend_xla(*stacked, scale=0.125, layer=layer), want, 1e-6)
  with pytest.raises(ValueError, match="layer=3"):
    tree_attention(*stacked, scale=0.125, layer=3)
  with pytest.raises(ValueError, match="layer=0"):
    tree_attention(q, ks[0], vs[0], plen, kn, vn, mask, scale=0.125, layer=0)


# ---------------------------------------------------------------------------------------------
def _lower_for_h200(b, t, hq, hkv, s, d, dtype=jnp.bfloat16, layers=None, **kw):
  sds = jax.ShapeDtypeStruct
  cache = (b, hkv, s, d) if layers is None else (layers, b, hkv, s, d)
  args = (sds((b, t, hq, d), dtype), sds(cache, dtype), sds(cache, dtype),
          sds((b,), jnp.int32), sds((b, t, hkv, d), dtype), sds((b, t, hkv, d), dtype),
          sds((b, t, t), jnp.bool_))
  fn = lambda *a: tree_attention(*a, scale=d ** -0.5, interpret=False, **kw)
  with jax.sharding.use_abstract_mesh(abstract_h200_mesh()):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("g", [1, 4])
def test_lowers_for_h200_at_every_budget(g):
  hkv, d = 8, 128
  for budget in BUDGETS:
    t = budget + 1
    lowered = _lower_for_h200(2, t, g * hkv, hkv, 4096, d)
    calls = triton_custom_calls(lowered)
    assert len(calls) == 1, (budget, g)
    asm = verify_triton_ir(calls[0])
    if asm is not None:
      assert "tt.dot" in asm and "scf.for" in asm, (budget, g)


@pytest.mark.parametrize("b,t,hq,hkv,s,d,splits", [
    (1, 1, 32, 8, 32768, 128, None),    # decode: split-K
    (8, 2048, 32, 8, 2048, 128, None),  # prefill-sized T
    (1, 9, 24, 8, 1000, 64, 3),         # G=3, D=64
    (1, 65, 32, 8, 1057, 128, "stacked"),  # a KVCache's [36, B, Hkv, S, D], layer 35
])
def test_lowers_for_h200_other_shapes(b, t, hq, hkv, s, d, splits):
  kw = dict(layers=36, layer=35) if splits == "stacked" else dict(num_splits=splits)
  calls = triton_custom_calls(_lower_for_h200(b, t, hq, hkv, s, d, **kw))
  assert len(calls) == 1
  verify_triton_ir(calls[0])


@pytest.mark.parametrize("b,t,cap,splits", [
    (1, 1, 1057, 10),     # AR at a 1K cache: one 128-key block per split (1 split: 2x slower)
    (1, 16, 1280, 17),    # drafter block
    (8, 1, 1280, 3),
    (8, 16, 8448, 3),
    (64, 1, 1280, 1),
    (1, 17, 1057, 6),     # B=16 at 1K: 3 key blocks per split caps one wave (8); not A/B'd
    (1, 33, 1057, 5),     # B=32 at 1K: one wave of 5 x 24 programs, measured in the real step
    (1, 65, 1280, 3),     # B=64 at 1K: one wave of 3 x 40 (1 split 2.1x slower, 2 splits 1.3x)
    (1, 129, 1280, 2),
    (1, 33, 8448, 8),     # long cache, few programs: chunks of ~1024 keys
    (1, 65, 8448, 8),
    (8, 65, 8448, 2),     # >= 128 programs per split
    (8, 33, 8448, 2),
])
def test_split_rule_matches_the_h200_sweep(b, t, cap, splits):
  """Qwen3-8B heads (32 / 8, D=128) on 132 SMs: the split counts the sweeps and step profiles
  chose (docs/findings/attention-kernel.md); trees never get one split."""
  rule = sys.modules["ddtree_jax.pallas.tree_attention"].default_config  # (the module)
  assert rule(b, t, 32, 8, cap, 128, sm_count=132)[3] == splits
