"""Edges: exact cache capacity, stop tokens inside the accepted path, canary rows, bad input."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import ddtree_jax as dj
from ddtree_jax.speculative import decode
from ddtree_jax.checkpoints.hf import read_checkpoint_tensors
from conftest import FIXTURES
from helpers import copy_fixture, edit_config, oracle_drafter, write_drafter

PROMPTS = [[3, 17, 99, 4, 250, 31, 8], [42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13]]
M = 24


@pytest.fixture(scope="module")
def target():
  return dj.load_target(os.path.join(FIXTURES, "qwen3_gqa"), dtype="float32")


@pytest.fixture(scope="module")
def drafter(target, tmp_path_factory):
  return dj.load_drafter(write_drafter(str(tmp_path_factory.mktemp("d")), target.config), target)


@pytest.fixture(scope="module")
def ar(target):
  return dj.generate(target, PROMPTS, max_new_tokens=M, stop_token_ids=()).tokens


@pytest.mark.parametrize("method,budget", [("ar", None), ("chain", None), ("ddtree", 64)])
def test_generation_ending_exactly_at_cache_capacity(target, drafter, ar, method, budget):
  d = oracle_drafter(drafter, PROMPTS, ar, corruption=0.1) if method != "ar" else None
  capacity = max(map(len, PROMPTS)) + M - 1
  res = dj.generate(target, PROMPTS, method=method, drafter=d, budget=budget, max_new_tokens=M,
                    stop_token_ids=(), cache_capacity=capacity)
  assert res.tokens == ar
  with pytest.raises(ValueError, match="cache rows"):
    dj.generate(target, PROMPTS, method=method, drafter=d, budget=budget, max_new_tokens=M,
                stop_token_ids=(), cache_capacity=capacity - 1)


@pytest.mark.parametrize("method,budget", [("ar", None), ("chain", None), ("ddtree", 16)])
def test_stop_token_inside_accepted_path_cuts_output(target, drafter, ar, method, budget):
  stop = ar[0][10]  # a token the target emits mid-sequence
  expected = [seq[:seq.index(stop) + 1] if stop in seq else seq for seq in ar]
  d = oracle_drafter(drafter, PROMPTS, ar, corruption=0.0) if method != "ar" else None
  res = dj.generate(target, PROMPTS, method=method, drafter=d, budget=budget, max_new_tokens=M,
                    stop_token_ids=(stop,))
  assert res.tokens == expected
  if method != "ar":  # with a perfect oracle the stop token sits inside a multi-token step
    assert max(res.stats["acceptance_lengths"][0]) > 1


CANARY = 1234.5


def _prefill(target, d, method, budget, prompts, capacity, steps_per_check=1):
  """(the state right after prefill, the decode statics)."""
  lens = np.array([len(p) for p in prompts], np.int32)
  tokens = np.zeros((len(prompts), -(-int(lens.max()) // 16) * 16), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  lc = decode.LoopConfig(method=method, max_new_tokens=M,
                         num_drafts=d.config.num_drafts if d else 0, budget=budget or 0,
                         steps_per_check=steps_per_check)
  st = dict(tcfg=target.config, dcfg=d.config if d else None, lc=lc)
  return decode.prefill(target.params, d.params if d else None, jnp.asarray(tokens),
                        jnp.asarray(lens), jax.random.key(0), capacity=capacity, **st), st


def _with_canaries(cache, lens):
  """Every row at or past each sequence's length set to CANARY ([L, B, K, S, D] arrays)."""
  rows = jnp.arange(cache.k.shape[3])[None, None, None, :, None] >= lens[None, :, None, None, None]
  canary = lambda c: jnp.where(rows, CANARY, c)
  return dataclasses.replace(cache, k=canary(cache.k), v=canary(cache.v))


def _run_with_canaries(target, d, method, budget, capacity, steps_per_check=1):
  state, st = _prefill(target, d, method, budget, PROMPTS, capacity, steps_per_check)
  lens = jnp.asarray([len(p) for p in PROMPTS])
  state = dataclasses.replace(state, cache=_with_canaries(state.cache, lens))
  if d is not None:
    state = dataclasses.replace(state, draft_cache=_with_canaries(state.draft_cache, lens))
  return decode.decode_loop(target.params, d.params if d else None, state, **st)


def _assert_rows(got, want, final, what):
  """Rows below each sequence's final length equal `want`'s; every row past it is a canary."""
  for layer in range(got.k.shape[0]):
    for a, b in ((got.k[layer], want.k[layer]), (got.v[layer], want.v[layer])):
      a, b = np.asarray(a), np.asarray(b)
      for s, n in enumerate(final):
        assert np.all(a[s, :, n:] == CANARY), (what, layer, s)
        np.testing.assert_allclose(a[s, :, :n], b[s, :, :n], rtol=1e-4, atol=1e-5,
                                   err_msg=f"{what} layer {layer} sequence {s}")


@pytest.mark.parametrize("method,budget,steps_per_check", [("chain", None, 1), ("ddtree", 128, 1),
                                                           ("ddtree", 128, 5)])
def test_nothing_written_outside_own_rows(target, drafter, ar, method, budget, steps_per_check):
  """Canary rows past each sequence's final length survive in the target's and the drafter's
  caches; the target's committed rows equal AR's K/V, and the drafter's context rows equal those
  of one prefill over the committed tokens (each row the features of its own token, at its own
  position, after multi-token steps). With 5 steps per loop check, idle steps after the last
  sequence is done write nothing either."""
  capacity = 13 + M - 1 + 5  # room to spare past the longest sequence
  d = oracle_drafter(drafter, PROMPTS, ar, corruption=0.2)
  spec = _run_with_canaries(target, d, method, budget, capacity, steps_per_check)
  ref = _run_with_canaries(target, None, "ar", None, capacity)
  final = np.asarray(spec.cache.lens)
  np.testing.assert_array_equal(final, np.asarray(ref.cache.lens))
  np.testing.assert_array_equal(np.asarray(spec.draft_cache.lens), final)
  assert max(np.asarray(spec.accepted).max(axis=0)) > 2  # multi-token steps were committed
  _assert_rows(spec.cache, ref.cache, final, "target")
  committed = [p + a[:n - len(p)] for p, a, n in zip(PROMPTS, ar, final)]
  whole, _ = _prefill(target, d, "chain", None, committed, capacity)
  _assert_rows(spec.draft_cache, whole.draft_cache, final, "drafter")


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("changes,match", [
    (dict(model_type="mistral"), "unsupported model_type"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_type"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_unsupported_config_is_refused(tmp_path, changes, match):
  path = copy_fixture(tmp_path)
  edit_config(path, **changes)
  with pytest.raises(ValueError, match=match):
    dj.load_target(path)


def test_missing_and_misshaped_tensors_are_named(tmp_path):
  path = copy_fixture(tmp_path)
  tensors = {k: np.array(v) for k, v in read_checkpoint_tensors(path).items()}
  name = "model.layers.1.self_attn.k_proj.weight"
  save_file({k: v for k, v in tensors.items() if k != name}, os.path.join(path, "model.safetensors"))
  with pytest.raises(ValueError, match=f"missing tensors.*{name}"):
    dj.load_target(path)
  tensors[name] = np.zeros((3, 64), np.float32)
  save_file(tensors, os.path.join(path, "model.safetensors"))
  with pytest.raises(ValueError, match=r"k_proj.weight.*\(3, 64\).*\(64, 64\)"):
    dj.load_target(path)


def test_no_safetensors_is_refused(tmp_path):
  path = copy_fixture(tmp_path)
  os.remove(os.path.join(path, "model.safetensors"))
  with pytest.raises(FileNotFoundError, match="safetensors"):
    dj.load_target(path)


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=[[]]), "prompt 0 is empty"),
    (dict(prompts=[[1, 999]]), "outside"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(method="beam"), "unknown method"),
    (dict(attention="flash"), "unknown attention"),
    (dict(prompts=[[1] * 40], cache_capacity=32), "cache rows"),
    (dict(method="chain"), "needs a drafter"),
    (dict(method="ddtree"), "needs a drafter"),
    (dict(temperature=-1.0), "temperature"),
    (dict(steps_per_check=0), "steps_per_check"),
])
def test_bad_requests_raise_before_compute(target, kwargs, match):
  call = dict(prompts=[[1, 2, 3]], max_new_tokens=4) | kwargs
  prompts = call.pop("prompts")
  with pytest.raises(ValueError, match=match):
    dj.generate(target, prompts, **call)


@pytest.mark.parametrize("budget", [0, -3, 5000, None])
def test_bad_budget_names_the_limit(target, drafter, budget):
  with pytest.raises(ValueError, match=r"budget.* in \[1, 1024\]"):
    dj.generate(target, [[1, 2]], method="ddtree", drafter=drafter, budget=budget, max_new_tokens=4)


@pytest.mark.parametrize("kwargs,match", [
    (dict(config_overrides={"hidden_size": 32}), "hidden_size"),
    (dict(config_overrides={"vocab_size": 300}), "vocab_size"),
    (dict(mask_token_id=256), "mask_token_id"),
    (dict(target_layer_ids=(0, 2)), "target_layer_ids"),
    (dict(config_overrides={"conv_kernel_size": 4}), "variant"),
    (dict(config_overrides={"dflash_config": {"mask_token_id": 5, "selector_rank": 8}}), "variant"),
    (dict(config_overrides={"use_sliding_window": True, "sliding_window": 0,
                            "layer_types": ["sliding_attention"] * 2}), "sliding_window"),
    (dict(config_overrides={"use_sliding_window": True,
                            "layer_types": ["sliding_attention"]}), "layer_types"),
    (dict(config_overrides={"dflash_config": {"mask_token_id": 5, "sliding_window_size": 64}}),
     "variant"),
    (dict(config_overrides={"num_attention_sinks": 4}), "variant"),
    (dict(drop=("fc.weight",)), "fc.weight"),
    (dict(reshape={"layers.0.mlp.up_proj.weight": (5, 64)}), "up_proj"),
])
def test_bad_drafters_are_refused(target, tmp_path, kwargs, match):
  path = write_drafter(str(tmp_path / "d"), target.config, **kwargs)
  with pytest.raises((ValueError, KeyError), match=match):
    dj.load_drafter(path, target)


def test_drafter_block_size_nested_and_default_layer_ids(target, tmp_path):
  path = write_drafter(str(tmp_path / "d"), target.config, block_size=6, nest_block_size=True)
  d = dj.load_drafter(path, target)
  assert d.config.block_size == 6 and d.config.num_drafts == 5
  from ddtree_jax.models.drafter import default_target_layer_ids
  assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
  assert default_target_layer_ids(36, 1) == (18,)
