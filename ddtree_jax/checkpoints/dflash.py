"""DFlash drafters in z-lab's Hugging Face format: config.json (a Qwen3 layer stack plus
`dflash_config`) checked against the target it drafts for, and its safetensors placed on the
target's devices (the embedding and lm_head are the target's, never copied). The layers' RoPE is
the drafter's own config's (default, llama3 or yarn; e.g. the Kimi drafters' YaRN), not the
target's."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import numpy as np

from ddtree_jax import sharding
from ddtree_jax.checkpoints.hf import (Target, place_sharded, parse_dtype, read_checkpoint_tensors,
                                       read_config)
from ddtree_jax.checkpoints.safetensors_io import CheckpointError
from ddtree_jax.checkpoints.tensor_reader import TensorReader
from ddtree_jax.models import qwen3
from ddtree_jax.models.config import ModelConfig, decoder_config
from ddtree_jax.models.drafter import (DrafterConfig, DrafterParams, default_target_layer_ids,
                                       quantize_int8, restrict_vocab)


# Drafter variants we refuse (until implemented) rather than run wrongly.
_DRAFTER_VARIANT_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                           "attention_sinks", "num_attention_sinks", "sliding_window_size")
# transformers' Qwen3Config (z-lab's drafter config class) defaults for its window fields
_HF_SLIDING_WINDOW, _HF_MAX_WINDOW_LAYERS = 4096, 28
_DRAFTER_UNIT_FIELDS = ("input_embedding_scale", "output_multiplier")


@dataclasses.dataclass(frozen=True)
class Drafter:
  """A loaded DFlash drafter; the target's embedding and lm_head are shared, never copied (an
  int8 drafter holds its own int8 copy of the lm_head, and its layers' k/v weights once more,
  stacked for the context rows)."""
  params: Any                     # drafter.DrafterParams
  config: Any                     # drafter.DrafterConfig
  path: str | None = None


_DFLASH_KNOWN_FIELDS = ("mask_token_id", "mask_token", "target_layer_ids", "block_size",
                        "num_target_layers")

# Rope types of the drafter's own layers beside "default". The reference DFlashDraftModel builds
# its RoPE from its own config (transformers' Qwen3RotaryEmbedding: ROPE_INIT_FUNCTIONS by
# rope_type); linear, dynamic and longrope are refused by name.
_DRAFTER_ROPE_TYPES = ("llama3", "yarn")


def drafter_layers_config(cfg: dict[str, Any], source: str = "drafter") -> ModelConfig:
  """The drafter's layer stack (Qwen3 layers) with its own RoPE, read as transformers 4.57
  (z-lab's pinned version) reads a Qwen3Config's: rope_scaling or rope_parameters of type
  default, llama3 or yarn; a yarn without original_max_position_embeddings falls back to
  max_position_embeddings. What that RoPE has and we do not (a partial rotary factor, yarn's
  untruncated correction range) is refused rather than ignored."""
  rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor"))
  if partial is not None and float(partial) != 1.0:
    raise ValueError(f"{source}: unsupported DFlash variant: partial_rotary_factor != 1 in the "
                     "drafter's RoPE")
  if rope_type == "yarn" and rope.get("truncate") is False:
    raise ValueError(f"{source}: unsupported DFlash variant: yarn rope with truncate=false "
                     "(only the truncated correction range)")
  if rope_type == "yarn" and rope.get("original_max_position_embeddings") is None:
    rope["original_max_position_embeddings"] = cfg.get("max_position_embeddings", 32768)
    cfg = {**cfg, "rope_scaling": rope, "rope_parameters": None}
  # (decoder_config refuses use_sliding_window for targets; a drafter's is read by `windows`)
  return decoder_config({**cfg, "model_type": "qwen3", "use_sliding_window": False}, source,
                        qk_norm=True,
                        rope_types=_DRAFTER_ROPE_TYPES, family_fields=lambda: windows(cfg, source),
                        layer_kinds=("full_attention", "sliding_attention"))


def windows(cfg: dict[str, Any], source: str) -> dict[str, Any]:
  """The drafter layers' sliding windows as transformers' Qwen3Config reads them: the window is
  `sliding_window` only when `use_sliding_window` (else none at all), and applies to the layers
  that `layer_types` marks sliding_attention (by default those from `max_window_layers` on)."""
  n = cfg.get("num_hidden_layers")
  window = cfg.get("sliding_window", _HF_SLIDING_WINDOW) if cfg.get("use_sliding_window") else None
  types = cfg.get("layer_types") or [
      "sliding_attention" if window is not None and i >= cfg.get("max_window_layers",
                                                                  _HF_MAX_WINDOW_LAYERS)
      else "full_attention" for i in range(n or 0)]
  if window is None or "sliding_attention" not in types:
    return {}
  if isinstance(window, bool) or not isinstance(window, int) or window < 1:
    raise ValueError(f"{source}: sliding_window must be a positive integer, got {window!r}")
  if len(types) != n:
    raise ValueError(f"{source}: layer_types lists {len(types)} layers, num_hidden_layers={n}")
  return dict(layer_types=tuple(types), sliding_window=window)


def drafter_config_from_hf(cfg: dict[str, Any], target: ModelConfig, source: str = "drafter",
                           allow_layer_mismatch: bool = False):
  """Parses a z-lab DFlash config.json against the target it drafts for. A `num_target_layers`
  other than the target's is refused (the drafter was trained on another model's features)
  unless allow_layer_mismatch; unknown `dflash_config` keys are warned about by name."""
  dflash = cfg.get("dflash_config") or {}
  if not isinstance(dflash, dict):
    raise CheckpointError(f"{source}: dflash_config must be a JSON object")
  unknown = sorted(set(dflash) - set(_DFLASH_KNOWN_FIELDS) - set(_DRAFTER_VARIANT_FIELDS)
                   - set(_DRAFTER_UNIT_FIELDS) - {"final_logit_softcapping", "is_causal"})
  if unknown:
    logging.getLogger(__name__).warning("%s: dflash_config keys %s are not used by this loader",
                                        source, unknown)
  value = lambda name, default=None: dflash.get(name, cfg.get(name, default))
  n_target = value("num_target_layers")
  if n_target is not None and int(n_target) != target.num_layers and not allow_layer_mismatch:
    raise CheckpointError(f"{source}: the drafter was made for a {n_target}-layer target, this "
                          f"target has {target.num_layers} layers (load_drafter(..., "
                          "allow_layer_mismatch=True) to use it anyway)")
  for name in _DRAFTER_VARIANT_FIELDS:
    if value(name) is not None:
      raise ValueError(f"unsupported DFlash variant: config field {name!r} is set")
  for name in _DRAFTER_UNIT_FIELDS:
    if float(value(name, 1.0)) != 1.0:
      raise ValueError(f"unsupported DFlash variant: {name}={value(name)} (only 1.0)")
  if value("final_logit_softcapping"):
    raise ValueError("unsupported DFlash variant: final_logit_softcapping is set")
  if value("is_causal"):
    raise ValueError("unsupported DFlash variant: is_causal=true (DFlash blocks are non-causal)")
  layers = drafter_layers_config(cfg, source)
  if layers.hidden_size != target.hidden_size:
    raise ValueError(f"drafter hidden_size {layers.hidden_size} != target hidden_size "
                     f"{target.hidden_size}")
  if layers.vocab_size != target.vocab_size:
    raise ValueError(f"drafter vocab_size {layers.vocab_size} != target vocab_size "
                     f"{target.vocab_size}")
  mask = value("mask_token_id")
  if mask is None or not 0 <= int(mask) < target.vocab_size:
    raise ValueError(f"mask_token_id {mask!r} is not a token of the target vocab "
                     f"[0, {target.vocab_size})")
  ids = value("target_layer_ids")
  if ids is None:
    ids = default_target_layer_ids(int(value("num_target_layers", target.num_layers)),
                                   layers.num_layers)
  ids = tuple(int(i) for i in ids)
  bad = [i for i in ids if not 0 <= i < target.num_layers]
  if bad:
    raise ValueError(f"target_layer_ids {bad} out of range for a {target.num_layers}-layer target")
  block = int(value("block_size", 16))
  if block < 2:
    raise ValueError(f"block_size {block} < 2 drafts nothing")
  return DrafterConfig(layers=layers, block_size=block, mask_token_id=int(mask),
                       target_layer_ids=ids)


def load_drafter(path: str, target: Target, dtype=None, int8: bool = False,
                 draft_vocab=None, allow_layer_mismatch: bool = False) -> Drafter:
  """Loads a z-lab-format DFlash drafter directory for `target` (dtype defaults to the target's).
  On a sharded target the drafter is sharded on the same mesh with the same rules.
  int8=True: an int8 (W8A8) drafter with its own int8 lm_head (`drafter.quantize_int8`).
  draft_vocab: vocabulary ids [Vd] (or a .npy file of them) the drafter drafts over, with its own
  lm_head over those ids (`drafter.restrict_vocab`); None: the whole vocabulary.
  allow_layer_mismatch: accept a drafter whose num_target_layers is not the target's."""
  if not isinstance(target, Target):
    raise TypeError(f"load_drafter needs the Target it drafts for, got {type(target).__name__}")
  cfg = drafter_config_from_hf(read_config(path), target.config,
                               source=os.path.join(path, "config.json"),
                               allow_layer_mismatch=allow_layer_mismatch)
  dtype = target.dtype if dtype is None else parse_dtype(dtype)
  r = TensorReader(read_checkpoint_tensors(path), path)
  h, lc = target.config.hidden_size, cfg.layers
  host = DrafterParams(
      fc=r.linear("fc.weight", h, len(cfg.target_layer_ids) * h),
      hidden_norm=r.get("hidden_norm.weight", (h,)),
      layers=[qwen3.dense_layer(r, f"layers.{i}.", lc) for i in range(lc.num_layers)],
      final_norm=r.get("norm.weight", (h,)),
  )
  r.check_complete(hint=f"Does config.json (num_hidden_layers {lc.num_layers}) describe this "
                        "drafter?")
  params = derive_drafter_params(place_sharded(host, dtype, target.mesh, target.rules), target,
                                 int8=int8, draft_vocab=draft_vocab)
  return Drafter(params=params, config=cfg, path=path)


def derive_drafter_params(params, target: Target, int8: bool = False, draft_vocab=None):
  """Float drafter params -> what load_drafter returns: int8 (`drafter.quantize_int8`) and/or
  drafting over `draft_vocab` (ids or a .npy file of them; `drafter.restrict_vocab`), placed on
  the target's mesh."""
  if int8:
    params = jax.jit(quantize_int8)(params, target.params)
  if draft_vocab is not None:
    if isinstance(draft_vocab, str):
      draft_vocab = np.load(draft_vocab, allow_pickle=False)
    params = restrict_vocab(params, target.params, draft_vocab)
  if int8 or draft_vocab is not None:
    params = sharding.shard_params(params, target.mesh, target.rules)
  return params
