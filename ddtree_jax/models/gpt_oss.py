"""gpt-oss (HF `GptOssForCausalLM`, `model_type` gpt_oss: openai/gpt-oss-20b, -120b): GQA attention
whose q/k/v/o projections have biases, no q/k norm, and a learned sink logit per query head that
joins each query's softmax denominator and adds no value; `layer_types` alternating causal
sliding-window layers (a query at p sees the keys in (p - sliding_window, p]) and full ones;
YaRN RoPE (gpt-oss ships `truncate: false`); every MLP a mixture of experts: a router with a
bias, softmax over the top-k logits (= softmax, top-k, renormalised), experts with biases and a
clamped SwiGLU, (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).

Tensor names as shipped: `model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}`,
`self_attn.sinks` [N]; `mlp.router.{weight,bias}` [E, H] / [E]; `mlp.experts.gate_up_proj`
[E, H, 2I] (x @ W, gate and up INTERLEAVED along the last axis: gate = [..., 0::2]) with
`gate_up_proj_bias` [E, 2I] (interleaved alike), `mlp.experts.down_proj` [E, I, H] with
`down_proj_bias` [E, H]. OpenAI's checkpoints ship the two stacks MXFP4 (`quant_method: mxfp4`:
`{name}_blocks` / `{name}_scales`, `checkpoints/quantized.mxfp4_views`), kept 4-bit on the device
(`quant.Mxfp4Experts`); the rest (attention, router, biases, embeddings, norms) in float.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ddtree_jax.checkpoints import quantized
from ddtree_jax.checkpoints.tensor_reader import Stacked, TensorReader
from ddtree_jax.models import qwen3
from ddtree_jax.models.config import (ModelConfig, decoder_config, positive_float, positive_int,
                                      require_positive)
from ddtree_jax.models.decoder import LayerParams, Params
from ddtree_jax.models.family import Family
from ddtree_jax.models.moe import MoEParams

LAYER_KINDS = ("sliding_attention", "full_attention")
# GptOssConfig's defaults, for fields a config.json leaves out
HF_DEFAULTS = dict(rms_norm_eps=1e-5, max_position_embeddings=131072, sliding_window=128,
                   swiglu_alpha=1.702, swiglu_limit=7.0, attention_bias=True,
                   num_experts_per_tok=4, rope_theta=150000.0)
HF_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
           "truncate": False, "original_max_position_embeddings": 4096}


def _with_defaults(raw: dict[str, Any]) -> dict[str, Any]:
  cfg = {**HF_DEFAULTS, **raw}
  if not cfg.get("rope_scaling") and not cfg.get("rope_parameters"):
    cfg["rope_parameters"] = dict(HF_ROPE)
  return cfg


def _fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
  require_positive(raw, source, "num_key_value_heads", "head_dim", "num_local_experts")
  n = raw["num_hidden_layers"]
  types = raw.get("layer_types") or [  # HF's default: even layers sliding, odd ones full
      "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
  if len(types) != n:
    raise ValueError(f"{source}: layer_types lists {len(types)} layers, num_hidden_layers={n}")
  experts = raw["num_local_experts"]
  top_k = positive_int(raw, "num_experts_per_tok", source)
  if raw.get("experts_per_token", top_k) != top_k:  # (OpenAI's own name, written beside it)
    raise ValueError(f"{source}: experts_per_token={raw['experts_per_token']!r} differs from "
                     f"num_experts_per_tok={top_k}")
  if top_k > experts:
    raise ValueError(f"{source}: num_experts_per_tok={top_k} exceeds num_local_experts={experts}")
  window = positive_int(raw, "sliding_window", source) if "sliding_attention" in types else 0
  clamp = (positive_float(raw, "swiglu_alpha", source, 1.702),
           positive_float(raw, "swiglu_limit", source, 7.0))
  return dict(layer_types=tuple(types), sliding_window=window, num_experts=experts,
              num_experts_per_tok=top_k, moe_intermediate_size=raw["intermediate_size"],
              norm_topk_prob=True, moe_layers=tuple(range(n)),
              attention_bias=bool(raw["attention_bias"]), attention_sinks=True, moe_bias=True,
              swiglu_clamp=clamp)


def config(raw: dict[str, Any], source: str) -> ModelConfig:
  cfg = _with_defaults(raw)
  return decoder_config(cfg, source, qk_norm=False, rope_types=("yarn",),
                        family_fields=lambda: _fields(cfg, source), layer_kinds=LAYER_KINDS,
                        attention_bias=True)


def attention(r: TensorReader, prefix: str, cfg: ModelConfig, mlp: dict) -> LayerParams:
  """qwen3's GQA layer (no q/k norm) with the biases [N, D], [2, K, D], [H] and the sinks [N]."""
  n, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  a = prefix + "self_attn."
  layer = qwen3.gqa_layer(r, prefix, cfg, mlp)
  extra = dict(sinks=r.get(a + "sinks", (n,)))
  if cfg.attention_bias:
    bias = lambda x, heads: r.get(a + f"{x}_proj.bias", (heads * d,),
                                  lambda t: t.reshape(heads, d))
    extra.update(bq=bias("q", n), bkv=Stacked([bias("k", k), bias("v", k)], axis=0),
                 bo=r.get(a + "o_proj.bias", (cfg.hidden_size,)))
  return dataclasses.replace(layer, **extra)


def _deinterleave(t, i: int):
  """[..., 2I] with gate / up interleaved (gate = [..., 0::2]) -> [..., 2, I] (a view)."""
  t = t.reshape(tuple(t.shape[:-1]) + (i, 2))
  lead = tuple(range(len(t.shape) - 2))
  return t.transpose(*lead, len(lead) + 1, len(lead))


def experts(r: TensorReader, prefix: str, cfg: ModelConfig) -> MoEParams:
  """The router and the experts [E, H, 2, I] / [E, I, H] (MXFP4 kept so: `quant.Mxfp4Experts`)
  with their biases [E, 2, I] / [E, H]."""
  h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  x = prefix + "experts."
  if r.has(x + "gate_up_proj_blocks"):
    gate_up = quantized.mxfp4_views(r, x + "gate_up_proj", e, 2 * i, h).with_leaves(
        lambda t: _deinterleave(t, i))
    down = quantized.mxfp4_views(r, x + "down_proj", e, h, i)
  else:
    gate_up = r.get(x + "gate_up_proj", (e, h, 2 * i), lambda t: _deinterleave(t, i))
    down = r.get(x + "down_proj", (e, i, h))
  return MoEParams(router=r.linear(prefix + "router.weight", e, h), w_gate_up=gate_up,
                   w_down=down, router_bias=r.get(prefix + "router.bias", (e,)),
                   gate_up_bias=r.get(x + "gate_up_proj_bias", (e, 2 * i),
                                      lambda t: _deinterleave(t, i)),
                   down_bias=r.get(x + "down_proj_bias", (e, h)),
                   swiglu_clamp=cfg.swiglu_clamp)


def params(r: TensorReader, cfg: ModelConfig, raw: dict, fuse_qkv: bool = False) -> Params:
  del fuse_qkv  # biased q/k/v keep wq and wkv (`decoder.fuse_qkv` has no bias)
  def layer(r, prefix, _):
    mlp = dict(w_gate_up=None, w_down=None, moe=experts(r, prefix + "mlp.", cfg))
    return attention(r, prefix, cfg, mlp)
  return qwen3.decoder_params(r, cfg, layer)


FAMILY = Family(model_types=("gpt_oss",), config=config, params=params)
