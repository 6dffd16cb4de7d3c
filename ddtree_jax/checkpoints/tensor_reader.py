"""Named checkpoint tensors as lazy host views in our layouts, with shape checks and a record of
what was read. Nothing is read from the memory map until `hf.place` slices a view, so a
device on a mesh receives only its shard (for a MoE layer: only its experts).

Which names a family reads lives in its module (models/qwen3.py, qwen3_moe.py, deepseek_v3.py);
this reader knows the layouts: torch Linear [out, in] (-> [in, out]), lazy stacks and joins of
tensors, and FP8 block-quantised tensors (`weight` in float8_e4m3fn with `weight_scale_inv` per
block), dequantised on the host, tensor by tensor, in float32.
"""

from __future__ import annotations

import re

import numpy as np

import ml_dtypes

from ddtree_jax.checkpoints.safetensors_io import CheckpointError


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
