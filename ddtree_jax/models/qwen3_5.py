"""Qwen3.5 / Qwen3.6 and Qwen3-Next / Qwen3-Coder-Next: hybrids of Gated DeltaNet layers
(`gated_deltanet.py`) and gated attention layers, `layer_types` saying which is which (by default
every `full_attention_interval`-th layer attention).

Checkpoints: `qwen3_5_text` / `qwen3_5_moe_text` (HF `Qwen3_5ForCausalLM` /
`Qwen3_5MoeForCausalLM`: `model.*`); `qwen3_5` / `qwen3_5_moe`, the vision-language wrappers
(`Qwen3_5ForConditionalGeneration`) as published: the text model's config is `text_config`, its
tensors `model.language_model.*` beside a top-level `lm_head.weight`; the vision tower
(`model.visual.*`) and the multi-token-prediction layers (`mtp.*`) are skipped. `qwen3_next`
stores each Gated DeltaNet layer's projections fused per key-head group (`in_proj_qkvz`,
`in_proj_ba`), unfused here into Qwen3.5's layout (`gated_deltanet.unfuse_qwen3_next`); both
then have the convolved channels regrouped per key head (`gated_deltanet.group_channels`), the
layout tensor parallelism splits.

What differs from Qwen3 beyond the mixer: every decoder RMSNorm (input, post-attention, final,
q / k) is zero-centred, weight 1 + w (loaded as 1 + w); attention's q_proj yields per head
[q | gate] and the output is scaled by sigmoid(gate) before o_proj; RoPE rotates the first
partial_rotary_factor of each head (Qwen3.5's multimodal sections reduce to it for text
positions); the MoE layers (Qwen3-Next: by decoder_sparse_step / mlp_only_layers; Qwen3.5-MoE:
all) add a shared expert behind a sigmoid gate, and their experts may be stored fused
(`experts.gate_up_proj`) or one by one.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from ddtree_jax.checkpoints.tensor_reader import Joined, Stacked, TensorReader
from ddtree_jax.models import qwen3, qwen3_moe
from ddtree_jax.models.config import ModelConfig, decoder_config, positive_int
from ddtree_jax.models.decoder import LayerParams, Params
from ddtree_jax.models.family import Family
from ddtree_jax.models.gated_deltanet import GDNDims, GDNParams, group_channels, unfuse_qwen3_next

WRAPPED = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
LANGUAGE_MODEL = "model.language_model."


def text_config(raw: dict[str, Any], source: str) -> dict[str, Any]:
  """The text model's config.json dict: the wrapper's `text_config`, or `raw` itself."""
  if raw.get("model_type") not in WRAPPED:
    return raw
  text = raw.get("text_config")
  want = WRAPPED[raw["model_type"]]
  if not isinstance(text, dict) or text.get("model_type", want) != want:
    raise ValueError(f"{source}: a {raw['model_type']} config.json needs a text_config object of "
                     f"model_type {want!r}")
  # the wrapper's tie_word_embeddings is the one transformers applies
  return {**text, "model_type": want,
          "tie_word_embeddings": raw.get("tie_word_embeddings", text.get("tie_word_embeddings"))}


def _layer_types(raw: dict[str, Any], source: str) -> tuple[str, ...]:
  n = raw["num_hidden_layers"]
  types = raw.get("layer_types")
  if types is None:
    every = positive_int(raw, "full_attention_interval", source, 4)
    types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
  if len(types) != n:
    raise ValueError(f"{source}: layer_types lists {len(types)} layers, num_hidden_layers={n}")
  return tuple(types)


def _gdn_dims(raw: dict[str, Any], source: str) -> GDNDims:
  get = lambda key, default=None: positive_int(raw, key, source, default)
  d = GDNDims(key_heads=get("linear_num_key_heads"), value_heads=get("linear_num_value_heads"),
              key_dim=get("linear_key_head_dim"), value_dim=get("linear_value_head_dim"),
              eps=float(raw.get("rms_norm_eps", 1e-6)), conv_kernel=get("linear_conv_kernel_dim", 4))
  if d.value_heads % d.key_heads:
    raise ValueError(f"{source}: linear_num_value_heads={d.value_heads} is not a multiple of "
                     f"linear_num_key_heads={d.key_heads}")
  return d


def _fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
  rope = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
  fields = dict(layer_types=_layer_types(raw, source), gdn=_gdn_dims(raw, source),
                attn_output_gate=True,
                partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                     raw.get("partial_rotary_factor", 0.25))))
  if raw.get("num_experts"):
    fields.update(qwen3_moe.moe_settings(raw, source, shared_expert=True))
    # Qwen3-Next's field defaults to renormalising; Qwen3.5-MoE has none and always does
    fields["norm_topk_prob"] = bool(raw.get("norm_topk_prob", True))
  return fields


def config(raw: dict[str, Any], source: str) -> ModelConfig:
  text = text_config(raw, source)
  where = source if text is raw else f"{source} (text_config)"
  if "intermediate_size" not in text and text.get("moe_intermediate_size"):
    text = {**text, "intermediate_size": text["moe_intermediate_size"]}  # (no dense layer)
  cfg = decoder_config(text, where, qk_norm=True, rope_types=("yarn",),
                       family_fields=lambda: _fields(text, where), layer_kinds=(
                           "full_attention", "linear_attention"))
  return dataclasses.replace(cfg, model_type=raw["model_type"])


def _centred(r: TensorReader, name: str, size: int):
  """A zero-centred RMSNorm's weight as the 1 + w that `ops.rms_norm` multiplies by."""
  if not r.has(name):
    return r.get(name, (size,))  # recorded as missing
  return np.asarray(r.get(name, (size,)), np.float32) + 1.0


def _host(r: TensorReader, name: str, shape, transform):
  """`transform` of the whole tensor (layouts no view can express); a missing one is recorded."""
  if not r.has(name):
    return r.get(name, shape)
  return transform(np.asarray(r.get(name, shape)))


def gated_attention(r: TensorReader, prefix: str, cfg: ModelConfig) -> dict:
  """A gated attention layer's fields: q_proj [N * 2D, H] holds per head [q | gate]."""
  h, n, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  a = prefix + "self_attn."
  q_gate = lambda part: _host(r, a + "q_proj.weight", (2 * n * d, h),
                              lambda t: t.reshape(n, 2, d, h)[:, part].transpose(2, 0, 1))
  kv = [r.linear(a + f"{x}_proj.weight", k * d, h, (k, d)) for x in "kv"]
  return dict(wq=q_gate(0), wq_gate=q_gate(1), wkv=Stacked(kv, axis=1),
              wo=r.get(a + "o_proj.weight", (h, n * d), lambda t: t.T.reshape(n, d, h)),
              q_norm=_centred(r, a + "q_norm.weight", d), k_norm=_centred(r, a + "k_norm.weight", d))


def _grouped_qkv(r: TensorReader, name: str, d: GDNDims, h: int):
  """in_proj_qkv [C, H] as w_qkv [H, Hk, G] (`group_channels`), still lazy: a join of its q, k
  and v views per key head, so a shard reads only its groups' rows."""
  w = r.linear(name, d.conv_dim, h)
  if not r.has(name):
    return w.reshape(h, d.key_heads, d.group_dim)  # recorded as missing
  return group_channels(w, d, concat=Joined)


def gated_deltanet(r: TensorReader, prefix: str, cfg: ModelConfig) -> GDNParams:
  """A Gated DeltaNet layer in Qwen3.5's layout (Qwen3-Next's fused projections unfused), its
  convolved channels regrouped per key head (`group_channels`: w_qkv [H, Hk, G], conv
  [K, Hk, G])."""
  d, h = cfg.gdn, cfg.hidden_size
  hv, c, vd = d.value_heads, d.conv_dim, d.value_heads * d.value_dim
  if r.has(prefix + "in_proj_qkvz.weight") and r.has(prefix + "in_proj_ba.weight"):
    split = unfuse_qwen3_next(r.get(prefix + "in_proj_qkvz.weight", (c + vd, h)),
                              r.get(prefix + "in_proj_ba.weight", (2 * hv, h)), d)
    w = {k: v.T for k, v in split.items()}
    w["qkv"] = group_channels(w["qkv"], d)
  else:
    w = {k: r.linear(prefix + f"in_proj_{k}.weight", out, h)
         for k, out in (("z", vd), ("b", hv), ("a", hv))}
    w["qkv"] = _grouped_qkv(r, prefix + "in_proj_qkv.weight", d, h)
  return GDNParams(
      w_qkv=w["qkv"], w_z=w["z"], w_b=w["b"], w_a=w["a"],
      conv=_host(r, prefix + "conv1d.weight", (c, 1, d.conv_kernel),
                 lambda t: group_channels(t[:, 0].T, d)),
      dt_bias=r.get(prefix + "dt_bias", (hv,)), a_log=r.get(prefix + "A_log", (hv,)),
      norm=r.get(prefix + "norm.weight", (d.value_dim,)),
      w_out=r.linear(prefix + "out_proj.weight", h, vd))


def mlp(r: TensorReader, prefix: str, cfg: ModelConfig, layer: int) -> dict:
  """A dense SwiGLU, or experts plus the shared expert and its gate [1, H]."""
  if not cfg.is_moe(layer):
    return qwen3.swiglu(r, prefix, cfg.intermediate_size, cfg.hidden_size)
  shared = qwen3.swiglu(r, prefix + "shared_expert.", cfg.shared_expert_size, cfg.hidden_size)
  return dict(shared, moe=qwen3_moe.experts(r, prefix, cfg),
              shared_gate=r.get(prefix + "shared_expert_gate.weight", (1, cfg.hidden_size),
                                lambda t: t.reshape(-1)))


def params(r: TensorReader, cfg: ModelConfig, raw: dict, fuse_qkv: bool = False) -> Params:
  del fuse_qkv  # gated attention's q rows interleave the gate: kept apart
  base = LANGUAGE_MODEL if raw.get("model_type") in WRAPPED else "model."
  h, v = cfg.hidden_size, cfg.vocab_size

  def layer(i):
    pre = f"{base}layers.{i}."
    norms = dict(input_norm=_centred(r, pre + "input_layernorm.weight", h),
                 post_norm=_centred(r, pre + "post_attention_layernorm.weight", h))
    if cfg.is_recurrent(i):
      mixer = dict(wq=None, wkv=None, wo=None, q_norm=None, k_norm=None,
                   gdn=gated_deltanet(r, pre + "linear_attn.", cfg))
    else:
      mixer = gated_attention(r, pre, cfg)
    return LayerParams(**norms, **mixer, **mlp(r, pre + "mlp.", cfg, i))

  return Params(embed=r.get(base + "embed_tokens.weight", (v, h)),
                layers=[layer(i) for i in range(cfg.num_layers)],
                final_norm=_centred(r, base + "norm.weight", h),
                lm_head=None if cfg.tie_word_embeddings else r.linear("lm_head.weight", v, h))


def skip(raw: dict[str, Any], cfg: ModelConfig) -> tuple[re.Pattern, ...]:
  """The vision tower and the multi-token-prediction layers."""
  return (re.compile(r"^model\.visual\."), re.compile(r"^mtp\."))


FAMILY = Family(model_types=("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
                             "qwen3_next"), config=config, params=params, skip=skip)
