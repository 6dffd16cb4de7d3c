"""Model configuration: the frozen dataclass every function closes over, and the parsing of a HF
config.json that every family shares (`decoder_config`); each family's own fields are parsed in
its module (qwen3.py, qwen3_moe.py, deepseek_v3.py), found by model_type in registry.py."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np

from ddtree_jax.models.gated_deltanet import GDNDims
from ddtree_jax.models.moe import Routing

# HF layer_types: attention, Gated DeltaNet, windowed attention (drafters: `window`)
LAYER_KINDS = ("full_attention", "linear_attention", "sliding_attention")

@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a decoder of any family here (hashable: a jit static arg): Qwen3 and Llama-3
  (GQA attention, dense SwiGLU MLPs), Qwen3-MoE (softmax-routed experts in moe_layers), DeepSeek-V3
  / Kimi-K2 (multi-head latent attention when kv_lora_rank > 0, sigmoid group-limited routing,
  shared experts), the Qwen3.5 / Qwen3-Next hybrids (Gated DeltaNet layers among gated
  attention ones). Fields a family lacks keep their defaults."""
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
  rope_type: str = "default"  # "default", "llama3" or "yarn"
  rope_scaling: tuple[tuple[str, float], ...] = ()  # the rope_type's scaling fields, sorted
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
  # DeepSeekMoE routing (moe.Routing): sigmoid scores plus a selection bias, top-k within the
  # topk_group best of n_group expert groups, weights times routed_scaling_factor; and
  # n_shared_experts always-on experts (one dense MLP of n_shared x moe_intermediate_size)
  scoring_func: str = "softmax"
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  n_shared_experts: int = 0
  # Multi-head latent attention (DeepSeek-V3) when kv_lora_rank > 0: queries through a rank
  # q_lora_rank bottleneck (0: a full projection), keys / values from a kv_lora_rank latent
  # plus one shared RoPE key of qk_rope_head_dim; heads of qk_nope + qk_rope (scores) and
  # v_head_dim (values). rope_interleave: the checkpoint's RoPE dims come in (even, odd) pairs.
  q_lora_rank: int = 0
  kv_lora_rank: int = 0
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  rope_interleave: bool = False
  # Hybrids (Qwen3.5, Qwen3-Next): layer i is a Gated DeltaNet layer of `gdn`'s widths when
  # layer_types[i] is "linear_attention" (() : every layer attention). Their attention layers
  # gate the output per head (attn_output_gate: q_proj also yields a sigmoid gate) and rotate the
  # first partial_rotary_factor of each head's dims; their MoE layers add one shared expert of
  # shared_expert_size behind a sigmoid gate.
  layer_types: tuple[str, ...] = ()
  gdn: GDNDims | None = None
  attn_output_gate: bool = False
  partial_rotary_factor: float = 1.0
  shared_expert_size: int = 0
  # "sliding_attention" layers see only keys within sliding_window - 1 positions of the query
  # (`window`): a DFlash drafter's, and a causal target's (gpt-oss: keys in (p - W, p]).
  sliding_window: int = 0
  # gpt-oss: q/k/v/o projections with biases (attention_bias); a learned logit per query head
  # that joins each softmax's denominator and adds no value (attention_sinks); routers and
  # experts with biases (moe_bias); the experts' clamped SwiGLU of (alpha, limit),
  # (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit)
  # (swiglu_clamp; (): silu(gate) * up).
  attention_bias: bool = False
  attention_sinks: bool = False
  moe_bias: bool = False
  swiglu_clamp: tuple[float, float] = ()

  def __post_init__(self):
    if self.layer_types:
      if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_KINDS):
        raise ValueError(f"layer_types {self.layer_types} must give one of {LAYER_KINDS} for each "
                         f"of the {self.num_layers} layers")
      if "sliding_attention" in self.layer_types and self.sliding_window < 1:
        raise ValueError("sliding_attention layers need a sliding_window >= 1")
      if (self.gdn is None) == ("linear_attention" in self.layer_types):
        raise ValueError("linear_attention layers need their Gated DeltaNet widths (gdn), and "
                         "only they")
    if not 0 < self.partial_rotary_factor <= 1:
      raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1]")
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

  def is_recurrent(self, layer: int) -> bool:
    """Is layer `layer` a Gated DeltaNet layer (a recurrent state, no KV rows)?"""
    return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

  def window(self, layer: int) -> int | None:
    """W of a sliding_attention layer (None: full): a query at position p sees the keys at
    positions k with |p - k| < W, flash-attention's symmetric window (W - 1, W - 1) that the
    DFlash reference asks for through transformers; in a causal target (its queries see no
    later key) the keys in (p - W, p], as transformers' sliding-window causal mask."""
    if self.layer_types and self.layer_types[layer] == "sliding_attention":
      return self.sliding_window
    return None

  @property
  def attention_layers(self) -> tuple[int, ...]:
    """Ids of the layers with KV rows, in order (the cache's k / v hold these)."""
    return tuple(i for i in range(self.num_layers) if not self.is_recurrent(i))

  @property
  def recurrent_layers(self) -> tuple[int, ...]:
    """Ids of the Gated DeltaNet layers, in order (the cache's state / window hold these)."""
    return tuple(i for i in range(self.num_layers) if self.is_recurrent(i))

  @property
  def shared_width(self) -> int:
    """The width of a MoE layer's always-on MLP beside its experts: Qwen's shared expert or
    DeepSeek's n_shared experts as one (0: none)."""
    return self.shared_expert_size or self.n_shared_experts * self.moe_intermediate_size

  @property
  def routing(self):
    """The MoE layers' `moe.Routing`."""
    return Routing(top_k=self.num_experts_per_tok, norm_topk_prob=self.norm_topk_prob,
                   scoring=self.scoring_func, n_group=self.n_group, topk_group=self.topk_group,
                   scaling=self.routed_scaling_factor)

  @property
  def is_mla(self) -> bool:
    """Multi-head latent attention (DeepSeek-V3) rather than GQA?"""
    return self.kv_lora_rank > 0

  @property
  def rope_dim(self) -> int:
    """Dims per head that RoPE rotates: qk_rope_head_dim (MLA), else head_dim times
    partial_rotary_factor (the first ones; the rest pass through)."""
    return self.qk_rope_head_dim if self.is_mla else int(self.head_dim * self.partial_rotary_factor)

  @property
  def cache_layout(self) -> tuple[int, int, int]:
    """(heads, k width, v width) of a KV cache row per layer: GQA (K, D, D); MLA one latent
    row (1, kv_lora_rank + qk_rope_head_dim, 0) that serves as both key and value."""
    if self.is_mla:
      return 1, self.kv_lora_rank + self.qk_rope_head_dim, 0
    return self.num_kv_heads, self.head_dim, self.head_dim

  def _yarn_mscale(self, mscale: float) -> float:
    factor = dict(self.rope_scaling)["factor"]
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

  @property
  def rope_attention_factor(self) -> float:
    """YaRN's factor on cos / sin (1 elsewhere): mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) when both are set, else mscale(factor, 1), as HF's yarn."""
    if self.rope_type != "yarn":
      return 1.0
    s = dict(self.rope_scaling)
    if s.get("attention_factor"):
      return s["attention_factor"]
    if s.get("mscale") and s.get("mscale_all_dim"):
      return self._yarn_mscale(s["mscale"]) / self._yarn_mscale(s["mscale_all_dim"])
    return self._yarn_mscale(1.0)

  @property
  def attention_scale(self) -> float:
    """The softmax scale: head_dim ** -0.5; MLA (qk_nope + qk_rope) ** -0.5, times
    mscale(factor, mscale_all_dim) ** 2 under YaRN with mscale_all_dim (DeepSeek-V3, as HF)."""
    if not self.is_mla:
      return self.head_dim ** -0.5
    scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
    all_dim = dict(self.rope_scaling).get("mscale_all_dim") if self.rope_type == "yarn" else 0
    return scale * self._yarn_mscale(all_dim) ** 2 if all_dim else scale

  def inv_freq(self) -> np.ndarray:
    """RoPE inverse frequencies [rope_dim // 2] (float64), llama3 or YaRN scaled when set."""
    d = self.rope_dim
    inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if self.rope_type == "yarn":
      return self._yarn_inv_freq(inv)
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

  def _yarn_inv_freq(self, inv: np.ndarray) -> np.ndarray:
    """YaRN: interpolated (inv / factor) below the correction range, extrapolated (inv) above,
    a linear ramp between (the range's ends rounded outwards unless truncate is 0, as HF)."""
    s, d = dict(self.rope_scaling), self.rope_dim
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    dim_of = lambda rot: d * math.log(old_len / (rot * 2 * math.pi)) / (2 * math.log(self.rope_theta))
    low, high = dim_of(s.get("beta_fast", 32.0)), dim_of(s.get("beta_slow", 1.0))
    if s.get("truncate", 1.0):  # HF's default; gpt-oss ships truncate: false
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    return inv / factor * (1 - extrapolate) + inv * extrapolate


# Fields that change the architecture in ways we do not implement: refuse rather than be wrong.
_REFUSE_IF_TRUE = ("attention_bias", "mlp_bias", "use_sliding_window")


_ROPE_FIELDS = {
    "llama3": (("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
              "truncate")),
}


def rope_settings(cfg: dict[str, Any], allowed=tuple(_ROPE_FIELDS)) -> tuple[float, str, tuple]:
  """rope_theta, rope_type and its scaling fields from top-level fields or nested
  `rope_parameters` / `rope_scaling`."""
  params = dict(cfg.get("rope_parameters") or {})
  scaling = dict(cfg.get("rope_scaling") or {})
  merged = {**scaling, **params}
  theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
  rope_type = merged.get("rope_type", merged.get("type", "default"))
  if rope_type == "default":
    return float(theta), "default", ()
  if rope_type not in allowed:
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported here: 'default', "
                     f"{', '.join(repr(k) for k in allowed)})")
  needed, optional = _ROPE_FIELDS[rope_type]
  missing = [k for k in needed if merged.get(k) is None]
  if missing:
    raise ValueError(f"{rope_type} rope scaling is missing fields {missing}")
  fields = [(k, float(merged[k])) for k in needed + optional if merged.get(k) is not None]
  bad = [k for k, v in fields if not math.isfinite(v) or v < 0]
  if bad:
    raise ValueError(f"{rope_type} rope scaling fields {bad} must be finite numbers >= 0")
  return float(theta), rope_type, tuple(sorted(fields))


def positive_int(cfg: dict[str, Any], key: str, source: str, default=None) -> int:
  v = cfg.get(key, default)
  if isinstance(v, bool) or not isinstance(v, int) or v < 1:
    raise ValueError(f"{source}: {key} must be a positive integer, got {v!r}")
  return v


def positive_float(cfg: dict[str, Any], key: str, source: str, default: float) -> float:
  v = cfg.get(key, default)
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
    raise ValueError(f"{source}: {key} must be a finite number > 0, got {v!r}")
  return float(v)


def decoder_config(cfg: dict[str, Any], source: str, *, qk_norm: bool,
                   rope_types: tuple[str, ...] = ("llama3",),
                   family_fields: Callable[[], dict[str, Any]] = dict,
                   layer_kinds: tuple[str, ...] = ("full_attention",),
                   attention_bias: bool = False) -> ModelConfig:
  """The ModelConfig of a config.json dict (`auto_map` and any code beside it never imported):
  the fields every family shares, checked, plus a family's own, which `family_fields()` parses
  once the shared ones are known to be there (ModelConfig fields; a head_dim among them replaces
  config.json's). Raises ValueError naming `source` on what is not implemented and on values out
  of range. attention_bias: the family reads q/k/v/o biases (config.json's field not refused)."""
  model_type = cfg.get("model_type")
  for key in _REFUSE_IF_TRUE:
    if cfg.get(key) and not (attention_bias and key == "attention_bias"):
      raise ValueError(f"{source}: unsupported config field {key}={cfg[key]!r} for {model_type}")
  if cfg.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{source}: unsupported hidden_act {cfg['hidden_act']!r} (only 'silu')")
  layer_types = cfg.get("layer_types")
  if layer_types is not None and (not isinstance(layer_types, list)
                                  or any(t not in layer_kinds for t in layer_types)):
    raise ValueError(f"{source}: unsupported layer_types {layer_types!r} (supported here: "
                     f"{', '.join(layer_kinds)})")
  require_positive(cfg, source, "vocab_size", "hidden_size", "intermediate_size",
                   "num_hidden_layers", "num_attention_heads")
  heads = cfg["num_attention_heads"]
  fields = family_fields()
  kv_heads = positive_int(cfg, "num_key_value_heads", source, cfg.get("num_key_value_heads")
                          or heads)
  head_dim = fields.pop("head_dim", None)
  if head_dim is None:
    head_dim = positive_int(cfg, "head_dim", source, cfg.get("head_dim")
                            or cfg["hidden_size"] // heads or None)
  eos = cfg.get("eos_token_id")
  eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
  if any(isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < cfg["vocab_size"]
         for e in eos):
    raise ValueError(f"{source}: eos_token_id {cfg.get('eos_token_id')!r} is not a token id in "
                     f"[0, {cfg['vocab_size']})")
  partial = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}.get(
      "partial_rotary_factor", cfg.get("partial_rotary_factor"))
  if partial not in (None, 1, 1.0) and "partial_rotary_factor" not in fields:
    raise ValueError(f"{source}: unsupported partial_rotary_factor={partial!r} for {model_type} "
                     "(only its hybrids rotate part of each head)")
  try:
    theta, rope_type, scaling = rope_settings(cfg, rope_types)
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
        rms_norm_eps=positive_float(cfg, "rms_norm_eps", source, 1e-6),
        rope_theta=theta,
        rope_type=rope_type,
        rope_scaling=scaling,
        qk_norm=qk_norm,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_ids=eos,
        max_position_embeddings=positive_int(cfg, "max_position_embeddings", source, 32768),
        **fields,
    )
  except ValueError as e:
    raise ValueError(f"{source}: {e}") from None


def require_positive(cfg: dict[str, Any], source: str, *keys: str) -> None:
  """Each of `keys` is present and a positive integer."""
  for key in keys:
    if key not in cfg:
      raise ValueError(f"{source}: config.json lacks required field {key!r}")
    positive_int(cfg, key, source)
