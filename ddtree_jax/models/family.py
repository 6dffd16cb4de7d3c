"""A model family: how one architecture's Hugging Face checkpoints map onto the engine's layer
kinds. `registry.register(Family(...))` adds one; nothing else in the engine changes."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


def _reads_everything(raw, cfg) -> tuple:
  return ()


@dataclasses.dataclass(frozen=True)
class Family:
  """A registry entry, for the HF `model_type`s it names.

  config(config.json dict, source) -> `ModelConfig` (refusing what it does not implement, naming
  source; `config.decoder_config` parses the shared fields);
  params(reader, cfg, config.json dict, fuse_qkv) -> host `decoder.Params` of lazy tensor views
  (`tensor_reader.TensorReader`; fuse_qkv: GQA q/k/v as one wqkv, `decoder.fuse_qkv`'s layout);
  skip(config.json dict, cfg) -> regex patterns of tensors a checkpoint may hold that the
  family's forward does not use (the strict loader refuses any other unread tensor)."""
  model_types: tuple[str, ...]
  config: Callable[[dict[str, Any], str], Any]
  params: Callable[..., Any]
  skip: Callable[[dict[str, Any], Any], tuple] = _reads_everything
