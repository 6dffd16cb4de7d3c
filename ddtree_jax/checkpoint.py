"""Hugging Face checkpoint loading without torch: config.json + safetensors (+ tokenizer.json).

Safetensors files are parsed directly (JSON header + memory-mapped data), so tensors stay on the
host until placed, bfloat16 included. Nothing shipped with a checkpoint is ever executed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ddtree_jax.config import ModelConfig, config_from_hf
from ddtree_jax.model import LayerParams, Params

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """Memory-maps one .safetensors file: {name: read-only array}."""
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
  out = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    if info["dtype"] not in _DTYPES:
      raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
    start, end = info["data_offsets"]
    out[name] = data[start:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
  return out


def read_checkpoint_tensors(path: str) -> dict[str, np.ndarray]:
  """All tensors of an HF directory: model.safetensors or a sharded index."""
  single = os.path.join(path, "model.safetensors")
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(single):
    return read_safetensors(single)
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for name in files:
      tensors.update(read_safetensors(os.path.join(path, name)))
    return tensors
  raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json "
                          "(only safetensors checkpoints are loaded)")


def read_config(path: str) -> dict[str, Any]:
  file = os.path.join(path, "config.json")
  if not os.path.exists(file):
    raise FileNotFoundError(f"{path}: no config.json")
  with open(file) as f:
    return json.load(f)


class TensorReader:
  """Fetches named tensors with shape checks, converting to our [in, out] layouts."""

  def __init__(self, tensors: dict[str, np.ndarray], dtype, source: str,
               place: Callable[[np.ndarray], jax.Array] | None = None):
    self.tensors, self.dtype, self.source = tensors, dtype, source
    self.place = place or jnp.asarray

  def raw(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in self.tensors:
      raise KeyError(f"{self.source}: missing tensor {name!r} (expected shape {shape})")
    t = self.tensors[name]
    if tuple(t.shape) != tuple(shape):
      raise ValueError(f"{self.source}: tensor {name!r} has shape {tuple(t.shape)}, "
                       f"expected {tuple(shape)}")
    return t

  def get(self, name: str, shape, transform=lambda t: t) -> jax.Array:
    return self.place(np.asarray(transform(self.raw(name, shape))).astype(self.dtype))

  def linear(self, name: str, out_dim: int, in_dim: int, split: tuple[int, ...] = ()):
    """torch Linear [out, in] -> [in, *split] (split factors out_dim, e.g. heads x head_dim)."""
    return self.get(name, (out_dim, in_dim), lambda t: t.T.reshape((in_dim,) + (split or (out_dim,))))

  def layer(self, prefix: str, cfg: ModelConfig) -> LayerParams:
    h, n, k, d, i = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size)
    a = prefix + "self_attn."
    kproj = self.raw(a + "k_proj.weight", (k * d, h)).T.reshape(h, k, d)
    vproj = self.raw(a + "v_proj.weight", (k * d, h)).T.reshape(h, k, d)
    gate = self.raw(prefix + "mlp.gate_proj.weight", (i, h)).T
    up = self.raw(prefix + "mlp.up_proj.weight", (i, h)).T
    return LayerParams(
        input_norm=self.get(prefix + "input_layernorm.weight", (h,)),
        wq=self.linear(a + "q_proj.weight", n * d, h, (n, d)),
        wkv=self.place(np.stack([kproj, vproj], axis=1).astype(self.dtype)),
        wo=self.get(a + "o_proj.weight", (h, n * d), lambda t: t.T.reshape(n, d, h)),
        q_norm=self.get(a + "q_norm.weight", (d,)) if cfg.qk_norm else None,
        k_norm=self.get(a + "k_norm.weight", (d,)) if cfg.qk_norm else None,
        post_norm=self.get(prefix + "post_attention_layernorm.weight", (h,)),
        w_gate_up=self.place(np.stack([gate, up], axis=1).astype(self.dtype)),
        w_down=self.linear(prefix + "mlp.down_proj.weight", h, i),
    )


def load_tokenizer(path: str):
  file = os.path.join(path, "tokenizer.json")
  if not os.path.exists(file):
    return None
  import tokenizers  # pylint: disable=import-outside-toplevel
  return tokenizers.Tokenizer.from_file(file)


@dataclasses.dataclass(frozen=True)
class Target:
  """A loaded target model: params pytree + static config (+ tokenizer when shipped)."""
  params: Params
  config: ModelConfig
  tokenizer: Any = None
  path: str | None = None
  mesh: Any = None

  @property
  def dtype(self):
    return self.params.embed.dtype


def parse_dtype(dtype) -> jnp.dtype:
  names = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32,
           "fp32": jnp.float32, "float16": jnp.float16}
  if isinstance(dtype, str):
    if dtype not in names:
      raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(names)}")
    return jnp.dtype(names[dtype])
  return jnp.dtype(dtype)


def load_target_params(path: str, cfg: ModelConfig, dtype, place=None) -> Params:
  r = TensorReader(read_checkpoint_tensors(path), dtype, path, place)
  v, h = cfg.vocab_size, cfg.hidden_size
  return Params(
      embed=r.get("model.embed_tokens.weight", (v, h)),
      layers=[r.layer(f"model.layers.{i}.", cfg) for i in range(cfg.num_layers)],
      final_norm=r.get("model.norm.weight", (h,)),
      lm_head=None if cfg.tie_word_embeddings else r.linear("lm_head.weight", v, h),
  )


def load_target(path: str, dtype="bfloat16", mesh=None) -> Target:
  """Loads a Hugging Face Qwen3 (dense) or Llama directory (safetensors only)."""
  cfg = config_from_hf(read_config(path))
  dtype = parse_dtype(dtype)
  if mesh is not None:
    raise NotImplementedError("load_target(mesh=...) is not implemented yet (tensor parallelism)")
  params = load_target_params(path, cfg, dtype)
  return Target(params=params, config=cfg, tokenizer=load_tokenizer(path), path=path, mesh=mesh)


# Drafter variants we refuse (until implemented) rather than run wrongly.
_DRAFTER_VARIANT_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                           "attention_sinks", "num_attention_sinks", "sliding_window_size")
_DRAFTER_UNIT_FIELDS = ("input_embedding_scale", "output_multiplier")


@dataclasses.dataclass(frozen=True)
class Drafter:
  """A loaded DFlash drafter; the target's embedding and lm_head are shared, never copied."""
  params: Any                     # drafter.DrafterParams
  config: Any                     # drafter.DrafterConfig
  path: str | None = None


def drafter_config_from_hf(cfg: dict[str, Any], target: ModelConfig):
  """Parses a z-lab DFlash config.json against the target it drafts for."""
  from ddtree_jax.drafter import DrafterConfig, default_target_layer_ids  # pylint: disable=import-outside-toplevel
  dflash = dict(cfg.get("dflash_config") or {})
  value = lambda name, default=None: dflash.get(name, cfg.get(name, default))
  for name in _DRAFTER_VARIANT_FIELDS:
    if value(name) is not None:
      raise ValueError(f"unsupported DFlash variant: config field {name!r} is set")
  for name in _DRAFTER_UNIT_FIELDS:
    if float(value(name, 1.0)) != 1.0:
      raise ValueError(f"unsupported DFlash variant: {name}={value(name)} (only 1.0)")
  if value("final_logit_softcapping"):
    raise ValueError("unsupported DFlash variant: final_logit_softcapping is set")
  if value("is_causal"):
    raise ValueError("unsupported DFlash variant: is_causal=true (DFlash blocks are non-causal)")
  if cfg.get("use_sliding_window") or any(t != "full_attention" for t in cfg.get("layer_types") or []):
    raise ValueError("unsupported DFlash variant: sliding-window drafter layers")
  layers = config_from_hf({**cfg, "model_type": "qwen3"})
  if layers.hidden_size != target.hidden_size:
    raise ValueError(f"drafter hidden_size {layers.hidden_size} != target hidden_size "
                     f"{target.hidden_size}")
  if layers.vocab_size != target.vocab_size:
    raise ValueError(f"drafter vocab_size {layers.vocab_size} != target vocab_size "
                     f"{target.vocab_size}")
  mask = value("mask_token_id")
  if mask is None or not 0 <= int(mask) < target.vocab_size:
    raise ValueError(f"mask_token_id {mask!r} is not a token of the target vocab "
                     f"[0, {target.vocab_size})")
  ids = value("target_layer_ids")
  if ids is None:
    ids = default_target_layer_ids(int(value("num_target_layers", target.num_layers)),
                                   layers.num_layers)
  ids = tuple(int(i) for i in ids)
  bad = [i for i in ids if not 0 <= i < target.num_layers]
  if bad:
    raise ValueError(f"target_layer_ids {bad} out of range for a {target.num_layers}-layer target")
  block = int(value("block_size", 16))
  if block < 2:
    raise ValueError(f"block_size {block} < 2 drafts nothing")
  return DrafterConfig(layers=layers, block_size=block, mask_token_id=int(mask),
                       target_layer_ids=ids)


def load_drafter(path: str, target: Target, dtype=None) -> Drafter:
  """Loads a z-lab-format DFlash drafter directory for `target` (dtype defaults to the target's)."""
  from ddtree_jax.drafter import DrafterParams  # pylint: disable=import-outside-toplevel
  cfg = drafter_config_from_hf(read_config(path), target.config)
  dtype = target.dtype if dtype is None else parse_dtype(dtype)
  r = TensorReader(read_checkpoint_tensors(path), dtype, path)
  h, lc = target.config.hidden_size, cfg.layers
  params = DrafterParams(
      fc=r.linear("fc.weight", h, len(cfg.target_layer_ids) * h),
      hidden_norm=r.get("hidden_norm.weight", (h,)),
      layers=[r.layer(f"layers.{i}.", lc) for i in range(lc.num_layers)],
      final_norm=r.get("norm.weight", (h,)),
  )
  return Drafter(params=params, config=cfg, path=path)
