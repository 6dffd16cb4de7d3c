"""DeepSeek-V3 and Kimi-K2 (HF `DeepseekV3ForCausalLM`, `model_type` deepseek_v3 or kimi_k2):
multi-head latent attention (`mla.py`) in every layer; after `first_k_dense_replace` dense
layers, DeepSeekMoE: a sigmoid router with a selection bias, top-k within the best `topk_group`
of `n_group` expert groups, weights times `routed_scaling_factor`, and `n_shared_experts`
always-on experts (one dense SwiGLU beside the routed ones). FP8 block-quantised checkpoints are
read through `tensor_reader`; multi-token-prediction layers are skipped.

Tensor names beside Qwen3-MoE's: `self_attn.q_a_proj` + `q_a_layernorm` + `q_b_proj` (or
`q_proj` without a q bottleneck), `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`;
`mlp.gate.e_score_correction_bias`; `mlp.shared_experts.{gate,up,down}_proj.weight`.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np

from ddtree_jax.checkpoints.tensor_reader import TensorReader
from ddtree_jax.models import qwen3, qwen3_moe
from ddtree_jax.models.config import ModelConfig, decoder_config, positive_float, positive_int
from ddtree_jax.models.decoder import LayerParams, Params
from ddtree_jax.models.family import Family
from ddtree_jax.models.mla import MLAParams, rope_pairs_to_halves

_DEEPSEEK_ROUTERS = {("sigmoid", "noaux_tc"): True, ("softmax", "greedy"): False}  # -> bias


def deepseek_settings(cfg: dict[str, Any], source: str) -> dict[str, Any]:
  """MLA and DeepSeekMoE fields of a DeepseekV3ForCausalLM config.json (Kimi-K2 too), and the
  head_dim of a head's scores (nope + rope; HF writes head_dim = qk_rope_head_dim)."""
  n = cfg["num_hidden_layers"]
  out: dict[str, Any] = dict(
      q_lora_rank=0 if cfg.get("q_lora_rank") is None else positive_int(cfg, "q_lora_rank",
                                                                          source),
      kv_lora_rank=positive_int(cfg, "kv_lora_rank", source),
      qk_nope_head_dim=positive_int(cfg, "qk_nope_head_dim", source),
      qk_rope_head_dim=positive_int(cfg, "qk_rope_head_dim", source),
      v_head_dim=positive_int(cfg, "v_head_dim", source),
      rope_interleave=bool(cfg.get("rope_interleave", True)))
  if out["qk_rope_head_dim"] % 2:
    raise ValueError(f"{source}: qk_rope_head_dim={out['qk_rope_head_dim']} must be even")
  out["head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
  if cfg.get("n_routed_experts") is None:
    return out
  experts = positive_int(cfg, "n_routed_experts", source)
  top_k = positive_int(cfg, "num_experts_per_tok", source)
  if top_k > experts:
    raise ValueError(f"{source}: num_experts_per_tok={top_k} exceeds n_routed_experts={experts}")
  scoring = cfg.get("scoring_func", "sigmoid")  # HF's DeepseekV3 router is sigmoid only
  method = cfg.get("topk_method", "noaux_tc" if scoring == "sigmoid" else "greedy")
  if (scoring, method) not in _DEEPSEEK_ROUTERS:
    raise ValueError(f"{source}: unsupported router scoring_func={scoring!r} with topk_method="
                     f"{method!r} (supported: {sorted(_DEEPSEEK_ROUTERS)})")
  groups = positive_int(cfg, "n_group", source, cfg.get("n_group") or 1)
  topk_group = positive_int(cfg, "topk_group", source, cfg.get("topk_group") or 1)
  if experts % groups or topk_group > groups:
    raise ValueError(f"{source}: n_group={groups} must divide n_routed_experts={experts} and be "
                     f">= topk_group={topk_group}")
  if experts // groups < 2 and groups > 1:
    raise ValueError(f"{source}: group-limited routing needs >= 2 experts per group")
  if top_k > topk_group * (experts // groups):
    raise ValueError(f"{source}: num_experts_per_tok={top_k} exceeds the experts of topk_group="
                     f"{topk_group} groups")
  first = cfg.get("first_k_dense_replace") or 0
  freq = positive_int(cfg, "moe_layer_freq", source, cfg.get("moe_layer_freq") or 1)
  if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first <= n:
    raise ValueError(f"{source}: first_k_dense_replace={first!r} must be in [0, {n}]")
  shared = cfg.get("n_shared_experts") or 0
  if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
    raise ValueError(f"{source}: n_shared_experts={shared!r} must be an integer >= 0")
  out.update(
      num_experts=experts, num_experts_per_tok=top_k,
      moe_intermediate_size=positive_int(cfg, "moe_intermediate_size", source),
      norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), scoring_func=scoring,
      n_group=groups, topk_group=topk_group, n_shared_experts=shared,
      routed_scaling_factor=positive_float(cfg, "routed_scaling_factor", source, 1.0),
      moe_layers=tuple(i for i in range(first, n) if i % freq == 0))
  return out


def latent_attention(r: TensorReader, prefix: str, cfg: ModelConfig) -> MLAParams:
  """A latent-attention block (`mla.MLAParams`); interleaved RoPE dims are reordered into
  halves (`mla.rope_pairs_to_halves`), so the rotate-half RoPE gives HF's outputs."""
  h, n, dn, r_dim, dv = (cfg.hidden_size, cfg.num_heads, cfg.qk_nope_head_dim,
                         cfg.qk_rope_head_dim, cfg.v_head_dim)
  c, q = cfg.kv_lora_rank, cfg.q_lora_rank
  order = rope_pairs_to_halves(r_dim) if cfg.rope_interleave else np.arange(r_dim)
  q_cols = np.concatenate([np.arange(dn), dn + order])
  heads = lambda t: np.asarray(t.T.reshape(t.shape[1], n, dn + r_dim))[..., q_cols]
  kv_b = r.linear(prefix + "kv_b_proj.weight", n * (dn + dv), c, (n, dn + dv))
  return MLAParams(
      wq=None if q else r.get(prefix + "q_proj.weight", (n * (dn + r_dim), h), heads),
      wq_a=r.linear(prefix + "q_a_proj.weight", q, h) if q else None,
      q_a_norm=r.get(prefix + "q_a_layernorm.weight", (q,)) if q else None,
      wq_b=r.get(prefix + "q_b_proj.weight", (n * (dn + r_dim), q), heads) if q else None,
      wkv_a=r.get(prefix + "kv_a_proj_with_mqa.weight", (c + r_dim, h),
                  lambda t: np.asarray(t.T)[:, np.concatenate([np.arange(c), c + order])]),
      kv_a_norm=r.get(prefix + "kv_a_layernorm.weight", (c,)),
      w_uk=kv_b[..., :dn], w_uv=kv_b[..., dn:],
      wo=r.get(prefix + "o_proj.weight", (h, n * dv), lambda t: t.T.reshape(n, dv, h)))


def params(r: TensorReader, cfg: ModelConfig, raw: dict, fuse_qkv: bool = False) -> Params:
  h = cfg.hidden_size

  def layer(r, prefix, i):
    if not cfg.is_moe(i):
      mlp = qwen3.swiglu(r, prefix + "mlp.", cfg.intermediate_size, h)
    else:
      shared = cfg.n_shared_experts * cfg.moe_intermediate_size
      mlp = dict(**(qwen3.swiglu(r, prefix + "mlp.shared_experts.", shared, h) if shared
                    else dict(w_gate_up=None, w_down=None)),
                 moe=qwen3_moe.experts(r, prefix + "mlp.", cfg))
    return LayerParams(input_norm=r.get(prefix + "input_layernorm.weight", (h,)), wq=None,
                       wkv=None, wo=None, q_norm=None, k_norm=None,
                       post_norm=r.get(prefix + "post_attention_layernorm.weight", (h,)),
                       mla=latent_attention(r, prefix + "self_attn.", cfg), **mlp)
  return qwen3.decoder_params(r, cfg, layer)


def mtp_layers(raw: dict[str, Any], cfg: ModelConfig, prefix: str = "") -> tuple[re.Pattern, ...]:
  """Skip patterns for DeepSeek's multi-token-prediction layers (num_nextn_predict_layers
  layers after the last decoder layer; tensor names after `prefix`): not part of the target's
  forward."""
  extra = raw.get("num_nextn_predict_layers") or 0
  if not extra:
    return ()
  logging.info("skipping %d multi-token-prediction layer(s) (num_nextn_predict_layers) at load",
               extra)
  ids = "|".join(str(cfg.num_layers + j) for j in range(extra))
  return (re.compile(rf"^{re.escape(prefix)}model\.layers\.({ids})\."),)


def config(raw: dict[str, Any], source: str) -> ModelConfig:
  # (YaRN is checked against HF for DeepSeek-V3 only)
  return decoder_config(raw, source, qk_norm=False, rope_types=("llama3", "yarn"),
                        family_fields=lambda: deepseek_settings(raw, source))


# DeepseekV3ForCausalLM; Kimi-K2 names its own model_type
FAMILY = Family(model_types=("deepseek_v3", "kimi_k2"), config=config, params=params,
                skip=mtp_layers)
