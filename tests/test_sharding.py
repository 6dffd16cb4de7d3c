"""Tensor parallelism on 8 forced CPU devices: sharded == unsharded (docs/design.md §8)."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ddtree_jax as dj
from conftest import FIXTURES
from ddtree_jax import kernels, sharding
from ddtree_jax.speculative import topk
from ddtree_jax.checkpoints import hf as checkpoint
from ddtree_jax.speculative import decode
from ddtree_jax.speculative import tree
from ddtree_jax.speculative import verify
from ddtree_jax.models import drafter as drafter_lib
from ddtree_jax.models.attention import attend_xla
from helpers import oracle_drafter, write_drafter, write_target

M = 24
PROMPTS = [[3, 17, 99, 4, 250, 31, 8], [42], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 9], [200, 1, 0]]
MESHES = [{"dp": 1, "tp": 1}, {"dp": 1, "tp": 2}, {"dp": 1, "tp": 8}, {"dp": 2, "tp": 4}]
BUDGET = 16


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
  root = tmp_path_factory.mktemp("tp")
  target = write_target(str(root / "target"))
  cfg = dj.load_target(target, dtype="float32").config
  return target, write_drafter(str(root / "drafter"), cfg, block_size=8)


@pytest.fixture(scope="module")
def reference(paths):
  """Unsharded target (unfused: the layout the mesh tests compare tensor by tensor), drafter and
  outputs: AR tokens, chain/ddtree acceptance lengths."""
  target = dj.load_target(paths[0], dtype="float32", fuse_qkv=False)
  drafter = dj.load_drafter(paths[1], target)
  ar = dj.generate(target, PROMPTS, max_new_tokens=M, stop_token_ids=()).tokens
  oracle = oracle_drafter(drafter, PROMPTS, ar)
  acc = {}
  for method in ("chain", "ddtree"):
    res = dj.generate(target, PROMPTS, method=method, drafter=oracle, max_new_tokens=M,
                      budget=BUDGET if method == "ddtree" else None, stop_token_ids=())
    assert res.tokens == ar
    acc[method] = res.stats["acceptance_lengths"]
  assert any(a > 2 for seq in acc["ddtree"] for a in seq)  # acceptance is non-trivial
  return target, drafter, ar, acc


def _spec_of(x):
  return x.sharding.spec if isinstance(x.sharding, NamedSharding) else None


def _laid_out(x, spec):
  """x is laid out as NamedSharding(its mesh, spec) (trailing Nones do not matter)."""
  return x.sharding.is_equivalent_to(NamedSharding(x.sharding.mesh, spec), x.ndim)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"dp{s['dp']}xtp{s['tp']}")
def test_generate_sharded_equals_unsharded(paths, reference, shape):
  _, _, ar, acc = reference
  mesh = sharding.make_mesh(shape)
  target = dj.load_target(paths[0], dtype="float32", mesh=mesh)
  drafter = dj.load_drafter(paths[1], target)
  assert target.params.layers[0].wq.sharding.mesh == mesh
  assert drafter.params.fc.sharding.mesh == mesh
  res = dj.generate(target, PROMPTS, max_new_tokens=M, stop_token_ids=())
  assert res.tokens == ar
  oracle = oracle_drafter(drafter, PROMPTS, ar)
  for method in ("chain", "ddtree"):
    res = dj.generate(target, PROMPTS, method=method, drafter=oracle, max_new_tokens=M,
                      budget=BUDGET if method == "ddtree" else None, stop_token_ids=())
    assert res.tokens == ar, method
    assert res.stats["acceptance_lengths"] == acc[method], method


def test_pallas_kernels_sharded_equal_unsharded(paths, reference):
  """attention="pallas" on dp2 x tp4: the tree attention and the q/k norm + RoPE kernels run per
  shard (interpret mode) in the target and the real drafter; same tokens and acceptance."""
  target, drafter, ar, _ = reference
  run = lambda t, d: dj.generate(t, PROMPTS, method="ddtree", drafter=d, budget=BUDGET,
                                 max_new_tokens=M, stop_token_ids=(), attention="pallas")
  want = run(target, drafter)
  mesh = sharding.make_mesh({"dp": 2, "tp": 4})
  st = dj.load_target(paths[0], dtype="float32", mesh=mesh)
  got = run(st, dj.load_drafter(paths[1], st))
  assert got.tokens == want.tokens == ar
  assert got.stats["acceptance_lengths"] == want.stats["acceptance_lengths"]


def test_batch_not_divisible_by_dp_is_padded(paths, reference):
  _, _, ar, _ = reference
  target = dj.load_target(paths[0], dtype="float32", mesh=sharding.make_mesh({"dp": 2, "tp": 4}))
  res = dj.generate(target, PROMPTS[:3], max_new_tokens=M, stop_token_ids=())
  assert res.tokens == ar[:3] and len(res.stats["acceptance_lengths"]) == 3


def test_load_places_each_tensor_on_its_shards(paths, reference):
  ref_target, ref_drafter, _, _ = reference
  mesh = sharding.make_mesh({"dp": 1, "tp": 8})
  target = dj.load_target(paths[0], dtype="float32", mesh=mesh)
  drafter = dj.load_drafter(paths[1], target)
  layer = target.params.layers[0]
  assert _laid_out(layer.wq, P(None, "tp", None))
  assert _laid_out(layer.wkv, P(None, None, "tp", None))
  assert _laid_out(layer.wo, P("tp", None, None))
  assert _laid_out(layer.w_gate_up, P(None, None, "tp"))
  assert _laid_out(layer.w_down, P("tp", None))
  assert _laid_out(target.params.embed, P("tp", None))
  assert _laid_out(target.params.lm_head, P(None, "tp"))
  assert _laid_out(layer.input_norm, P()) and _laid_out(layer.q_norm, P())
  assert _laid_out(drafter.params.fc, P(None, "tp"))
  pairs = [(target.params, ref_target.params), (drafter.params, ref_drafter.params)]
  for got, want in pairs:
    expect = sharding.specs(got, mesh)
    for x, y, spec in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                          jax.tree.leaves(expect, is_leaf=lambda s: isinstance(s, P))):
      assert _laid_out(x, spec)
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
      shard_shape = x.sharding.shard_shape(x.shape)
      if any(a is not None for a in spec):  # sharded: no device holds the whole tensor
        assert shard_shape != x.shape
      assert len(x.addressable_shards) == 8
      assert all(s.data.shape == shard_shape for s in x.addressable_shards)


def test_index_sharded_and_tied_checkpoints_on_a_mesh():
  mesh = sharding.make_mesh({"dp": 1, "tp": 2})
  for name in ("qwen3_sharded", "qwen3_tied"):
    path = os.path.join(FIXTURES, name)
    plain, tp = dj.load_target(path, "float32"), dj.load_target(path, "float32", mesh=mesh)
    ids = jnp.asarray([[3, 17, 99, 4, 250, 31, 8]], jnp.int32)
    np.testing.assert_allclose(np.asarray(dj.forward_logits(tp, ids)),
                               np.asarray(dj.forward_logits(plain, ids)), rtol=1e-5, atol=1e-5)
  assert tp.params.lm_head is None and _laid_out(tp.params.embed, P("tp", None))


@pytest.mark.parametrize("shape,batch", [({"dp": 1, "tp": 8}, 3), ({"dp": 2, "tp": 4}, 4),
                                         ({"dp": 2, "tp": 4}, 3)])
def test_shard_embed_lookup_equals_plain_lookup(shape, batch):
  """The per-shard lookup in a vocab-split table returns exactly table[ids], every id from the
  first to the last row (shard edges included), with the batch split over dp or not."""
  mesh = sharding.make_mesh(shape)
  vocab, hidden = 64, 16
  table = jnp.asarray(np.random.default_rng(0).normal(size=(vocab, hidden)), jnp.bfloat16)
  table = jax.device_put(table, NamedSharding(mesh, P("tp", None)))
  ids = jnp.asarray(np.arange(batch * 7 * 5).reshape(batch, 7, 5) * 7 % vocab, jnp.int32)
  ids = ids.at[0, 0, :2].set(jnp.asarray([0, vocab - 1]))
  got = jax.jit(kernels.shard_embed_lookup(mesh))(table, ids)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(table)[np.asarray(ids)])
  # one all-reduce of the rows, never an all-gather of the table
  hlo = jax.jit(kernels.shard_embed_lookup(mesh)).lower(table, ids).compile().as_text()
  assert "all-gather" not in hlo and "all-reduce" in hlo


def test_global_ids_from_vocab_sharded_logits():
  mesh = sharding.make_mesh({"dp": 1, "tp": 8})
  logits = jnp.asarray(3 * np.random.default_rng(3).standard_normal((3, 7, 256)), jnp.float32)
  sharded = jax.device_put(logits, NamedSharding(mesh, P(None, None, "tp")))
  assert sharded.addressable_shards[0].data.shape == (3, 7, 32)
  root = jnp.asarray([5, 6, 7], jnp.int32)
  build = jax.jit(functools.partial(tree.build_tree, budget=BUDGET))
  want, got = build(logits, root_token=root), build(sharded, root_token=root)
  for field in ("tokens", "parents", "depths", "visibility"):
    np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)))
  # scores: the logsumexp over vocab shards adds in another order (last-bit differences)
  np.testing.assert_allclose(np.asarray(got.scores), np.asarray(want.scores), rtol=1e-6)
  assert int(np.asarray(got.tokens).max()) >= 32  # ids from shards other than the first
  chain = jax.jit(tree.chain_tree)
  np.testing.assert_array_equal(np.asarray(chain(sharded, root).tokens),
                                np.asarray(chain(logits, root).tokens))
  pick = jax.jit(verify.pick, static_argnums=1)
  key = jax.random.key(0)
  for temperature in (0.0, 1.0):
    np.testing.assert_array_equal(np.asarray(pick(sharded, temperature, key)),
                                  np.asarray(pick(logits, temperature, key)))
  np.testing.assert_array_equal(np.asarray(pick(sharded, 0.0, key)), np.argmax(logits, -1))


def _attn_inputs(b, t, hq, hkv, s, d, seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  mask = (rng.random((b, t, t)) < 0.5) | np.eye(t, dtype=bool)[None]
  plen = jnp.asarray([7, 0, s, 3][:b], jnp.int32)
  return (f(b, t, hq, d), f(b, hkv, s, d), f(b, hkv, s, d), plen, f(b, t, hkv, d), f(b, t, hkv, d),
          jnp.asarray(mask))


def _pallas_attention():
  """The Pallas kernel in interpret mode, first checked unsharded. Skipped only where jax cannot
  import its Pallas Triton module; an error of ours or a wrong result fails."""
  try:
    from ddtree_jax.pallas.tree_attention import tree_attention  # pylint: disable=all
  except ImportError as e:
    if not (e.name or "").startswith("jax"):
      raise
    pytest.skip(f"this jax has no Pallas Triton backend: {e}")
  args = _attn_inputs(1, 3, 2, 1, 16, 16)
  np.testing.assert_allclose(np.asarray(tree_attention(*args, scale=0.25, interpret=True,
                                                       num_splits=1)),
                             np.asarray(attend_xla(*args, scale=0.25)), rtol=1e-4, atol=1e-4)
  return functools.partial(tree_attention, interpret=True, num_splits=1)


_RULES, _KV_REP = sharding.ShardingRules(), sharding.ShardingRules(kv_heads=None)


@pytest.mark.parametrize("kernel,shape,rules,hq,hkv", [
    ("xla", {"dp": 2, "tp": 4}, _RULES, 8, 4),              # kv heads split with the q heads
    ("xla", {"dp": 1, "tp": 8}, _KV_REP, 8, 2),             # replicated kv, sliced per q shard
    ("xla", {"dp": 1, "tp": 8}, _KV_REP, 24, 3),            # q shards straddle kv groups
    ("xla", {"dp": 2, "tp": 2}, sharding.ShardingRules(heads=None, kv_heads=None), 4, 2),
    ("pallas", {"dp": 2, "tp": 4}, _RULES, 8, 4),           # interpret mode; skipped if absent
], ids=["split", "kv_replicated", "straddle", "heads_replicated", "pallas_split"])
def test_shard_attention_equals_unsharded(kernel, shape, rules, hq, hkv):
  fn = attend_xla if kernel == "xla" else _pallas_attention()
  mesh = sharding.make_mesh(shape)
  args = _attn_inputs(2, 5, hq, hkv, 24, 16)
  kv = "tp" if rules.kv_heads else None
  specs = (P("dp", None, rules.heads, None), P("dp", kv, None, None), P("dp", kv, None, None),
           P("dp"), P("dp", None, kv, None), P("dp", None, kv, None), P("dp", None, None))
  placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
  wrapped = kernels.shard_attention(fn, mesh, rules)
  got = jax.jit(functools.partial(wrapped, scale=0.25))(*placed)
  want = jax.jit(functools.partial(attend_xla, scale=0.25))(*args)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_drafter_forward_with_sharded_attention(reference):
  ref_target, ref_drafter, _, _ = reference
  mesh = sharding.make_mesh({"dp": 2, "tp": 4})
  target = dj.load_target(ref_target.path, dtype="float32", mesh=mesh)
  drafter = dj.load_drafter(ref_drafter.path, target)
  tokens, lens = jnp.asarray([PROMPTS[0], PROMPTS[0][::-1]]), jnp.asarray([7, 5], jnp.int32)
  out = []
  for t, d, m in ((ref_target, ref_drafter, None), (target, drafter, mesh)):
    lc = decode.LoopConfig(method="chain", max_new_tokens=2, num_drafts=7,
                           kernels=kernels.Kernels(mesh=m))
    st = decode.prefill(t.params, d.params, tokens, lens, jax.random.key(0), tcfg=t.config,
                        dcfg=d.config, lc=lc, capacity=16)
    if m is not None:
      assert _laid_out(st.draft_cache.k, P(None, "dp", "tp"))
      assert _laid_out(st.cache.k, P(None, "dp", "tp"))
      assert _laid_out(st.cache.lens, P("dp")) and _laid_out(st.out, P("dp"))
    draft = jax.jit(lambda dp, tp, c, b, lc=lc: drafter_lib.draft_logits(
        dp, d.config, tp, c, b, lc.kernels))
    out.append(np.asarray(draft(d.params, t.params, st.draft_cache, st.bonus)))
  np.testing.assert_allclose(out[1], out[0], rtol=1e-5, atol=1e-5)


def test_orbax_restore_onto_another_mesh(paths, reference, tmp_path):
  ref_target = reference[0]
  tp2 = dj.load_target(paths[0], dtype="float32", mesh=sharding.make_mesh({"dp": 1, "tp": 2}))
  ckpt = str(tmp_path / "params")
  checkpoint.save_params(ckpt, tp2.params)
  mesh4 = sharding.make_mesh({"dp": 2, "tp": 4})
  like = jax.eval_shape(lambda: ref_target.params)
  for mesh in (mesh4, None):
    got = checkpoint.restore_params(ckpt, like, mesh)
    want_specs = jax.tree.leaves(sharding.specs(like, mesh4), is_leaf=lambda s: isinstance(s, P))
    for i, (x, y) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(ref_target.params))):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
      if mesh is None:
        assert len(x.sharding.device_set) == 1
      else:
        assert x.sharding.mesh == mesh4 and _laid_out(x, want_specs[i])
  assert jax.tree.structure(got) == jax.tree.structure(ref_target.params)


def test_indivisible_heads_are_refused_or_replicated():
  """qwen3_gqa has 4 query heads and 2 kv heads: tp=4 refuses the default rules (kv heads),
  runs with kv_heads=None (K/V replicated, sliced per shard in attention) and equals unsharded."""
  path = os.path.join(FIXTURES, "qwen3_gqa")
  mesh = sharding.make_mesh({"dp": 1, "tp": 4})
  with pytest.raises(ValueError, match="kv heads .*not divisible.*kv_heads=None"):
    dj.load_target(path, "float32", mesh=mesh)
  with pytest.raises(ValueError, match="query heads"):
    dj.load_target(path, "float32", mesh=sharding.make_mesh({"dp": 1, "tp": 8}),
                   rules=sharding.ShardingRules(kv_heads=None))
  with pytest.raises(ValueError, match="must be sharded like heads"):
    sharding.ShardingRules(heads=None)
  rules = sharding.ShardingRules(kv_heads=None)
  target = dj.load_target(path, "float32", mesh=mesh, rules=rules)
  assert _laid_out(target.params.layers[0].wkv, P())
  assert _laid_out(target.params.layers[0].wq, P(None, "tp", None))
  ref = np.load(os.path.join(path, "reference.npz"))  # HF greedy tokens (eos disabled)
  res = dj.generate(target, [ref["prompt"].tolist()], max_new_tokens=len(ref["greedy"]),
                    stop_token_ids=())
  assert res.tokens[0] == ref["greedy"].tolist()


def test_mesh_helpers_and_flags(monkeypatch):
  from absl import flags  # pylint: disable=import-outside-toplevel
  assert dict(sharding.make_mesh({"dp": 2, "tp": -1}).shape) == {"dp": 2, "tp": 4}
  with pytest.raises(ValueError, match="needs 16 devices"):
    sharding.make_mesh({"dp": 2, "tp": 8})
  explicit = jax.make_mesh((8,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,))
  auto = sharding.check_mesh(explicit)  # jax.make_mesh's Explicit axes become Auto
  assert set(auto.axis_types) == {jax.sharding.AxisType.Auto}
  assert auto.axis_names == ("tp",) and (auto.devices == explicit.devices).all()
  assert sharding.check_mesh(auto) is auto
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  sharding.initialize_distributed("localhost:1234", 1, 0)
  assert not calls  # one process: nothing to initialise
  sharding.initialize_distributed("localhost:1234", 2, 1)
  assert calls == [dict(coordinator_address="localhost:1234", num_processes=2, process_id=1)]
  sharding.define_mesh_flags()
  sharding.define_mesh_flags()  # idempotent
  fv = flags.FLAGS
  try:
    fv(["prog", "--mesh_dp=2", "--mesh_tp=4"])
    assert dict(sharding.mesh_from_flags().shape) == {"dp": 2, "tp": 4}
    fv(["prog"])
    fv.mesh_dp, fv.mesh_tp = 1, 1
    assert sharding.mesh_from_flags() is None
  finally:
    fv.unparse_flags()


@pytest.mark.parametrize("shape,batch", [({"dp": 1, "tp": 8}, 3), ({"dp": 2, "tp": 4}, 4)])
def test_shard_vocab_top_k_equals_one_device(shape, batch):
  """The tree's top-k per vocab shard: lax.top_k's values and ids exactly (ties to the lower
  id across shards too), the logsumexp to rounding, in one all-gather."""
  mesh = sharding.make_mesh(shape)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((batch, 15, 1024)).astype(np.float32)
  x[:, :, 7] = x[:, :, 900] = x[:, :, 513] = 9.0  # ties across shards
  want = jax.jit(lambda a: topk.vocab_top_k(a, 32))(x)
  placed = jax.device_put(x, NamedSharding(mesh, P(None, None, "tp")))
  fn = jax.jit(lambda a: kernels.shard_vocab_top_k(mesh)(a, 32))
  got = fn(placed)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-6)
  assert list(np.asarray(got[1])[0, 0, :3]) == [7, 513, 900]
  hlo = fn.lower(placed).compile().as_text()
  assert hlo.count(" all-gather(") + hlo.count(" all-gather-start(") == 1
  assert " all-reduce(" not in hlo
