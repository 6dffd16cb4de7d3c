"""The target's features at a drafter's tap layers, captured while the target writes its own
continuations (`generate_with_features`): the forwards that generate (the prefill over the prompt,
one AR step per new token) are the ones that compute them, so training data costs no second pass.

It rides on the decode loop's drafter-context path: `CaptureConfig` is a drafter config whose
context rows are the features themselves (split in two halves as its one layer's K and V), so
the loop's own commit writes each committed token's features at its position, and the drafter
cache holds them all when the loop ends.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import sharding
from ddtree_jax.models.drafter import DrafterConfig
from ddtree_jax.models.registry import config_from_hf
from ddtree_jax.request import GenerateOptions
from ddtree_jax.speculative import decode
from ddtree_jax.speculative.sampling import seed_key_data


@dataclasses.dataclass(frozen=True)
class CaptureConfig(DrafterConfig):
  """A drafter config that stores its tap features [B, R, D] as its context rows: the first half
  as K, the second as V, each over the cache's kv heads (as many as the mesh splits kv heads
  over, so that the cache shards as a drafter's does)."""

  def context(self, params, taps, positions):
    b, r, d = taps.shape
    k, v = jnp.split(taps.reshape(b, r, 2, self.layers.num_kv_heads, -1), 2, axis=2)
    return [k[:, :, 0]], [v[:, :, 0]]

  def vocab(self, params):
    return None  # it drafts nothing


def capture_config(target_config, layer_ids: tuple[int, ...], heads: int = 1) -> CaptureConfig:
  """The CaptureConfig of a target for features at `layer_ids` (D = len(layer_ids) * hidden)
  over `heads` kv heads."""
  d = len(layer_ids) * target_config.hidden_size
  if d % (2 * heads):
    raise ValueError(f"features of width {d} do not split into 2 x {heads} equal parts")
  layers = config_from_hf({  # one layer: only its cache's shape is used
      "model_type": "qwen3", "vocab_size": target_config.vocab_size,
      "hidden_size": target_config.hidden_size, "intermediate_size": 1, "num_hidden_layers": 1,
      "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": d // (2 * heads)})
  return CaptureConfig(layers=layers, block_size=1, mask_token_id=0,
                       target_layer_ids=tuple(layer_ids))


def generate_with_features(target, prompts, layer_ids, options: GenerateOptions):
  """The target's AR continuations of `prompts` (options: max_new_tokens, stop ids, temperature,
  seed, attention) and the tap features of every committed token: (new tokens per prompt,
  features per prompt [len(prompt) + len(new) - 1, D] numpy, in the target's dtype). The last
  new token's features are never computed (no forward reads it), as in decoding."""
  options = dataclasses.replace(options, method="ar")
  prompts, options = options.check(target, None, prompts)
  mesh, rules = target.mesh, target.rules
  split = (rules or sharding.DEFAULT_RULES).kv_heads
  cfg = capture_config(target.config, tuple(layer_ids),
                       1 if mesh is None or split is None else mesh.shape.get(split, 1))
  lens = np.array([len(p) for p in prompts], np.int32)
  tokens = np.zeros((len(prompts), -(-int(lens.max()) // 16) * 16), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  lc = options.loop_config(cfg, mesh, rules)
  key = jax.random.wrap_key_data(seed_key_data(options.seed), impl="threefry2x32")
  tokens, lens = sharding.pad_batch((tokens, lens), mesh, rules)  # batch: a multiple of dp
  state = decode.prefill(target.params, None, sharding.put_batch(tokens, mesh, rules),
                         sharding.put_batch(lens, mesh, rules), sharding.replicate(key, mesh),
                         tcfg=target.config, dcfg=cfg, lc=lc, capacity=options.cache_capacity)
  state = decode.decode_loop(target.params, None, state, tcfg=target.config, dcfg=cfg, lc=lc)
  dc = state.draft_cache
  n_out, out, rows, k, v = sharding.to_host((state.n_out, state.out, dc.lens, dc.k[0], dc.v[0]))
  k, v = (x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1) for x in (k, v))
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
