"""Model configuration: the frozen dataclass every function closes over, parsed from HF config.json
(Qwen3 dense, Qwen3-MoE, Llama-3)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "llama")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a Qwen3 (dense or MoE) or Llama-3 decoder (hashable: a jit static arg)."""
  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: tuple[tuple[str, float], ...] = ()  # llama3 scaling fields, sorted
  qk_norm: bool = True
  tie_word_embeddings: bool = False
  eos_token_ids: tuple[int, ...] = ()
  max_position_embeddings: int = 32768
  # Mixture of experts: the layers in moe_layers route each token to num_experts_per_tok of
  # num_experts SwiGLU experts of width moe_intermediate_size (weights renormalised over the
  # chosen ones when norm_topk_prob); the other layers are dense MLPs of intermediate_size.
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = False
  moe_layers: tuple[int, ...] = ()

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                       f"num_key_value_heads={self.num_kv_heads}")
    if self.moe_layers:
      if not 1 <= self.num_experts_per_tok <= self.num_experts:
        raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, "
                         f"num_experts={self.num_experts}]")
      if self.moe_intermediate_size < 1:
        raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size} must be >= 1")
      if not all(0 <= i < self.num_layers for i in self.moe_layers):
        raise ValueError(f"moe_layers {self.moe_layers} outside [0, {self.num_layers})")

  def is_moe(self, layer: int) -> bool:
    """Is layer `layer`'s MLP a mixture of experts?"""
    return layer in self.moe_layers

  def inv_freq(self) -> np.ndarray:
    """RoPE inverse frequencies [head_dim // 2] (float64), with llama3 scaling when configured."""
    inv = 1.0 / (self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))
    if not self.rope_scaling:
      return inv
    s = dict(self.rope_scaling)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled)


# Fields that change the architecture in ways we do not implement: refuse rather than be wrong.
_REFUSE_IF_TRUE = ("attention_bias", "mlp_bias", "use_sliding_window")


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, tuple]:
  """rope_theta and llama3 scaling from top-level fields or nested `rope_parameters`."""
  params = dict(cfg.get("rope_parameters") or {})
  scaling = dict(cfg.get("rope_scaling") or {})
  merged = {**scaling, **params}
  theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
  rope_type = merged.get("rope_type", merged.get("type", "default"))
  if rope_type == "default":
    return float(theta), ()
  if rope_type != "llama3":
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: 'default', 'llama3')")
  keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
  missing = [k for k in keys if k not in merged]
  if missing:
    raise ValueError(f"llama3 rope scaling is missing fields {missing}")
  return float(theta), tuple(sorted((k, float(merged[k])) for k in keys))


def _positive_int(cfg: dict[str, Any], key: str, source: str, default=None) -> int:
  v = cfg.get(key, default)
  if isinstance(v, bool) or not isinstance(v, int) or v < 1:
    raise ValueError(f"{source}: {key} must be a positive integer, got {v!r}")
  return v


def _positive_float(cfg: dict[str, Any], key: str, source: str, default: float) -> float:
  v = cfg.get(key, default)
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
    raise ValueError(f"{source}: {key} must be a finite number > 0, got {v!r}")
  return float(v)


# MoE variants we refuse rather than run wrongly: a shared expert (Qwen2-MoE), other routers.
_MOE_REFUSE = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts",
               "scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor")


def _moe_settings(cfg: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
  """The MoE fields of ModelConfig from a qwen3_moe config.json (none for dense models)."""
  if model_type != "qwen3_moe":
    return {}
  for key in _MOE_REFUSE:
    if cfg.get(key):
      raise ValueError(f"{source}: unsupported mixture-of-experts field {key}={cfg[key]!r} "
                       "(Qwen3-MoE has no shared expert and routes by softmax top-k)")
  experts_key = "num_experts" if "num_experts" in cfg else "num_local_experts"
  experts = _positive_int(cfg, experts_key, source)
  top_k = _positive_int(cfg, "num_experts_per_tok", source)
  if top_k > experts:
    raise ValueError(f"{source}: num_experts_per_tok={top_k} exceeds {experts_key}={experts}")
  step = _positive_int(cfg, "decoder_sparse_step", source, 1)
  dense = cfg.get("mlp_only_layers") or []
  n = cfg["num_hidden_layers"]
  if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < n for i in dense):
    raise ValueError(f"{source}: mlp_only_layers {dense!r} must list layers in [0, {n})")
  layers = tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)
  return dict(num_experts=experts, num_experts_per_tok=top_k,
              moe_intermediate_size=_positive_int(cfg, "moe_intermediate_size", source),
              norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_layers=layers)


def config_from_hf(cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
  """Parses a Hugging Face config.json dict for Qwen3 (dense or MoE) or Llama; raises on what we lack
  and on values out of range, naming `source`."""
  model_type = cfg.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f"{source}: unsupported model_type {model_type!r}; supported: "
                     f"{SUPPORTED_MODEL_TYPES}")
  for key in _REFUSE_IF_TRUE:
    if cfg.get(key):
      raise ValueError(f"{source}: unsupported config field {key}={cfg[key]!r} for {model_type}")
  if cfg.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{source}: unsupported hidden_act {cfg['hidden_act']!r} (only 'silu')")
  layer_types = cfg.get("layer_types")
  if layer_types and any(t != "full_attention" for t in layer_types):
    raise ValueError(f"{source}: unsupported layer_types {sorted(set(layer_types))} (only "
                     "full_attention)")
  for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads"):
    if key not in cfg:
      raise ValueError(f"{source}: config.json lacks required field {key!r}")
    _positive_int(cfg, key, source)
  heads = cfg["num_attention_heads"]
  moe = _moe_settings(cfg, model_type, source)
  kv_heads = _positive_int(cfg, "num_key_value_heads", source, cfg.get("num_key_value_heads")
                           or heads)
  head_dim = _positive_int(cfg, "head_dim", source, cfg.get("head_dim")
                           or cfg["hidden_size"] // heads or None)
  eos = cfg.get("eos_token_id")
  eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
  if any(isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < cfg["vocab_size"]
         for e in eos):
    raise ValueError(f"{source}: eos_token_id {cfg.get('eos_token_id')!r} is not a token id in "
                     f"[0, {cfg['vocab_size']})")
  try:
    theta, scaling = _rope_settings(cfg)
  except ValueError as e:
    raise ValueError(f"{source}: {e}") from None
  if not math.isfinite(theta) or theta <= 0:
    raise ValueError(f"{source}: rope_theta must be a finite number > 0, got {theta!r}")
  try:
    return ModelConfig(
        model_type=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_positive_float(cfg, "rms_norm_eps", source, 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_ids=eos,
        max_position_embeddings=_positive_int(cfg, "max_position_embeddings", source, 32768),
        **moe,
    )
  except ValueError as e:
    raise ValueError(f"{source}: {e}") from None
