"""Writing Hugging Face checkpoints: a Qwen3 (dense or MoE) target or a z-lab DFlash drafter directory
(config.json, model.safetensors in PyTorch [out, in] layout), the exact inverse of the loaders in
`checkpoint`. Every file is written atomically (`files`): re-exporting over a good export and
being killed leaves each file whole."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.checkpoints import files
from ddtree_jax.checkpoints.hf import parse_dtype
from ddtree_jax.models.config import ModelConfig
from ddtree_jax.models.decoder import LayerParams, Params
from ddtree_jax.checkpoints.safetensors_io import write_safetensors


def _np(x, dtype) -> np.ndarray:
  return np.asarray(jax.device_get(x)).astype(dtype)


def _layer_tensors(prefix: str, layer: LayerParams, cfg: ModelConfig, dtype) -> dict[str, np.ndarray]:
  """Our [in, out] layer weights -> PyTorch [out, in] tensors (inverse of TensorReader.layer)."""
  h, n, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  a = prefix + "self_attn."
  if layer.wqkv is not None:  # model.fuse_qkv's [H, N + 2K, D]
    wqkv = _np(layer.wqkv, dtype)
    wq, wkv = wqkv[:, :n], wqkv[:, n:].reshape(h, 2, k, d)
  else:
    wq, wkv = _np(layer.wq, dtype), _np(layer.wkv, dtype)
  t = {
      prefix + "input_layernorm.weight": _np(layer.input_norm, dtype),
      a + "q_proj.weight": wq.reshape(h, n * d).T,
      a + "k_proj.weight": wkv[:, 0].reshape(h, k * d).T,
      a + "v_proj.weight": wkv[:, 1].reshape(h, k * d).T,
      a + "o_proj.weight": _np(layer.wo, dtype).reshape(n * d, h).T,
      prefix + "post_attention_layernorm.weight": _np(layer.post_norm, dtype),
  }
  m = prefix + "mlp."
  if layer.moe is None:
    gu = _np(layer.w_gate_up, dtype)
    t.update({m + "gate_proj.weight": gu[:, 0].T, m + "up_proj.weight": gu[:, 1].T,
              m + "down_proj.weight": _np(layer.w_down, dtype).T})
  else:  # HF's per-expert layout (what save_pretrained writes)
    gu, down = _np(layer.moe.w_gate_up, dtype), _np(layer.moe.w_down, dtype)
    t[m + "gate.weight"] = _np(layer.moe.router, dtype).T
    for e in range(gu.shape[0]):
      x = f"{m}experts.{e}."
      t.update({x + "gate_proj.weight": np.ascontiguousarray(gu[e, :, 0].T),
                x + "up_proj.weight": np.ascontiguousarray(gu[e, :, 1].T),
                x + "down_proj.weight": np.ascontiguousarray(down[e].T)})
  if cfg.qk_norm:
    t[a + "q_norm.weight"] = _np(layer.q_norm, dtype)
    t[a + "k_norm.weight"] = _np(layer.k_norm, dtype)
  return t


def _rope_scaling(cfg: ModelConfig) -> dict[str, Any]:
  """config.json's `rope_scaling` for a scaled RoPE (llama3, yarn), {} for the default one."""
  if cfg.rope_type == "default":
    return {}
  fields = {k: int(v) if k == "original_max_position_embeddings" else v
            for k, v in cfg.rope_scaling}
  return {"rope_scaling": {"rope_type": cfg.rope_type, **fields}}


def _hf_fields(cfg: ModelConfig, dtype_name: str) -> dict[str, Any]:
  return {**_rope_scaling(cfg),
      "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
      "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
      "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
      "use_sliding_window": False, "sliding_window": None,
      "layer_types": ["full_attention"] * cfg.num_layers, "torch_dtype": dtype_name,
  }


def _moe_fields(cfg: ModelConfig) -> dict[str, Any]:
  """config.json fields of a qwen3_moe checkpoint (its dense layers as mlp_only_layers)."""
  return {"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
          "moe_intermediate_size": cfg.moe_intermediate_size,
          "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1,
          "mlp_only_layers": [i for i in range(cfg.num_layers) if not cfg.is_moe(i)],
          "output_router_logits": False, "router_aux_loss_coef": 0.001}


def _write_tokenizer(path: str, tokenizer, eos_token: str | None):
  files.save_tokenizer(tokenizer, os.path.join(path, "tokenizer.json"))
  tc = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
  if eos_token:
    tc.update(eos_token=eos_token, pad_token=eos_token)
  files.write_json(os.path.join(path, "tokenizer_config.json"), tc, indent=2)


def save_target_hf(path: str, params: Params, cfg: ModelConfig, tokenizer=None,
                   dtype="bfloat16") -> str:
  """Writes a Hugging Face Qwen3 or Qwen3-MoE directory (config.json, model.safetensors in
  PyTorch [out, in] layout, tokenizer.json when given): the exact inverse of
  `load_target_params`."""
  if cfg.model_type not in ("qwen3", "qwen3_moe"):
    raise ValueError(f"save_target_hf writes qwen3 / qwen3_moe checkpoints, not "
                     f"{cfg.model_type!r}")
  dt = np.dtype(parse_dtype(dtype))
  dtype_name = {np.dtype(jnp.bfloat16): "bfloat16", np.dtype(np.float32): "float32",
                np.dtype(np.float16): "float16"}[dt]
  os.makedirs(path, exist_ok=True)
  files.remove_stale_temporaries(path)
  v = cfg.vocab_size  # (params placed on a mesh may carry vocabulary padding past V)
  t = {"model.embed_tokens.weight": _np(params.embed[:v], dt),
       "model.norm.weight": _np(params.final_norm, dt)}
  for i, layer in enumerate(params.layers):
    t.update(_layer_tensors(f"model.layers.{i}.", layer, cfg, dt))
  if not cfg.tie_word_embeddings:
    t["lm_head.weight"] = _np(params.lm_head[:, :v], dt).T
  write_safetensors(os.path.join(path, "model.safetensors"), t)
  eos = list(cfg.eos_token_ids)
  arch = "Qwen3MoeForCausalLM" if cfg.model_type == "qwen3_moe" else "Qwen3ForCausalLM"
  moe = _moe_fields(cfg) if cfg.model_type == "qwen3_moe" else {}
  conf = {"architectures": [arch], "model_type": cfg.model_type, **_hf_fields(cfg, dtype_name), **moe,
          "tie_word_embeddings": cfg.tie_word_embeddings,
          "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
          "bos_token_id": None, "use_cache": True}
  files.write_json(os.path.join(path, "config.json"), conf, indent=2)
  if eos:
    files.write_json(os.path.join(path, "generation_config.json"),
                     {"eos_token_id": conf["eos_token_id"], "do_sample": False}, indent=2)
  if tokenizer is not None:
    _write_tokenizer(path, tokenizer, tokenizer.id_to_token(eos[0]) if eos else None)
  return path


def save_drafter_hf(path: str, params, dcfg, num_target_layers: int, dtype="bfloat16") -> str:
  """Writes a z-lab-format DFlash drafter directory (config.json with block_size,
  dflash_config.{mask_token_id, target_layer_ids}, num_target_layers; model.safetensors with
  fc / hidden_norm / norm / layers.{i}.*): the exact inverse of `load_drafter`."""
  lc = dcfg.layers
  if params.lm_head is not None:
    raise ValueError("a drafter with its own lm_head (int8-quantized or a restricted draft "
                     "vocabulary) cannot be saved; save the float drafter it came from")
  dt = np.dtype(parse_dtype(dtype))
  dtype_name = {np.dtype(jnp.bfloat16): "bfloat16", np.dtype(np.float32): "float32",
                np.dtype(np.float16): "float16"}[dt]
  os.makedirs(path, exist_ok=True)
  files.remove_stale_temporaries(path)
  t = {"fc.weight": _np(params.fc, dt).T, "hidden_norm.weight": _np(params.hidden_norm, dt),
       "norm.weight": _np(params.final_norm, dt)}
  for i, layer in enumerate(params.layers):
    t.update(_layer_tensors(f"layers.{i}.", layer, lc, dt))
  write_safetensors(os.path.join(path, "model.safetensors"), t)
  conf = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **_hf_fields(lc, dtype_name),
          "tie_word_embeddings": False, "num_target_layers": int(num_target_layers),
          "block_size": dcfg.block_size,
          "dflash_config": {"mask_token_id": dcfg.mask_token_id,
                            "target_layer_ids": list(dcfg.target_layer_ids)}}
  files.write_json(os.path.join(path, "config.json"), conf, indent=2)
  return path
