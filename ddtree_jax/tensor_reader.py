"""Named checkpoint tensors as lazy host views in our layouts, with shape checks and a record of
what was read. Nothing is read from the memory map until `checkpoint.place` slices a view, so a
device on a mesh receives only its shard (for a MoE layer: only its experts).

HF layouts read here: torch Linear [out, in] (-> [in, out]); a Qwen3-MoE layer's experts as
per-expert Linears `mlp.experts.{e}.{gate,up,down}_proj.weight` or fused 3-D tensors
`mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I], its router
`mlp.gate.weight` [E, H]; DeepSeek-V3's latent attention (`self_attn.q_a_proj`, `q_b_proj` or
`q_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`, their norms), router bias
(`mlp.gate.e_score_correction_bias`) and shared experts (`mlp.shared_experts.*`). FP8
block-quantised tensors (`weight` in float8_e4m3fn with `weight_scale_inv` per block) are
dequantised on the host, tensor by tensor, in float32.
"""

from __future__ import annotations

import re

import numpy as np

import ml_dtypes

from ddtree_jax.config import ModelConfig
from ddtree_jax.mla import MLAParams, rope_pairs_to_halves
from ddtree_jax.model import LayerParams
from ddtree_jax.moe import MoEParams
from ddtree_jax.safetensors_io import CheckpointError


def _full_index(idx, ndim: int) -> tuple:
  """An index (one entry, a tuple, or `...` alone) as a tuple of ndim entries."""
  idx = tuple(idx) if isinstance(idx, tuple) else (idx,)
  idx = () if idx == (Ellipsis,) else idx
  return idx + (slice(None),) * (ndim - len(idx))


class Stacked:
  """A lazy np.stack of host tensors along `axis`: slicing reads only the requested region."""

  def __init__(self, parts, axis: int):
    self.parts, self.axis = list(parts), axis
    self.shape = parts[0].shape[:axis] + (len(parts),) + parts[0].shape[axis:]

  def __getitem__(self, idx):
    idx = _full_index(idx, len(self.shape))
    rest = idx[:self.axis] + idx[self.axis + 1:]
    picked = range(len(self.parts))[idx[self.axis]]
    return np.stack([np.asarray(self.parts[i][rest]) for i in picked], axis=self.axis)


class Joined:
  """A lazy np.concatenate of host tensors along `axis` (model.fuse_qkv's wqkv, made on the host
  so that no device holds the separate weights too). Indexed by slices only (or `...` alone)."""

  def __init__(self, parts, axis: int):
    self.parts, self.axis = list(parts), axis
    off_axis = lambda p: p.shape[:axis] + p.shape[axis + 1:]
    if any(off_axis(p) != off_axis(parts[0]) for p in parts):
      raise ValueError(f"Joined: parts {[p.shape for p in parts]} differ off axis {axis}")
    size = sum(p.shape[axis] for p in parts)
    self.shape = parts[0].shape[:axis] + (size,) + parts[0].shape[axis + 1:]

  def __getitem__(self, idx):
    idx = _full_index(idx, len(self.shape))
    if not all(isinstance(i, slice) for i in idx):
      raise TypeError(f"Joined is indexed by slices only, got {idx}")
    whole = idx[:self.axis] + (slice(None),) + idx[self.axis + 1:]
    joined = np.concatenate([np.asarray(p[whole]) for p in self.parts], axis=self.axis)
    return joined[(slice(None),) * self.axis + (idx[self.axis],)]


class _Missing:
  """Stands in for a tensor the checkpoint lacks until `TensorReader.check_complete` reports it."""

  def __init__(self, shape):
    self.shape = tuple(shape)

  @property
  def T(self):  # pylint: disable=invalid-name
    return _Missing(self.shape[::-1])

  def reshape(self, *shape):
    return _Missing(shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape)

  def transpose(self, *axes):
    return _Missing(tuple(self.shape[a] for a in axes))


# Tensors a checkpoint may hold that no model here reads (RoPE tables are recomputed).
SKIPPED_TENSORS = (re.compile(r"(^|\.)rotary_emb\.inv_freq$"),)


class TensorReader:
  """Fetches named tensors with shape checks as lazy host views in our [in, out] layouts
  (memory-mapped numpy views, `Stacked` or `Joined`); nothing is read until `place` slices them.
  It records what it reads: `check_complete` then refuses a checkpoint with missing tensors or
  tensors no one read (a config that does not match the file, a bias the model has no place for).
  """

  def __init__(self, tensors: dict[str, np.ndarray], source: str,
               fp8_block: tuple[int, int] | None = None):
    self.tensors, self.source, self.fp8_block = tensors, source, fp8_block
    self.used, self.missing = set(), []

  def raw(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in self.tensors:
      self.missing.append(f"{name} {tuple(shape)}")
      return _Missing(shape)
    t = self.tensors[name]
    if tuple(t.shape) != tuple(shape):
      raise CheckpointError(f"{self.source}: tensor {name!r} has shape {tuple(t.shape)}, "
                            f"expected {tuple(shape)}")
    self.used.add(name)
    return self._dequantized(name, t) if t.dtype == ml_dtypes.float8_e4m3fn else t

  def _dequantized(self, name: str, t: np.ndarray) -> np.ndarray:
    """An FP8 [out, in] weight times its per-block `<name>_scale_inv` [ceil(out/bo),
    ceil(in/bi)], in float32 (DeepSeek-V3's block quantisation)."""
    scale_name = name + "_scale_inv"
    if self.fp8_block is None:
      raise CheckpointError(f"{self.source}: tensor {name!r} is float8 but config.json has no "
                            "quantization_config with weight_block_size")
    if t.ndim != 2 or scale_name not in self.tensors:
      raise CheckpointError(f"{self.source}: float8 tensor {name!r} needs a 2-D weight and "
                            f"{scale_name!r} (block-quantised FP8)")
    bo, bi = self.fp8_block
    want = (-(-t.shape[0] // bo), -(-t.shape[1] // bi))
    scale = self.tensors[scale_name]
    if tuple(scale.shape) != want:
      raise CheckpointError(f"{self.source}: {scale_name!r} has shape {tuple(scale.shape)}, "
                            f"expected {want} for {tuple(t.shape)} in {bo}x{bi} blocks")
    self.used.add(scale_name)
    full = np.repeat(np.repeat(np.asarray(scale, np.float32), bo, 0), bi, 1)
    return np.asarray(t).astype(np.float32) * full[:t.shape[0], :t.shape[1]]

  def check_complete(self, skip=SKIPPED_TENSORS, hint: str = "") -> None:
    """Raises CheckpointError naming the missing tensors and those nothing read (less `skip`)."""
    unused = sorted(n for n in set(self.tensors) - self.used
                    if not any(p.search(n) for p in skip))
    if not self.missing and not unused:
      return
    parts = []
    if self.missing:
      parts.append(f"missing tensors {self.missing[:6]}"
                   + (f" (+{len(self.missing) - 6} more)" if len(self.missing) > 6 else ""))
    if unused:
      parts.append(f"tensors this loader does not read {unused[:6]}"
                   + (f" (+{len(unused) - 6} more)" if len(unused) > 6 else ""))
    raise CheckpointError(f"{self.source}: " + "; ".join(parts) + (f". {hint}" if hint else ""))

  def get(self, name: str, shape, transform=lambda t: t):
    return transform(self.raw(name, shape))

  def linear(self, name: str, out_dim: int, in_dim: int, split: tuple[int, ...] = ()):
    """torch Linear [out, in] -> [in, *split] (split factors out_dim, e.g. heads x head_dim).
    Transposing and splitting one axis are both views: still nothing is read."""
    return self.get(name, (out_dim, in_dim), lambda t: t.T.reshape((in_dim,) + (split or (out_dim,))))

  def mla(self, prefix: str, cfg: ModelConfig) -> MLAParams:
    """A latent-attention block (`mla.MLAParams`); interleaved RoPE dims are reordered into
    halves (`mla.rope_pairs_to_halves`), so the rotate-half RoPE gives HF's outputs."""
    h, n, dn, r, dv = (cfg.hidden_size, cfg.num_heads, cfg.qk_nope_head_dim,
                       cfg.qk_rope_head_dim, cfg.v_head_dim)
    c, q = cfg.kv_lora_rank, cfg.q_lora_rank
    order = (rope_pairs_to_halves(r) if cfg.rope_interleave else np.arange(r))
    q_cols = np.concatenate([np.arange(dn), dn + order])
    heads = lambda t: np.asarray(t.T.reshape(t.shape[1], n, dn + r))[..., q_cols]
    kv_b = self.linear(prefix + "kv_b_proj.weight", n * (dn + dv), c, (n, dn + dv))
    return MLAParams(
        wq=None if q else self.get(prefix + "q_proj.weight", (n * (dn + r), h), heads),
        wq_a=self.linear(prefix + "q_a_proj.weight", q, h) if q else None,
        q_a_norm=self.get(prefix + "q_a_layernorm.weight", (q,)) if q else None,
        wq_b=self.get(prefix + "q_b_proj.weight", (n * (dn + r), q), heads) if q else None,
        wkv_a=self.get(prefix + "kv_a_proj_with_mqa.weight", (c + r, h),
                       lambda t: np.asarray(t.T)[:, np.concatenate([np.arange(c), c + order])]),
        kv_a_norm=self.get(prefix + "kv_a_layernorm.weight", (c,)),
        w_uk=kv_b[..., :dn], w_uv=kv_b[..., dn:],
        wo=self.get(prefix + "o_proj.weight", (h, n * dv), lambda t: t.T.reshape(n, dv, h)))

  def layer(self, prefix: str, cfg: ModelConfig, fuse_qkv: bool = False,
            moe: bool = False) -> LayerParams:
    """One decoder layer; fuse_qkv: q, k and v as one wqkv [H, N + 2K, D] (`model.fuse_qkv`);
    moe: its MLP block is a mixture of experts (`experts`), with DeepSeek's shared experts as
    its dense MLP."""
    h, n, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    mlp = self._mlp(prefix, cfg, moe)
    if cfg.is_mla:
      return LayerParams(input_norm=self.get(prefix + "input_layernorm.weight", (h,)), wq=None,
                         wkv=None, wo=None, q_norm=None, k_norm=None,
                         post_norm=self.get(prefix + "post_attention_layernorm.weight", (h,)),
                         mla=self.mla(prefix + "self_attn.", cfg), **mlp)
    a = prefix + "self_attn."
    kproj = self.linear(a + "k_proj.weight", k * d, h, (k, d))
    vproj = self.linear(a + "v_proj.weight", k * d, h, (k, d))
    wq = self.linear(a + "q_proj.weight", n * d, h, (n, d))
    return LayerParams(
        input_norm=self.get(prefix + "input_layernorm.weight", (h,)),
        wq=None if fuse_qkv else wq,
        wkv=None if fuse_qkv else Stacked([kproj, vproj], axis=1),
        wo=self.get(a + "o_proj.weight", (h, n * d), lambda t: t.T.reshape(n, d, h)),
        q_norm=self.get(a + "q_norm.weight", (d,)) if cfg.qk_norm else None,
        k_norm=self.get(a + "k_norm.weight", (d,)) if cfg.qk_norm else None,
        post_norm=self.get(prefix + "post_attention_layernorm.weight", (h,)),
        wqkv=Joined([wq, kproj, vproj], axis=1) if fuse_qkv else None,
        **mlp,
    )

  def _mlp(self, prefix: str, cfg: ModelConfig, moe: bool) -> dict:
    """The MLP block's LayerParams fields: a dense SwiGLU, or experts (+ shared experts)."""
    h = cfg.hidden_size

    def swiglu(p, i):
      gate, up = self.linear(p + "gate_proj.weight", i, h), self.linear(p + "up_proj.weight", i, h)
      return dict(w_gate_up=Stacked([gate, up], axis=1),
                  w_down=self.linear(p + "down_proj.weight", h, i))
    if not moe:
      return swiglu(prefix + "mlp.", cfg.intermediate_size)
    shared = cfg.n_shared_experts * cfg.moe_intermediate_size
    return dict(**(swiglu(prefix + "mlp.shared_experts.", shared) if shared
                   else dict(w_gate_up=None, w_down=None)),
                moe=self.experts(prefix + "mlp.", cfg))

  def experts(self, prefix: str, cfg: ModelConfig) -> MoEParams:
    """A MoE block's router [H, E] and experts stacked [E, H, 2, I] / [E, I, H], from fused
    `experts.gate_up_proj` / `experts.down_proj` tensors when the checkpoint has them, else from
    the per-expert Linears (stacked lazily: a shard reads only its experts)."""
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    router = self.linear(prefix + "gate.weight", e, h)
    bias = (self.get(prefix + "gate.e_score_correction_bias", (e,))
            if cfg.scoring_func == "sigmoid" else None)
    x = prefix + "experts."
    if x + "gate_up_proj" in self.tensors:
      gate_up = self.get(x + "gate_up_proj", (e, 2 * i, h),
                         lambda t: t.reshape(e, 2, i, h).transpose(0, 3, 1, 2))
      down = self.get(x + "down_proj", (e, h, i), lambda t: t.transpose(0, 2, 1))
      return MoEParams(router=router, w_gate_up=gate_up, w_down=down, bias=bias)
    one = lambda j, name, out_dim, in_dim: self.linear(f"{x}{j}.{name}.weight", out_dim, in_dim)
    gate_up = Stacked([Stacked([one(j, "gate_proj", i, h), one(j, "up_proj", i, h)], axis=1)
                       for j in range(e)], axis=0)
    down = Stacked([one(j, "down_proj", h, i) for j in range(e)], axis=0)
    return MoEParams(router=router, w_gate_up=gate_up, w_down=down, bias=bias)
