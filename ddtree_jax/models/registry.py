"""Model families by Hugging Face `model_type`: each family's module parses its config.json and
names its tensors (`family.Family`); the loader finds the family here. A new family is a module
and one `register` call: no engine file changes (tests/test_registry.py registers a toy one)."""

from __future__ import annotations

from typing import Any

from ddtree_jax.models import deepseek_v3, gpt_oss, kimi_k25, qwen3, qwen3_5, qwen3_moe
from ddtree_jax.models.config import ModelConfig
from ddtree_jax.models.family import Family

_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
  """Adds `family` for each of its model_types; a model_type another family holds is refused."""
  taken = [t for t in family.model_types if _FAMILIES.get(t, family) is not family]
  if taken:
    raise ValueError(f"model_type(s) {taken} already registered")
  for t in family.model_types:
    _FAMILIES[t] = family
  return family


def unregister(family: Family) -> None:
  """Removes `family`'s model_types (tests that register a family of their own)."""
  for t in family.model_types:
    if _FAMILIES.get(t) is family:
      del _FAMILIES[t]


def supported() -> tuple[str, ...]:
  """The registered model_types, sorted."""
  return tuple(sorted(_FAMILIES))


def lookup(model_type: Any, source: str = "config.json") -> Family:
  """The family of `model_type`; ValueError naming source and the supported types otherwise."""
  if not isinstance(model_type, str) or model_type not in _FAMILIES:
    raise ValueError(f"{source}: unsupported model_type {model_type!r}; supported: "
                     f"{supported()}")
  return _FAMILIES[model_type]


def config_from_hf(cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
  """Parses a Hugging Face config.json dict with its family's parser (by `model_type`)."""
  return lookup(cfg.get("model_type"), source).config(cfg, source)


for _family in (qwen3.QWEN3, qwen3.LLAMA, qwen3_moe.FAMILY, deepseek_v3.FAMILY, kimi_k25.FAMILY,
                qwen3_5.FAMILY, gpt_oss.FAMILY):
  register(_family)
