"""The target's features at a drafter's tap layers, captured while the target writes its own
continuations (`generate_with_features`): the forwards that generate (the prefill over the prompt,
one AR step per new token) are the ones that compute them, so training data costs no second pass.

It rides on the decode loop's drafter-context path: `CaptureConfig` is a drafter config whose
context rows are the features themselves (split in two halves as its one layer's K and V of one
head), so the loop's own commit writes each committed token's features at its position, and the
drafter cache holds them all when the loop ends.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.models.drafter import DrafterConfig
from ddtree_jax.models.registry import config_from_hf
from ddtree_jax.request import GenerateOptions
from ddtree_jax.speculative import decode
from ddtree_jax.speculative.sampling import seed_key_data


@dataclasses.dataclass(frozen=True)
class CaptureConfig(DrafterConfig):
  """A drafter config that stores its tap features [B, R, D] as its context rows."""

  def context(self, params, taps, positions):
    half = taps.shape[-1] // 2
    return [taps[:, :, None, :half]], [taps[:, :, None, half:]]

  def vocab(self, params):
    return None  # it drafts nothing


def capture_config(target_config, layer_ids: tuple[int, ...]) -> CaptureConfig:
  """The CaptureConfig of a target for features at `layer_ids` (D = len(layer_ids) * hidden)."""
  d = len(layer_ids) * target_config.hidden_size
  if d % 2:
    raise ValueError(f"features of width {d} do not split in two halves")
  layers = config_from_hf({  # one layer of one head: only its cache's shape is used
      "model_type": "qwen3", "vocab_size": target_config.vocab_size,
      "hidden_size": target_config.hidden_size, "intermediate_size": 1, "num_hidden_layers": 1,
      "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": d // 2})
  return CaptureConfig(layers=layers, block_size=1, mask_token_id=0,
                       target_layer_ids=tuple(layer_ids))


def generate_with_features(target, prompts, layer_ids, options: GenerateOptions):
  """The target's AR continuations of `prompts` (options: max_new_tokens, stop ids, temperature,
  seed, attention) and the tap features of every committed token: (new tokens per prompt,
  features per prompt [len(prompt) + len(new) - 1, D] numpy, in the target's dtype). The last
  new token's features are never computed (no forward reads it), as in decoding."""
  options = dataclasses.replace(options, method="ar")
  prompts, options = options.check(target, None, prompts)
  cfg = capture_config(target.config, tuple(layer_ids))
  lens = np.array([len(p) for p in prompts], np.int32)
  tokens = np.zeros((len(prompts), -(-int(lens.max()) // 16) * 16), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  lc = options.loop_config(cfg, target.mesh, target.rules)
  key = jax.random.wrap_key_data(seed_key_data(options.seed), impl="threefry2x32")
  state = decode.prefill(target.params, None, jnp.asarray(tokens), jnp.asarray(lens), key,
                         tcfg=target.config, dcfg=cfg, lc=lc, capacity=options.cache_capacity)
  state = decode.decode_loop(target.params, None, state, tcfg=target.config, dcfg=cfg, lc=lc)
  n_out = np.asarray(state.n_out)
  out = np.asarray(state.out)
  rows = np.asarray(state.draft_cache.lens)
  k, v = np.asarray(state.draft_cache.k[0, :, 0]), np.asarray(state.draft_cache.v[0, :, 0])
  new, features = [], []
  for b, p in enumerate(prompts):
    toks = out[b, :n_out[b]].tolist()
    if options.stop_token_ids:  # cut after the first stop token, as generate does
      stop = [i for i, t in enumerate(toks) if t in options.stop_token_ids]
      toks = toks[:stop[0] + 1] if stop else toks
    n = len(p) + len(toks) - 1
    if rows[b] < n:
      raise AssertionError(f"row {b}: {rows[b]} captured rows for {n} committed tokens")
    new.append(toks)
    features.append(np.concatenate([k[b, :n], v[b, :n]], axis=-1))
  return new, features
