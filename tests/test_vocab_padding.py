"""A vocabulary that the tensor-parallel axis does not divide (V = 97): placement zero-pads it to
the axis (`sharding.pad_vocab`) and no padded column ever reaches a logit, a pick, the tree's
top-k or its logsumexp (docs/design.md §7)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ddtree_jax as dj
from ddtree_jax import kernels, sharding
from ddtree_jax.checkpoints import export
from ddtree_jax.models import decoder, drafter as drafter_lib
from ddtree_jax.speculative import topk, tree, verify
from helpers import assert_accepted, oracle_drafter, write_drafter, write_target

V = 97
PROMPTS = [[3, 17, 96, 4, 50, 31, 8], [42], [7] * 12 + [9], [60, 1, 0]]
M = 16
BUDGET = 16


def _mesh(tp):
  return sharding.make_mesh({"dp": 1, "tp": tp}, jax.devices()[:tp])


def _padded(v, tp):
  return -(-v // tp) * tp


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """(target path, drafter path, one-device target, its drafter, AR tokens, a sampled run)."""
  root = tmp_path_factory.mktemp("vocab")
  path = write_target(str(root / "target"), vocab=V)
  target = dj.load_target(path, "float32", fuse_qkv=False)
  dpath = write_drafter(str(root / "drafter"), target.config, block_size=8)
  ar = dj.generate(target, PROMPTS, max_new_tokens=M, stop_token_ids=()).tokens
  sampled = dj.generate(target, PROMPTS, max_new_tokens=M, stop_token_ids=(), temperature=1.0,
                        seed=3).tokens
  return path, dpath, target, dj.load_drafter(dpath, target), ar, sampled


@pytest.mark.parametrize("tp", [2])  # (tp 4 and 8: the top-k and placement tests below)
def test_generate_on_padded_vocab_equals_one_device(pair, tp):
  """Loaded onto tp devices: embed / lm_head padded with zeros to the next multiple of tp; the
  logits, greedy AR, sampled AR and DDTree (the real drafter's forward in the loop) are the
  one-device run's."""
  path, dpath, target, _, ar, sampled = pair
  st = dj.load_target(path, "float32", mesh=_mesh(tp))
  vp, h = _padded(V, tp), target.config.hidden_size
  assert st.config.vocab_size == st.params.vocab == V
  assert st.params.embed.shape == (vp, h) and st.params.lm_head.shape == (h, vp)
  for got, want in ((st.params.embed, target.params.embed),
                    (st.params.lm_head.T, target.params.lm_head.T)):
    np.testing.assert_array_equal(np.asarray(got)[:V], np.asarray(want))
    assert not np.asarray(got)[V:].any()
  ids = np.asarray([PROMPTS[0]], np.int32)
  logits = dj.forward_logits(st, ids)
  assert logits.shape == (1, len(PROMPTS[0]), V)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(dj.forward_logits(target, ids)),
                             rtol=1e-5, atol=1e-5)
  assert dj.generate(st, PROMPTS, max_new_tokens=M, stop_token_ids=()).tokens == ar
  assert dj.generate(st, PROMPTS, max_new_tokens=M, stop_token_ids=(), temperature=1.0,
                     seed=3).tokens == sampled
  over = oracle_drafter(dj.load_drafter(dpath, st), PROMPTS, ar, over_real=True)
  res = dj.generate(st, PROMPTS, method="ddtree", drafter=over, budget=BUDGET, max_new_tokens=M,
                    stop_token_ids=())
  assert res.tokens == ar
  assert_accepted(over, PROMPTS, res, "ddtree", BUDGET)


def test_int8_and_draft_vocab_drafters_on_padded_vocab(pair):
  """An int8 drafter's own lm_head copies the padded target head (its columns split like it)
  and drafts the one-device int8 drafter's V logits; a restricted draft vocabulary takes real
  ids only (Vd = 49 columns, replicated) and its logits are the full head's at those ids.
  DDTree with either gives AR's tokens."""
  path, dpath, target, _, ar, _ = pair
  st = dj.load_target(path, "float32", mesh=_mesh(2))
  int8 = dj.load_drafter(dpath, st, int8=True)
  assert int8.params.lm_head.scale.shape == (_padded(V, 2),)
  ids = np.arange(0, V, 2)
  restricted = dj.load_drafter(dpath, st, int8=True, draft_vocab=ids)
  assert restricted.params.lm_head.scale.shape == (len(ids),)
  with pytest.raises(ValueError, match=r"vocab ids must be in \[0, 97\)"):
    drafter_lib.restrict_vocab(dj.load_drafter(dpath, st).params, st.params, [V])
  full = dj.draft_logits(st, int8, PROMPTS[0])
  assert full.shape == (int8.config.num_drafts, V)
  one = dj.load_drafter(dpath, target, int8=True)
  np.testing.assert_allclose(np.asarray(full), np.asarray(dj.draft_logits(target, one, PROMPTS[0])),
                             rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(dj.draft_logits(st, restricted, PROMPTS[0])),
                             np.asarray(full)[:, ids], rtol=1e-6, atol=1e-6)
  over = oracle_drafter(int8, PROMPTS, ar, over_real=True)
  res = dj.generate(st, PROMPTS, method="ddtree", drafter=over, budget=BUDGET, max_new_tokens=M,
                    stop_token_ids=())
  assert res.tokens == ar
  assert_accepted(over, PROMPTS, res, "ddtree", BUDGET)
  assert dj.generate(st, PROMPTS, method="ddtree", drafter=restricted, budget=BUDGET,
                     max_new_tokens=M, stop_token_ids=()).tokens == ar


def test_padded_columns_never_win(pair):
  """Padding columns set huge (what a wrong slice would let through): lm_head still returns V
  columns, and its argmax, samples, logsumexp and the tree's top-k (per vocab shard) are those
  of the real columns. An in-memory int8 drafter (quantized from the one-device target) placed
  with `shard_params` gets its head padded too and drafts V logits."""
  path, dpath, target, drafter, _, _ = pair
  mesh = _mesh(2)
  st = dj.load_target(path, "float32", mesh=mesh)
  spec = NamedSharding(mesh, P(None, "tp"))
  head = jax.device_put(st.params.lm_head.at[:, V:].set(1e3), spec)
  bad = dataclasses.replace(st.params, lm_head=head)
  hidden = jnp.ones((2, 15, target.config.hidden_size), jnp.float32)
  want = decoder.lm_head(target.params, hidden)
  got = jax.jit(decoder.lm_head)(bad, hidden)
  assert got.shape == want.shape == (2, 15, V)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  key = jax.random.key(0)
  pick = jax.jit(lambda p, h, t: verify.pick(decoder.lm_head(p, h), t, key), static_argnums=2)
  for temperature in (0.0, 1.0):
    np.testing.assert_array_equal(np.asarray(pick(bad, hidden, temperature)),
                                  np.asarray(verify.pick(want, temperature, key)))
  top = kernels.Kernels(mesh=mesh).vocab_top_k
  build = jax.jit(lambda p, h: tree.build_tree(decoder.lm_head(p, h), BUDGET,
                                               root_token=jnp.asarray([5, 6]), vocab_top=top))
  got_tree = build(bad, hidden)
  want_tree = tree.build_tree(want, BUDGET, root_token=jnp.asarray([5, 6]))
  np.testing.assert_array_equal(np.asarray(got_tree.tokens), np.asarray(want_tree.tokens))
  np.testing.assert_allclose(np.asarray(got_tree.scores), np.asarray(want_tree.scores),
                             rtol=1e-5, atol=1e-5)

  one = drafter_lib.quantize_int8(drafter.params, target.params)
  placed = sharding.shard_params(one, mesh)
  assert placed.lm_head.q.shape[0] == placed.lm_head.scale.shape[0] == _padded(V, 2)
  assert not np.asarray(placed.lm_head.q)[V:].any()
  dcfg, lc = drafter.config, drafter.config.layers
  cache = decoder.init_cache(lc.num_layers, 2, lc.num_kv_heads, 8, lc.head_dim, jnp.float32)
  bonus = jnp.asarray([3, 42], jnp.int32)
  draft = jax.jit(lambda d, t, k: drafter_lib.draft_logits(d, dcfg, t, cache, bonus, k),
                  static_argnums=2)
  got_draft = draft(placed, st.params, kernels.Kernels(mesh=mesh))
  assert got_draft.shape == (2, dcfg.num_drafts, V)
  np.testing.assert_allclose(np.asarray(got_draft),
                             np.asarray(draft(one, target.params, kernels.REFERENCE)),
                             rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("v,tp,k", [(97, 2, 16), (97, 8, 13), (5, 4, 2)])
def test_shard_vocab_top_k_pads_an_indivisible_vocab(v, tp, k):
  """V that tp does not divide: padded to the next multiple per shard (at V=5 over 4 devices
  the last shard is all padding); logits all below 0, so a padding that any logit could lose
  to would win. lax.top_k's values and ids, the logsumexp, in one all-gather."""
  mesh = _mesh(tp)
  rng = np.random.default_rng(1)
  x = (rng.standard_normal((3, 7, v)) - 50).astype(np.float32)
  x[:, :, 0] = x[:, :, v - 1] = -40.0  # ties across the first and the last shard
  want = topk.vocab_top_k(x, k)
  fn = jax.jit(lambda a: kernels.shard_vocab_top_k(mesh)(a, k))
  got = fn(x)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-6)
  assert int(np.asarray(got[1]).max()) < v
  hlo = fn.lower(x).compile().as_text()
  assert hlo.count(" all-gather(") + hlo.count(" all-gather-start(") == 1


def test_shard_params_pads_in_memory_params_and_lookup_reads_real_rows(pair):
  """Random params placed with `shard_params` on tp=8: embed padded 97 -> 104 rows of zeros,
  tied (no lm_head); the per-shard lookup returns the real rows (the last, 96, on the shard
  that holds padding too)."""
  cfg = dataclasses.replace(pair[2].config, tie_word_embeddings=True)
  params = decoder.init_params(cfg, jax.random.key(0), jnp.float32)
  mesh = _mesh(8)
  placed = sharding.shard_params(params, mesh)
  assert placed.embed.shape == (104, cfg.hidden_size) and placed.lm_head is None
  assert placed.vocab == V and not np.asarray(placed.embed)[V:].any()
  ids = jnp.asarray([[0, 12, 13, 90, 96], [95, 1, 2, 3, 4]], jnp.int32)
  got = jax.jit(kernels.shard_embed_lookup(mesh))(placed.embed, ids)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(params.embed)[np.asarray(ids)])
  hidden = jnp.ones((1, 3, cfg.hidden_size), jnp.float32)
  assert jax.jit(decoder.lm_head)(placed, hidden).shape == (1, 3, V)


def test_export_drops_the_padding(pair, tmp_path):
  """A target placed on a padded mesh exports V rows and loads back as the original."""
  path, _, target, _, _, _ = pair
  st = dj.load_target(path, "float32", mesh=_mesh(2))
  out = export.save_target_hf(str(tmp_path / "export"), st.params, st.config, dtype="float32")
  back = dj.load_target(out, "float32", fuse_qkv=False)
  np.testing.assert_array_equal(np.asarray(back.params.embed), np.asarray(target.params.embed))
  np.testing.assert_array_equal(np.asarray(back.params.lm_head),
                                np.asarray(target.params.lm_head))
