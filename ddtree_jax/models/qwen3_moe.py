"""Qwen3-MoE (HF `Qwen3MoeForCausalLM`): Qwen3's GQA attention, and in the layers that
`decoder_sparse_step` / `mlp_only_layers` pick, a softmax top-k router over SwiGLU experts (no
shared expert) instead of the dense MLP.

Tensor names beside Qwen3's: the router `mlp.gate.weight` [E, H]; the experts as per-expert
Linears `mlp.experts.{e}.{gate,up,down}_proj.weight`, or fused 3-D tensors
`mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I].
"""

from __future__ import annotations

from typing import Any

from ddtree_jax.checkpoints.tensor_reader import TensorReader, stack
from ddtree_jax.models import qwen3
from ddtree_jax.models.config import ModelConfig, decoder_config, positive_int
from ddtree_jax.models.decoder import Params
from ddtree_jax.models.family import Family
from ddtree_jax.models.moe import MoEParams

# MoE variants we refuse rather than run wrongly: a shared expert (Qwen2-MoE), other routers.
_MOE_REFUSE = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts",
               "scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor")


def moe_settings(cfg: dict[str, Any], source: str, shared_expert: bool = False) -> dict[str, Any]:
  """The MoE fields of ModelConfig from a qwen3_moe config.json; shared_expert: the family has
  one (Qwen3-Next, Qwen3.5-MoE: shared_expert_intermediate_size, behind a sigmoid gate)."""
  refuse = _MOE_REFUSE[1:] if shared_expert else _MOE_REFUSE
  for key in refuse:
    if cfg.get(key):
      raise ValueError(f"{source}: unsupported mixture-of-experts field {key}={cfg[key]!r} "
                       "(Qwen3-MoE has no shared expert and routes by softmax top-k)")
  experts_key = "num_experts" if "num_experts" in cfg else "num_local_experts"
  experts = positive_int(cfg, experts_key, source)
  top_k = positive_int(cfg, "num_experts_per_tok", source)
  if top_k > experts:
    raise ValueError(f"{source}: num_experts_per_tok={top_k} exceeds {experts_key}={experts}")
  step = positive_int(cfg, "decoder_sparse_step", source, 1)
  dense = cfg.get("mlp_only_layers") or []
  n = cfg["num_hidden_layers"]
  if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < n for i in dense):
    raise ValueError(f"{source}: mlp_only_layers {dense!r} must list layers in [0, {n})")
  layers = tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)
  shared = dict(shared_expert_size=positive_int(cfg, "shared_expert_intermediate_size", source)
                ) if shared_expert else {}
  return dict(num_experts=experts, num_experts_per_tok=top_k, **shared,
              moe_intermediate_size=positive_int(cfg, "moe_intermediate_size", source),
              norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_layers=layers)


def experts(r: TensorReader, prefix: str, cfg: ModelConfig) -> MoEParams:
  """A MoE block's router [H, E] (and DeepSeek's selection bias [E]) and experts stacked
  [E, H, 2, I] / [E, I, H], from fused `experts.gate_up_proj` / `experts.down_proj` tensors when
  the checkpoint has them, else from the per-expert Linears (stacked lazily: a shard reads only
  its experts; quantized ones kept quantized, `quant.Int4Experts` / `quant.Fp8Experts`)."""
  h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  router = r.linear(prefix + "gate.weight", e, h)
  bias = (r.get(prefix + "gate.e_score_correction_bias", (e,))
          if cfg.scoring_func == "sigmoid" else None)
  x = prefix + "experts."
  if r.has(x + "gate_up_proj"):
    gate_up = r.get(x + "gate_up_proj", (e, 2 * i, h),
                    lambda t: t.reshape(e, 2, i, h).transpose(0, 3, 1, 2))
    down = r.get(x + "down_proj", (e, h, i), lambda t: t.transpose(0, 2, 1))
    return MoEParams(router=router, w_gate_up=gate_up, w_down=down, bias=bias)
  one = lambda j, name, out_dim, in_dim: r.quantized_linear(f"{x}{j}.{name}.weight", out_dim,
                                                            in_dim)
  gate_up = stack([stack([one(j, "gate_proj", i, h), one(j, "up_proj", i, h)], axis=1)
                   for j in range(e)], axis=0)
  down = stack([one(j, "down_proj", h, i) for j in range(e)], axis=0)
  return MoEParams(router=router, w_gate_up=gate_up, w_down=down, bias=bias)


def params(r: TensorReader, cfg: ModelConfig, raw: dict, fuse_qkv: bool = False) -> Params:
  def layer(r, prefix, i):
    if not cfg.is_moe(i):
      return qwen3.dense_layer(r, prefix, cfg, fuse_qkv)
    mlp = dict(w_gate_up=None, w_down=None, moe=experts(r, prefix + "mlp.", cfg))
    return qwen3.gqa_layer(r, prefix, cfg, mlp, fuse_qkv)
  return qwen3.decoder_params(r, cfg, layer)


FAMILY = Family(model_types=("qwen3_moe",), params=params, config=lambda raw, source: decoder_config(
    raw, source, qk_norm=True, family_fields=lambda: moe_settings(raw, source)))
