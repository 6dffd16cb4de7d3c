"""A drafter restricted to a subset of the vocabulary (drafter.restrict_vocab): its logits are the
full drafter's at those ids, the tree's tokens are mapped back to vocabulary ids, and decoding
stays lossless whatever the subset."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ddtree_jax as dj
from ddtree_jax import sharding
from ddtree_jax.speculative import decode
from ddtree_jax.models import drafter as drafter_lib
from ddtree_jax.checkpoints import export as hf_export
from ddtree_jax.training import losses as training
from helpers import (PAIR_NEW_TOKENS, PAIR_PROMPTS, OracleConfig, oracle_drafter,
                     small_pair)

M, PROMPTS = PAIR_NEW_TOKENS, PAIR_PROMPTS


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  return small_pair(str(tmp_path_factory.mktemp("vocab")))


@dataclasses.dataclass(frozen=True)
class SubsetOracle(OracleConfig):
  """The oracle's drafts, seen only at the ids params[0].draft_vocab (as a restricted drafter)."""

  def draft(self, params, *args, **kw):
    return super().draft(params, *args, **kw)[..., params[0].draft_vocab]

  def vocab(self, params):
    return params[0].draft_vocab


def subset_oracle(target, path, ar, vocab, corruption=0.3):
  d = oracle_drafter(dj.load_drafter(path, target), PROMPTS, ar, corruption=corruption)
  inner = drafter_lib.restrict_vocab(d.params[0], target.params, vocab)
  cfg = SubsetOracle(**{f.name: getattr(d.config, f.name) for f in dataclasses.fields(d.config)})
  return dataclasses.replace(d, params=(inner, d.params[1]), config=cfg)


def test_restricted_logits_are_the_full_drafters_at_those_ids(pair, tmp_path):
  target, path, _ = pair
  vocab = np.random.default_rng(0).permutation(target.config.vocab_size)[:40]
  np.save(tmp_path / "ids.npy", vocab)
  for int8, ids in ((False, vocab), (True, str(tmp_path / "ids.npy"))):   # an array, a .npy file
    full = dj.load_drafter(path, target, int8=int8)
    sub = dj.load_drafter(path, target, int8=int8, draft_vocab=ids)
    np.testing.assert_array_equal(sub.params.draft_vocab, vocab)
    np.testing.assert_allclose(dj.draft_logits(target, sub, PROMPTS[0]),
                               dj.draft_logits(target, full, PROMPTS[0])[:, vocab],
                               rtol=1e-6, atol=1e-6)
  # quantize then restrict == restrict then quantize (per-column int8)
  f = dj.load_drafter(path, target)
  a = drafter_lib.restrict_vocab(drafter_lib.quantize_int8(f.params, target.params),
                                 target.params, vocab)
  b = drafter_lib.quantize_int8(drafter_lib.restrict_vocab(f.params, target.params, vocab),
                                target.params)
  np.testing.assert_array_equal(a.lm_head.q, b.lm_head.q)
  np.testing.assert_array_equal(a.lm_head.scale, b.lm_head.scale)


def test_make_tree_maps_drafted_tokens_to_vocab_ids():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.standard_normal((2, 5, 64)), jnp.float32)
  perm = jnp.asarray(rng.permutation(64), jnp.int32)
  bonus = jnp.asarray([7, 9], jnp.int32)
  for method, budget in (("chain", 0), ("ddtree", 12)):
    lc = decode.LoopConfig(method=method, max_new_tokens=8, num_drafts=5, budget=budget)
    want = decode.make_tree(lc, logits, bonus)
    got = decode.make_tree(lc, logits[..., perm], bonus, perm)   # column j is id perm[j]
    for field in ("tokens", "parents", "depths", "visibility"):
      np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)


def test_permuted_full_vocab_decodes_exactly_as_the_unrestricted_oracle(pair):
  target, path, ar = pair
  perm = np.random.default_rng(2).permutation(target.config.vocab_size)
  plain = oracle_drafter(dj.load_drafter(path, target), PROMPTS, ar)
  sub = subset_oracle(target, path, ar, perm)
  for method, budget in (("chain", None), ("ddtree", 8)):
    want = dj.generate(target, PROMPTS, method=method, drafter=plain, budget=budget,
                       max_new_tokens=M, stop_token_ids=())
    got = dj.generate(target, PROMPTS, method=method, drafter=sub, budget=budget,
                      max_new_tokens=M, stop_token_ids=())
    assert got.tokens == want.tokens == ar
    assert got.stats["acceptance_lengths"] == want.stats["acceptance_lengths"]
    assert got.stats["tau"] > 2.0, got.stats["tau"]   # deep acceptance: the ids were mapped


def test_subset_missing_some_target_tokens_stays_lossless(pair):
  target, path, ar = pair
  v = target.config.vocab_size
  used = sorted({t for seq in ar for t in seq})
  rng = np.random.default_rng(3)
  dropped = set(rng.choice(used, size=len(used) // 3, replace=False).tolist())
  vocab = rng.permutation([i for i in range(v) if i not in dropped][: v // 2 + len(used)])
  sub = subset_oracle(target, path, ar, vocab, corruption=0.1)
  full = oracle_drafter(dj.load_drafter(path, target), PROMPTS, ar, corruption=0.1)
  for method, budget in (("chain", None), ("ddtree", 3), ("ddtree", 16)):
    kw = dict(method=method, budget=budget, max_new_tokens=M, stop_token_ids=())
    got = {name: dj.generate(target, PROMPTS, drafter=d, **kw)
           for name, d in (("sub", sub), ("full", full))}
    assert all(r.tokens == ar for r in got.values()), (method, budget)
    # the kept ids are still drafted deep; the dropped ones cut paths the full oracle accepts
    assert 1.5 < got["sub"].stats["tau"] < got["full"].stats["tau"], (method, budget)


def test_drafted_nodes_are_vocab_ids(pair):
  """Every drafted node of a restricted drafter's step is an id of its draft vocabulary (the
  tree is built over columns 0..Vd-1, so unmapped tokens would fall outside these ids)."""
  target, path, _ = pair
  vocab = np.arange(100, 164)
  d = dj.load_drafter(path, target, draft_vocab=vocab)
  logits = dj.draft_logits(target, d, PROMPTS[0])[None]
  for method, budget in (("chain", 0), ("ddtree", 24)):
    lc = decode.LoopConfig(method=method, max_new_tokens=8, num_drafts=logits.shape[1],
                           budget=budget)
    tree = decode.make_tree(lc, logits, jnp.asarray([7], jnp.int32), d.config.vocab(d.params))
    assert int(tree.tokens[0, 0]) == 7
    assert np.isin(np.asarray(tree.tokens[0, 1:]), vocab).all(), method


def test_restricted_drafter_sharded_equals_unsharded(pair):
  target, path, ar = pair
  vocab = np.arange(0, target.config.vocab_size, 2)          # 128 ids: splits over tp=4
  d = dj.load_drafter(path, target, draft_vocab=vocab)
  want = dj.generate(target, PROMPTS, method="ddtree", drafter=d, budget=16, max_new_tokens=M,
                     stop_token_ids=())
  mesh = sharding.make_mesh({"dp": 2, "tp": 4})
  st = dj.load_target(target.path, dtype="float32", mesh=mesh)
  sd = dj.load_drafter(path, st, draft_vocab=vocab)
  assert sd.params.lm_head.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 2)
  odd = drafter_lib.restrict_vocab(dj.load_drafter(path, target).params, target.params,
                                  np.arange(6))  # 6 ids, tp=4: the head is replicated
  assert sharding.specs(odd, mesh).lm_head == P(None, None)
  res = dj.generate(st, PROMPTS, method="ddtree", drafter=sd, budget=16, max_new_tokens=M,
                    stop_token_ids=())
  assert res.tokens == want.tokens == ar
  assert res.stats["acceptance_lengths"] == want.stats["acceptance_lengths"]


def test_bad_draft_vocab_is_refused_by_name(pair, tmp_path):
  target, path, _ = pair
  d = dj.load_drafter(path, target)
  v = target.config.vocab_size
  for bad, match in ((np.asarray([0, v]), "in \\[0, 256\\)"), (np.asarray([3, 3]), "distinct"),
                     (np.asarray([-1]), "in \\[0"), (np.zeros((0,), np.int32), "empty"),
                     (np.asarray([[1, 2]]), "1-D"), (np.asarray([0.5]), "int ids")):
    with pytest.raises(ValueError, match=match):
      drafter_lib.restrict_vocab(d.params, target.params, bad)
  sub = drafter_lib.restrict_vocab(d.params, target.params, np.arange(8))
  with pytest.raises(ValueError, match="already restricted"):
    drafter_lib.restrict_vocab(sub, target.params, np.arange(4))
  with pytest.raises(ValueError, match="restricted draft vocabulary"):
    hf_export.save_drafter_hf(str(tmp_path / "out"), sub, d.config, target.config.num_layers)
  with pytest.raises(ValueError, match="restricted draft vocabulary"):
    training.drafter_block_logits(sub, d.config, target.params, None, None, None)


def test_frequent_tokens_orders_by_count_then_id():
  stream = np.asarray([5, 2, 5, 7, 2, 5, 9, 9, 0])
  np.testing.assert_array_equal(drafter_lib.frequent_tokens(stream, 4, 10), [5, 2, 9, 0])
  np.testing.assert_array_equal(drafter_lib.frequent_tokens(stream, 6, 10), [5, 2, 9, 0, 7, 1])
  with pytest.raises(ValueError, match="size"):
    drafter_lib.frequent_tokens(stream, 11, 10)
  with pytest.raises(ValueError, match="token ids"):
    drafter_lib.frequent_tokens(np.asarray([10]), 2, 10)
