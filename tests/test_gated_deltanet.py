"""The gated delta rule (`models/gated_deltanet.py`, float32): the chunked prefill and the
all-nodes tree form against the token-by-token loop, node by node along each root path, and the
state an accepted path commits."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.models import gated_deltanet as gd

H, DK, DV = 3, 8, 6


def _inputs(t, seed, decay=0.3):
  rng = np.random.default_rng(seed)
  unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
  q = unit(rng.normal(size=(t, H, DK))) / np.sqrt(DK)
  k = unit(rng.normal(size=(t, H, DK)))
  v = rng.normal(size=(t, H, DV))
  g = -decay * np.abs(rng.normal(size=(t, H)))
  beta = 1 / (1 + np.exp(-rng.normal(size=(t, H))))
  state = rng.normal(size=(H, DK, DV))
  return [jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta)], jnp.asarray(state, jnp.float32)


def _close(a, b, tol=2e-5):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape
  np.testing.assert_allclose(a, b, atol=tol * max(1.0, np.abs(b).max()))


@pytest.mark.parametrize("t,chunk", [(1, 4), (37, 8), (64, 64), (150, 16)])
def test_chunked_prefill_equals_the_loop(t, chunk):
  x, state = _inputs(t, seed=t)
  o, s = gd.chunked(*x, state, chunk=chunk)
  o_ref, s_ref = gd.recurrent(*x, state)
  _close(o, o_ref)
  _close(s, s_ref)


def test_ancestors_of_a_tree():
  parents = np.array([-1, 0, 0, 1, -1, 4, 3])
  want = np.eye(7, dtype=bool)
  for j in range(7):
    p = parents[j]
    while p >= 0:
      want[j, p] = True
      p = parents[p]
  np.testing.assert_array_equal(np.asarray(gd.ancestors_of(jnp.asarray(parents))), want)


@pytest.mark.parametrize("decay", [0.05, 0.3, 3.0])
def test_every_node_sees_its_own_root_path(decay):
  """Siblings at several depths (different tokens on each branch) and two roots: each node's
  output is the loop's along its root path alone; the state committed for any node's path is
  the loop's state there, and committing nothing keeps the state."""
  parents = jnp.asarray([-1, 0, 0, 1, 1, 2, 3, 3, 6, 5, -1, 10, 10])
  n = parents.shape[0]
  x, state = _inputs(n, seed=int(decay * 10), decay=decay)
  anc = gd.ancestors_of(parents)
  o, delta, big_g = gd.tree(*x, state, anc)
  for j in range(n):
    path = jnp.asarray(np.flatnonzero(np.asarray(anc[j])))
    o_ref, s_ref = gd.recurrent(*[a[path] for a in x], state)
    _close(o[j], o_ref[-1])
    _close(gd.commit(state, x[1], delta, big_g, anc[j], j), s_ref)
  _close(gd.commit(state, x[1], delta, big_g, jnp.zeros((n,), bool), -1), state, 0)
  # a sibling's branch changes the outputs: node 4 (sibling of 3) differs from node 3
  assert np.abs(np.asarray(o[3] - o[4])).max() > 1e-3


def test_conv_of_every_node_runs_along_its_root_path():
  """Kernel 4: each node's convolution equals a causal convolution over (window + its path);
  the committed window is the last 3 inputs of (window + accepted path), also for paths shorter
  than the window and for nothing accepted."""
  rng = np.random.default_rng(5)
  parents = np.array([-1, 0, 0, 1, 2, 4, 5, -1])
  n, c, k = len(parents), 5, 4
  x = jnp.asarray(rng.normal(size=(n, c)), jnp.float32)
  window = jnp.asarray(rng.normal(size=(k - 1, c)), jnp.float32)
  weight = jnp.asarray(rng.normal(size=(k, c)), jnp.float32)
  got = np.asarray(gd.tree_conv(x, jnp.asarray(parents), window, weight))
  for j in range(n):
    path = [j]
    while parents[path[-1]] >= 0:
      path.append(int(parents[path[-1]]))
    seq = np.concatenate([np.asarray(window), np.asarray(x)[path[::-1]]])   # oldest first
    want = sum(np.asarray(weight)[k - 1 - i] * seq[-1 - i] for i in range(k))
    np.testing.assert_allclose(got[j], want, rtol=1e-5, atol=1e-5)
    kept = gd.commit_window(window, x, jnp.asarray(parents), j)
    np.testing.assert_array_equal(np.asarray(kept), seq[-(k - 1):])
  np.testing.assert_array_equal(
      np.asarray(gd.commit_window(window, x, jnp.asarray(parents), -1)), np.asarray(window))
  with pytest.raises(ValueError, match="window of 2 rows"):
    gd.tree_conv(x, jnp.asarray(parents), window[1:], weight)


# --------------------------------------------------------------------------------------------
# The layer: a NumPy oracle written from the Gated DeltaNet formulas, token by token

DIMS = gd.GDNDims(key_heads=2, value_heads=4, key_dim=8, value_dim=6)
HID, KER = 16, 4
CH = 2 * 2 * 8 + 4 * 6


def _layer_params(seed=0):
  rng = np.random.default_rng(seed)
  w = lambda *s: jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)
  return gd.GDNParams(w_qkv=w(HID, CH), w_z=w(HID, 24), w_b=w(HID, 4), w_a=w(HID, 4),
                      conv=w(KER, CH), dt_bias=w(4), a_log=w(4), norm=1 + w(6), w_out=w(24, HID))


def _oracle(p, xs, state, window):
  """Token by token in float64: (outputs [T, H], state, window)."""
  p = {f.name: np.asarray(getattr(p, f.name), np.float64) for f in dataclasses.fields(p)}
  silu = lambda a: a / (1 + np.exp(-a))
  state, window, out = np.array(state, np.float64), np.array(window, np.float64), []
  kd, r = 16, 2
  for x in np.asarray(xs, np.float64):
    window = np.concatenate([window, (x @ p["w_qkv"])[None]])
    conv = silu(np.sum(p["conv"] * window[-KER:], axis=0))
    window = window[1:]
    q = np.repeat(conv[:kd].reshape(2, 8), r, axis=0)
    k = np.repeat(conv[kd:2 * kd].reshape(2, 8), r, axis=0)
    v = conv[2 * kd:].reshape(4, 6)
    q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6) / np.sqrt(8)
    k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
    beta = 1 / (1 + np.exp(-(x @ p["w_b"])))
    g = -np.exp(p["a_log"]) * np.log1p(np.exp(x @ p["w_a"] + p["dt_bias"]))
    o = np.zeros((4, 6))
    for h in range(4):
      state[h] *= np.exp(g[h])
      delta = (v[h] - k[h] @ state[h]) * beta[h]
      state[h] += np.outer(k[h], delta)
      o[h] = q[h] @ state[h]
    z = (x @ p["w_z"]).reshape(4, 6)
    y = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + DIMS.eps) * p["norm"] * silu(z)
    out.append(y.reshape(-1) @ p["w_out"])
  return np.stack(out), state, window


def test_layer_prefill_tree_and_commit_equal_the_token_loop():
  """Prefill (chunked, not a multiple of the chunk) from a committed state and window; then a
  tree whose every node equals the loop over its own root path; then committing one path and
  prefilling more equals the loop over prompt + path + continuation."""
  p = _layer_params()
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(11, HID)), jnp.float32)
  state = jnp.asarray(rng.normal(size=(4, 8, 6)) * 0.1, jnp.float32)
  window = jnp.asarray(rng.normal(size=(KER - 1, CH)) * 0.3, jnp.float32)
  y, s1, w1 = gd.prefill(p, DIMS, x, state, window, chunk=4)
  y_ref, s_ref, w_ref = _oracle(p, x, state, window)
  _close(y, y_ref, 1e-4)
  _close(s1, s_ref, 1e-4)
  _close(w1, w_ref, 1e-5)
  parents = jnp.asarray([-1, 0, 0, 1, 2, 3, 3, 6])
  nodes = jnp.asarray(rng.normal(size=(8, HID)), jnp.float32)
  out, pending = gd.tree_forward(p, DIMS, nodes, parents, s1, w1)
  anc = np.asarray(gd.ancestors_of(parents))
  for j in range(8):
    path = np.flatnonzero(anc[j])
    _close(out[j], _oracle(p, nodes[path], s1, w1)[0][-1], 1e-4)
  path = np.flatnonzero(anc[7])                       # 0 -> 1 -> 3 -> 6 -> 7
  s2, w2 = gd.commit_tree(s1, w1, pending, parents, jnp.asarray(anc[7]), 7)
  more = jnp.asarray(rng.normal(size=(5, HID)), jnp.float32)
  y3 = gd.prefill(p, DIMS, more, s2, w2, chunk=4)[0]
  want = _oracle(p, jnp.concatenate([nodes[path], more]), s1, w1)[0][-5:]
  _close(y3, want, 1e-4)


def test_qwen3_next_projections_unfuse_by_key_head_group():
  """The fused rows as transformers lays them out (2 key heads, r = 3 value heads of 5, dk 8: a
  group is 46 rows), each row tagged by its index: q takes rows 0-7 and 46-53, k 8-15 and 54-61,
  value head 0 rows 16-20, z rows 31-45 and 77-91; b rows 0-2 and 6-8 of in_proj_ba, a 3-5, 9-11."""
  dims = gd.GDNDims(key_heads=2, value_heads=6, key_dim=8, value_dim=5)
  qkvz = np.arange(92, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
  ba = np.arange(12, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
  out = gd.unfuse_qwen3_next(qkvz, ba, dims)
  rows = lambda a: a[:, 0].astype(int).tolist()
  group = lambda lo, hi: list(range(lo, hi)) + list(range(lo + 46, hi + 46))
  assert rows(out["qkv"]) == group(0, 8) + group(8, 16) + group(16, 31)
  assert rows(out["z"]) == group(31, 46)
  assert rows(out["b"]) == [0, 1, 2, 6, 7, 8] and rows(out["a"]) == [3, 4, 5, 9, 10, 11]
  assert out["qkv"].shape == (2 * 16 + 30, 3)
