"""Safetensors files without torch: an 8-byte header length, a JSON header, then the tensors'
bytes (memory-mapped on read, so tensors stay on the host until placed; bfloat16 included).

Reading checks the header against the file before any tensor is touched: its length within the
file, valid JSON, known dtypes, every tensor's byte range inside the data and of its shape's size,
no two ranges overlapping. Errors name the file and the tensor. Writing is atomic
(`files.atomic_write`): a killed export leaves the old file or the new one, never a torn one.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

from ddtree_jax.checkpoints.files import atomic_write

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F8_E4M3": ml_dtypes.float8_e4m3fn,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_}
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors format's own limit


class CheckpointError(ValueError):
  """A checkpoint file or directory that cannot be read as it claims to be."""


def _header(path: str, size: int) -> tuple[dict, int]:
  if size < 8:
    raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors header")
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    if n > MAX_HEADER_BYTES or 8 + n > size:
      raise CheckpointError(f"{path}: header length {n} does not fit the file's {size} bytes "
                            "(truncated or not a safetensors file)")
    raw = f.read(n)
  try:
    header = json.loads(raw)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e})") from None
  if not isinstance(header, dict):
    raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
  return header, 8 + n


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """Memory-maps one .safetensors file: {name: read-only array}, after checking its header."""
  size = os.path.getsize(path)
  header, start_of_data = _header(path, size)
  data_size = size - start_of_data
  spans, infos = [], {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
      raise CheckpointError(f"{where}: header entry lacks dtype, shape or data_offsets")
    if info["dtype"] not in _DTYPES:
      raise CheckpointError(f"{where} has unsupported dtype {info['dtype']!r}")
    shape, offsets = info["shape"], info["data_offsets"]
    if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
        or not isinstance(offsets, list) or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)):
      raise CheckpointError(f"{where}: bad shape {shape!r} or data_offsets {offsets!r}")
    start, end = offsets
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[info["dtype"]]).itemsize
    if not 0 <= start <= end <= data_size:
      raise CheckpointError(f"{where}: bytes [{start}, {end}) lie outside the file's "
                            f"{data_size} data bytes (truncated file?)")
    if end - start != nbytes:
      raise CheckpointError(f"{where}: {end - start} bytes for shape {shape} of "
                            f"{info['dtype']} ({nbytes} bytes)")
    spans.append((start, end, name))
    infos[name] = info
  spans.sort()
  for (s0, e0, a), (s1, _, b) in zip(spans, spans[1:]):
    if s1 < e0:
      raise CheckpointError(f"{path}: tensors {a!r} and {b!r} overlap (bytes {s1}-{e0})")
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=start_of_data) if data_size else None
  out = {}
  for name, info in infos.items():
    start, end = info["data_offsets"]
    dtype = _DTYPES[info["dtype"]]
    if end == start:
      out[name] = np.zeros(info["shape"], dtype)
    else:
      out[name] = data[start:end].view(dtype).reshape(info["shape"])
  return out


_DTYPE_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def write_safetensors(path: str, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None):
  """Writes one .safetensors file (bfloat16 included), tensors in sorted name order, atomically."""
  header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
  offset, arrays = 0, []
  for name in sorted(tensors):
    t = np.ascontiguousarray(tensors[name])
    header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                    "data_offsets": [offset, offset + t.nbytes]}
    offset += t.nbytes
    arrays.append(t)
  raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
  raw += b" " * (-len(raw) % 8)
  with atomic_write(path) as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for t in arrays:
      f.write(memoryview(t.reshape(-1).view(np.uint8)))
