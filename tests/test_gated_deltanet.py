"""The gated delta rule (`models/gated_deltanet.py`, float32): the chunked prefill and the
all-nodes tree form against the token-by-token loop, node by node along each root path, and the
state an accepted path commits."""

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
