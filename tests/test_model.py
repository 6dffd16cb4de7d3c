"""Target model parity with Hugging Face transformers (fixtures made by make_hf_reference.py)."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dj
from ddtree_jax.models import decoder
from conftest import FIXTURES
from helpers import cached_decode_logits

MODELS = ["qwen3_gqa", "qwen3_tied", "llama3_scaled", "qwen3_sharded", "qwen3_5_text", "qwen3_next",
          "qwen3_5_moe_text"]


def _load(name):
  return dj.load_target(os.path.join(FIXTURES, name), dtype="float32"), np.load(
      os.path.join(FIXTURES, name, "reference.npz"))


def _close(a, b, rel=1e-4):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape
  assert np.max(np.abs(a - b)) <= rel * np.max(np.abs(b)), np.max(np.abs(a - b))


@pytest.mark.parametrize("name", MODELS)
def test_forward_logits_match_hf(name):
  target, ref = _load(name)
  _close(dj.forward_logits(target, ref["input_ids"]), ref["logits"])


@pytest.mark.parametrize("name", ["qwen3_gqa", "llama3_scaled"])
def test_taps_are_hf_hidden_states(name):
  """Tap i is HF's hidden_states[i + 1]: the residual output of layer i, and for the last layer
  the state after the final norm (what DFlash drafters read)."""
  target, ref = _load(name)
  ids = jnp.asarray(ref["input_ids"])
  b, t = ids.shape
  cache = decoder.init_cache(target.config.num_layers, b, target.config.num_kv_heads, 0,
                           target.config.head_dim, jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  layers = tuple(range(target.config.num_layers))
  _, _, taps = decoder.forward(target.params, target.config, ids, pos, cache,
                                decoder.causal_mask(jnp.full((b,), t), t), layers)
  h = target.config.hidden_size
  assert bool(ref["hidden_states_last_is_post_norm"])
  for i in layers:
    _close(taps[..., i * h:(i + 1) * h], ref["hidden_states"][i + 1])
  last = layers[-1]
  assert not np.allclose(taps[..., last * h:], ref["layer_outputs"][last], atol=1e-3)


@pytest.mark.parametrize("name", MODELS)
def test_prefill_then_cached_decode_logits_match_hf(name):
  """Prompt prefill, then one cached step per HF greedy token: logits equal HF's per step."""
  target, ref = _load(name)
  _close(cached_decode_logits(target, ref["prompt"], ref["greedy"]), ref["decode_logits"])


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_matches_hf(name):
  target, ref = _load(name)
  n = len(ref["greedy"])  # 16, or 24 for the hybrids
  res = dj.generate(target, [ref["prompt"].tolist()], max_new_tokens=n, stop_token_ids=())
  assert res.tokens[0] == ref["greedy"].tolist()
  assert res.stats["steps"] == n - 1 and res.stats["tau"] == 1.0


def test_config_parsing_both_rope_formats():
  top, _ = _load("qwen3_gqa")
  nested, _ = _load("qwen3_tied")
  llama, _ = _load("llama3_scaled")
  assert top.config.rope_theta == 10000.0 and nested.config.rope_theta == 1e6
  assert nested.config.tie_word_embeddings and nested.params.lm_head is None
  assert top.config.head_dim == 32 != top.config.hidden_size // top.config.num_heads
  assert dict(llama.config.rope_scaling)["factor"] == 8.0 and not llama.config.qk_norm
  assert top.config.eos_token_ids == (1,)
  assert top.tokenizer is not None
