"""Named checkpoint tensors as lazy host views in our layouts, with shape checks and a record of
what was read. Nothing is read from the memory map until `checkpoint.place` slices a view, so a
device on a mesh receives only its shard (for a MoE layer: only its experts).

HF layouts read here: torch Linear [out, in] (-> [in, out]); a Qwen3-MoE layer's experts as
per-expert Linears `mlp.experts.{e}.{gate,up,down}_proj.weight` or fused 3-D tensors
`mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I], its router
`mlp.gate.weight` [E, H].
"""

from __future__ import annotations

import re

import numpy as np

from ddtree_jax.config import ModelConfig
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

  def __init__(self, tensors: dict[str, np.ndarray], source: str):
    self.tensors, self.source = tensors, source
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
    return t

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

  def layer(self, prefix: str, cfg: ModelConfig, fuse_qkv: bool = False,
            moe: bool = False) -> LayerParams:
    """One decoder layer; fuse_qkv: q, k and v as one wqkv [H, N + 2K, D] (`model.fuse_qkv`);
    moe: its MLP block is a mixture of experts (`experts`)."""
    h, n, k, d, i = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size)
    a = prefix + "self_attn."
    kproj = self.linear(a + "k_proj.weight", k * d, h, (k, d))
    vproj = self.linear(a + "v_proj.weight", k * d, h, (k, d))
    wq = self.linear(a + "q_proj.weight", n * d, h, (n, d))
    if moe:
      mlp = dict(w_gate_up=None, w_down=None, moe=self.experts(prefix + "mlp.", cfg))
    else:
      gate = self.linear(prefix + "mlp.gate_proj.weight", i, h)
      up = self.linear(prefix + "mlp.up_proj.weight", i, h)
      mlp = dict(w_gate_up=Stacked([gate, up], axis=1),
                 w_down=self.linear(prefix + "mlp.down_proj.weight", h, i))
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

  def experts(self, prefix: str, cfg: ModelConfig) -> MoEParams:
    """A MoE block's router [H, E] and experts stacked [E, H, 2, I] / [E, I, H], from fused
    `experts.gate_up_proj` / `experts.down_proj` tensors when the checkpoint has them, else from
    the per-expert Linears (stacked lazily: a shard reads only its experts)."""
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    router = self.linear(prefix + "gate.weight", e, h)
    x = prefix + "experts."
    if x + "gate_up_proj" in self.tensors:
      gate_up = self.get(x + "gate_up_proj", (e, 2 * i, h),
                         lambda t: t.reshape(e, 2, i, h).transpose(0, 3, 1, 2))
      down = self.get(x + "down_proj", (e, h, i), lambda t: t.transpose(0, 2, 1))
      return MoEParams(router=router, w_gate_up=gate_up, w_down=down)
    one = lambda j, name, out_dim, in_dim: self.linear(f"{x}{j}.{name}.weight", out_dim, in_dim)
    gate_up = Stacked([Stacked([one(j, "gate_proj", i, h), one(j, "up_proj", i, h)], axis=1)
                       for j in range(e)], axis=0)
    down = Stacked([one(j, "down_proj", h, i) for j in range(e)], axis=0)
    return MoEParams(router=router, w_gate_up=gate_up, w_down=down)
