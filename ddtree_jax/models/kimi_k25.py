"""Kimi K2.5 / K2.6 as Moonshot publishes them (HF `KimiK25ForConditionalGeneration`,
`model_type` kimi_k25): a vision-language wrapper around a DeepSeek-V3 text model
(`deepseek_v3.py`). Only the text model is loaded: its config is `text_config` (own model_type
kimi_k2), its tensors are named `language_model.model.*` and `language_model.lm_head.weight`.
The vision tower (`vision_tower.*`), its projector (`mm_projector.*`) and the
multi-token-prediction layers are on the loader's skip list; the wrapper's other fields
(`vision_config`, `media_placeholder_token_id`, `auto_map`) are not read, and no code shipped
beside the weights is ever executed. The routed experts ship as compressed-tensors int4
(`checkpoints/quantized.py`) and stay int4 on the device.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from ddtree_jax.checkpoints.tensor_reader import TensorReader
from ddtree_jax.models import deepseek_v3
from ddtree_jax.models.config import ModelConfig
from ddtree_jax.models.decoder import Params
from ddtree_jax.models.family import Family

TEXT_MODEL_TYPES = ("kimi_k2", "deepseek_v3")
PREFIX = "language_model."


def text_config(raw: dict[str, Any], source: str) -> dict[str, Any]:
  """The wrapper's `text_config` (a DeepSeek-V3 config.json dict)."""
  text = raw.get("text_config")
  if not isinstance(text, dict):
    raise ValueError(f"{source}: a kimi_k25 config.json needs a text_config object (the "
                     "DeepSeek-V3 text model)")
  if text.get("model_type") not in TEXT_MODEL_TYPES:
    raise ValueError(f"{source}: text_config.model_type={text.get('model_type')!r}; a kimi_k25 "
                     f"wrapper holds one of {TEXT_MODEL_TYPES}")
  return text


def config(raw: dict[str, Any], source: str) -> ModelConfig:
  text = text_config(raw, source)
  return dataclasses.replace(deepseek_v3.config(text, f"{source} (text_config)"),
                             model_type="kimi_k25")


def params(r: TensorReader, cfg: ModelConfig, raw: dict, fuse_qkv: bool = False) -> Params:
  return deepseek_v3.params(r.with_prefix(PREFIX), cfg, text_config(raw, "config.json"), fuse_qkv)


def skip(raw: dict[str, Any], cfg: ModelConfig) -> tuple[re.Pattern, ...]:
  """The vision tower, its projector and the text model's multi-token-prediction layers."""
  return ((re.compile(r"^vision_tower\."), re.compile(r"^mm_projector\."))
          + deepseek_v3.mtp_layers(text_config(raw, "config.json"), cfg, prefix=PREFIX))


FAMILY = Family(model_types=("kimi_k25",), config=config, params=params, skip=skip)
