"""Named checkpoint tensors as lazy host views in our layouts, with shape checks and a record of
what was read. Nothing is read from the memory map until `hf.place` slices a view, so a
device on a mesh receives only its shard (for a MoE layer: only its experts).

Which names a family reads lives in its module (models/qwen3.py, qwen3_moe.py, deepseek_v3.py,
kimi_k25.py); this reader knows the layouts: torch Linear [out, in] (-> [in, out]), lazy stacks
and joins of tensors, and quantized Linears (`checkpoints/quantized.py`): a routed expert's
kept quantized (`quantized_linear`, stacked by `stack`), any other one dequantised on the host,
tensor by tensor, in float32.
"""

from __future__ import annotations

import copy
import re

import jax
import numpy as np

from ddtree_jax.checkpoints import quantized
from ddtree_jax.checkpoints.safetensors_io import CheckpointError
from ddtree_jax.models import quant


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
    self.dtype = parts[0].dtype

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
    self.dtype = parts[0].dtype

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


def stack(parts, axis: int):
  """`Stacked` of per-expert weights: host arrays, or quantized records of one type
  (`TensorReader.quantized_linear`) stacked leaf by leaf."""
  if not quant.is_quantized(parts[0]):
    if any(quant.is_quantized(p) for p in parts):
      raise CheckpointError("an expert's projections mix quantized and float weights")
    return Stacked(parts, axis)
  kinds = {type(p) for p in parts}
  if len(kinds) > 1:
    raise CheckpointError(f"an expert's projections mix formats {sorted(k.__name__ for k in kinds)}")
  leaves = [jax.tree.leaves(p) for p in parts]
  return jax.tree.unflatten(jax.tree.structure(parts[0]),
                            [Stacked(list(ls), axis) for ls in zip(*leaves)])


class TensorReader:
  """Fetches named tensors with shape checks as lazy host views in our [in, out] layouts
  (memory-mapped numpy views, `Stacked` or `Joined`); nothing is read until `place` slices them.
  It records what it reads: `check_complete` then refuses a checkpoint with missing tensors or
  tensors no one read (a config that does not match the file, a bias the model has no place for).
  quantization: the checkpoint's format (`quantized.Quantization`); files: each tensor's file
  (errors name it); prefix: prepended to every name asked for (`with_prefix`).
  """

  def __init__(self, tensors: dict[str, np.ndarray], source: str,
               quantization: quantized.Quantization = quantized.NONE,
               files: dict[str, str] | None = None):
    self.tensors, self.source, self.quantization = tensors, source, quantization
    self.files, self.prefix = files or {}, ""
    self.used, self.missing = set(), []

  def with_prefix(self, prefix: str) -> TensorReader:
    """This reader (the same record of what was read) with `prefix` before every name."""
    view = copy.copy(self)
    view.prefix = self.prefix + prefix
    return view

  def has(self, name: str) -> bool:
    return self.prefix + name in self.tensors

  def where(self, name: str) -> str:
    """`name` and the file that holds it, for errors."""
    return f"{self.files.get(name, self.source)}: tensor {name!r}"

  def raw(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    name = self.prefix + name
    if name not in self.tensors and quantized.is_packed(self.tensors, name):
      return quantized.host_int4(self, name, shape)
    if name not in self.tensors:
      self.missing.append(f"{name} {tuple(shape)}")
      return _Missing(shape)
    t = self.tensors[name]
    if tuple(t.shape) != tuple(shape):
      raise CheckpointError(f"{self.where(name)} has shape {tuple(t.shape)}, expected "
                            f"{tuple(shape)}")
    self.used.add(name)
    return quantized.host_fp8(self, name, t) if quantized.is_fp8(t) else t

  def quantized_linear(self, name: str, out_dim: int, in_dim: int):
    """A routed expert's Linear `name` (…`.weight`) [in, out] as stored: a float view, or a
    quantized record whose leaves lack the experts axis (`quant.Int4Experts` / `Fp8Experts`
    leaves [K.., out]) for `stack` to stack."""
    full = self.prefix + name
    if quantized.is_packed(self.tensors, full):
      return quantized.int4_views(self, full, out_dim, in_dim)
    if full in self.tensors and quantized.is_fp8(self.tensors[full]):
      return quantized.fp8_views(self, full, out_dim, in_dim)
    return self.linear(name, out_dim, in_dim)
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
