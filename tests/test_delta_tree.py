"""The Pallas tree delta rule (`pallas.delta_tree`) against its reference `gated_deltanet.tree`:
chains as deep as the padded node count (the solve's series must cover every generation), draft
trees, widths that need padding or several column blocks, a batch through vmap; its Triton
lowering for an abstract H200 and the precision it picks; the kernel switch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.kernels import Kernels
from ddtree_jax.models import gated_deltanet as gd
from ddtree_jax.pallas import delta_tree as dt
from helpers import abstract_h200_mesh, triton_custom_calls, verify_triton_ir

F32 = jnp.float32


def _ancestors(parents):
  n = len(parents)
  anc = np.eye(n, dtype=bool)
  for i, p in enumerate(parents):
    if p >= 0:
      anc[i] |= anc[p]
  return anc


def _draft_tree(n, rng, depth=16):
  """parents of a DDTree-like tree: a trunk of `depth` nodes, the rest hung below random nodes
  (each parent listed first)."""
  parents = [-1] + list(range(min(depth, n) - 1))
  parents += [int(rng.integers(0, i)) for i in range(len(parents), n)]
  return np.asarray(parents[:n])


def _inputs(n, h, dk, dv, seed, alike=False):
  """Random rule inputs; alike: keys close to one another, writes near 1 and slow decays, where
  the solve's expansion in powers of A has terms that grow binomially (an unstable solve fails)."""
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s), F32)
  unit = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)
  k = unit(f(1, h, dk) + 0.05 * f(n, h, dk)) if alike else unit(f(n, h, dk))
  g = -0.01 * jnp.abs(f(n, h)) if alike else -0.3 * jnp.abs(f(n, h))
  beta = jax.nn.sigmoid(f(n, h) + (6.0 if alike else 0.0))
  return unit(f(n, h, dk)) * dk ** -0.5, k, f(n, h, dv), g, beta, f(h, dk, dv)


CASES = [  # (parents, heads, dk, dv, block_v)
    ("alike chain of 64", np.arange(64) - 1, 2, 16, 32, 16),
    ("alike draft tree of 33", "tree", 2, 16, 32, 32),
    ("chain of 64", np.arange(64) - 1, 2, 16, 32, 16),
    ("chain of 33", np.arange(33) - 1, 2, 32, 32, 32),
    ("draft tree of 33", "tree", 4, 32, 64, 64),
    ("draft tree of 65", "tree", 2, 16, 16, 16),
    ("root alone", np.asarray([-1]), 3, 16, 16, 16),
    ("two roots", np.asarray([-1, -1, 0, 1, 2]), 2, 16, 16, 16),
    ("padded widths", np.asarray([-1, 0, 0, 1, 3, 3, 5]), 3, 12, 12, 16),
    ("column blocks of a tree of 20", "tree", 2, 16, 64, 16),
]


@pytest.mark.parametrize("name,parents,heads,dk,dv,block_v", CASES, ids=[c[0] for c in CASES])
def test_kernel_equals_the_reference(name, parents, heads, dk, dv, block_v):
  rng = np.random.default_rng(len(name))
  if isinstance(parents, str):
    parents = _draft_tree(int(name.split()[-1]), rng)
  anc = jnp.asarray(_ancestors(parents))
  args = _inputs(len(parents), heads, dk, dv, seed=len(name), alike=name.startswith("alike"))
  want = gd.tree(*args, anc)
  got = dt.delta_tree(*args, anc, block_v=block_v)
  for w, g, what in zip(want, got, ("o", "delta", "G")):
    assert g.shape == w.shape, what
    np.testing.assert_allclose(g, w, rtol=5e-5, atol=5e-5, err_msg=f"{name}: {what}")
  if "chain" in name:  # a chain is the token loop's own order
    np.testing.assert_allclose(got[0], gd.recurrent(*args)[0], rtol=5e-5, atol=5e-5)


def test_a_batch_through_vmap():
  """Rows with their own trees, states and inputs (what the layer's vmap gives the kernel)."""
  rng = np.random.default_rng(3)
  trees = [_draft_tree(17, rng, depth=d) for d in (16, 3)]
  anc = jnp.stack([jnp.asarray(_ancestors(p)) for p in trees])
  rows = [_inputs(17, 2, 16, 32, seed=s) for s in (1, 2)]
  args = [jnp.stack(a) for a in zip(*rows)]
  want = jax.vmap(gd.tree)(*args, anc)
  got = jax.vmap(lambda *a: dt.delta_tree(*a, block_v=16))(*args, anc)
  for w, g in zip(want, got):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_bad_launch_is_refused():
  args = _inputs(5, 2, 16, 48, seed=0)
  anc = jnp.asarray(_ancestors([-1, 0, 1, 2, 3]))
  with pytest.raises(ValueError, match="block_v 32 .* value width 48"):
    dt.delta_tree(*args, anc, block_v=32)
  assert not dt.supported(5, 48, 32) and dt.supported(5, 48, 16) and dt.supported(5, 12, 16)


@pytest.mark.parametrize("precision,tf32", [("highest", False), (None, True)])
def test_triton_lowering_for_an_h200(precision, tf32):
  """One launch for a batch of trees at Qwen3.5-9B's widths; float32 products under "highest"
  (the lossless setting), TF32 otherwise, as XLA's reference does."""
  sds = jax.ShapeDtypeStruct
  b, n, h, d = 2, 33, 32, 128
  shapes = [sds((b, n, h, d), F32)] * 3 + [sds((b, n, h), F32)] * 2 + [
      sds((b, h, d, d), F32), sds((b, n, n), jnp.bool_)]
  fn = jax.vmap(lambda *a: dt.delta_tree(*a, block_v=64, interpret=False))
  with jax.default_matmul_precision(precision), \
       jax.sharding.use_abstract_mesh(abstract_h200_mesh()):
    lowered = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))
  calls = triton_custom_calls(lowered)
  assert len(calls) == 1
  asm = verify_triton_ir(calls[0])
  if asm is None:
    pytest.skip("the Triton module could not be parsed back")
  dots = [line for line in asm.splitlines() if "tt.dot" in line]
  assert len(dots) == 6       # k k^T, k S, q k^T, q S, the substitution's, (q k^T) delta
  assert all(("inputPrecision = tf32" in line) == tf32 for line in dots)


def test_kernel_switch():
  """The Pallas configuration runs the kernel (falling back where a launch cannot block the
  widths); XLA and meshes run the reference."""
  args = _inputs(9, 2, 16, 24, seed=5)
  anc = jnp.asarray(_ancestors(_draft_tree(9, np.random.default_rng(0), depth=4)))
  assert Kernels().delta_tree is gd.tree
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("tp",))
  assert Kernels(attention="pallas", mesh=mesh).delta_tree is gd.tree
  rule = Kernels(attention="pallas").delta_tree
  jaxpr = str(jax.make_jaxpr(rule)(*args, anc))
  assert "delta_tree" in jaxpr
  for w, g in zip(gd.tree(*args, anc), rule(*args, anc)):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
  wide = _inputs(9, 2, 16, 96, seed=5)       # 96 neither fits in nor divides into 64 columns
  assert "delta_tree" not in str(jax.make_jaxpr(rule)(*wide, anc))
  for n, kernel in ((64, True), (65, False)):  # up to delta_tree_max_nodes (64)
    chain = jnp.asarray(_ancestors(np.arange(n) - 1))
    assert ("delta_tree" in str(jax.make_jaxpr(rule)(*_inputs(n, 2, 16, 24, 5), chain))) == kernel
