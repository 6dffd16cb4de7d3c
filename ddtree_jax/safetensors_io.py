"""Safetensors files without torch: a JSON header, then the tensors' bytes (memory-mapped on read,
so tensors stay on the host until placed; bfloat16 included)."""

from __future__ import annotations

import json
import struct
from typing import Any

import ml_dtypes
import numpy as np

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


_DTYPE_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
  """Writes one .safetensors file (bfloat16 included), tensors in sorted name order."""
  header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
  offset, blobs = 0, []
  for name in sorted(tensors):
    t = np.ascontiguousarray(tensors[name])
    blob = t.tobytes()
    header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                    "data_offsets": [offset, offset + len(blob)]}
    offset += len(blob)
    blobs.append(blob)
  raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
  raw += b" " * (-len(raw) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for blob in blobs:
      f.write(blob)
