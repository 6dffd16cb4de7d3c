"""Quantized checkpoint formats, read through the formats' own fields (config.json's
`quantization_config` and each Linear's tensors):

  compressed-tensors `pack-quantized` (Kimi K2.5 / K2.6's routed experts, W4A16): per Linear
      `weight_packed` int32 [out, in/8] (eight int4 values a word, offset by 8, the lowest bits
      first along the input dim), `weight_scale` [out, in/group_size], `weight_shape` [2];
      symmetric, one scale per group of inputs, no zero point.
  FP8 block-quantized (DeepSeek-V3, Kimi-K2): `weight` float8_e4m3fn [out, in] and
      `weight_scale_inv` float32 [ceil(out/bo), ceil(in/bi)], one scale per block.
  MXFP4 (gpt-oss, `quant_method: mxfp4`): each expert stack as `{name}_blocks` uint8
      [E, out, in/32, 16] (two e2m1 values a byte, the low nibble first) and `{name}_scales`
      uint8 [E, out, in/32] (e8m0 exponents); the experts' biases and every other tensor float.

A routed expert's Linear stays quantized on the device (`quant.Int4Experts`, `quant.Fp8Experts`,
`quant.Mxfp4Experts`: these views, stacked); any other quantized Linear is dequantized on the
host in float32 when read. What is not implemented (activation quantization, asymmetric zero
points, activation ordering, other bit widths or group sizes) is refused naming the field.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ddtree_jax.checkpoints.safetensors_io import CheckpointError
from ddtree_jax.models import quant

INT4_GROUP_SIZES = (32,)  # the group sizes the kernels and tests cover


@dataclasses.dataclass(frozen=True)
class Quantization:
  """A checkpoint's quantized Linears: fp8_block (rows, cols) of FP8 scales, int4_group the
  inputs per int4 scale; None where the checkpoint has no such tensors."""
  fp8_block: tuple[int, int] | None = None
  int4_group: int | None = None
  mxfp4: bool = False


NONE = Quantization()


def from_config(raw: dict[str, Any], source: str) -> Quantization:
  """The `quantization_config` of config.json (top level, or a wrapper's `text_config`)."""
  q = raw.get("quantization_config")
  if q is None and isinstance(raw.get("text_config"), dict):
    q = raw["text_config"].get("quantization_config")
  if q is None:
    return NONE
  if not isinstance(q, dict):
    raise ValueError(f"{source}: quantization_config must be a JSON object")
  method = q.get("quant_method")
  if method == "fp8":
    return Quantization(fp8_block=_fp8_block(q, source))
  if method == "compressed-tensors":
    return Quantization(int4_group=_pack_quantized_group(q, source))
  if method == "mxfp4":
    if q.get("dequantize"):  # (an instruction to transformers' loader, not a format)
      raise ValueError(f"{source}: mxfp4 quantization_config dequantize=True is not implemented "
                       "(the experts are read as shipped, MXFP4)")
    return Quantization(mxfp4=True)
  raise ValueError(f"{source}: unsupported quantization_config quant_method={method!r} "
                   "(supported: 'fp8' block-quantized e4m3, DeepSeek-V3's format; "
                   "'compressed-tensors' pack-quantized int4; 'mxfp4', gpt-oss's experts)")


def _fp8_block(q: dict[str, Any], source: str) -> tuple[int, int]:
  block = q.get("weight_block_size")
  if q.get("fmt", "e4m3") != "e4m3":
    raise ValueError(f"{source}: unsupported fp8 quantization_config fmt={q.get('fmt')!r} "
                     "(only e4m3)")
  if (not isinstance(block, list) or len(block) != 2
      or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
    raise ValueError(f"{source}: fp8 quantization_config needs weight_block_size [rows, cols], "
                     f"got {block!r}")
  return block[0], block[1]


def _pack_quantized_group(q: dict[str, Any], source: str) -> int:
  """The group size of a compressed-tensors W4A16 pack-quantized config; anything else refused."""
  where = f"{source}: compressed-tensors quantization_config"
  if q.get("format") != "pack-quantized":
    raise ValueError(f"{where}: format={q.get('format')!r} is not implemented (only "
                     "'pack-quantized')")
  if q.get("quantization_status", "compressed") != "compressed":
    raise ValueError(f"{where}: quantization_status={q.get('quantization_status')!r} (the "
                     "weights must be saved compressed)")
  groups = q.get("config_groups")
  if not isinstance(groups, dict) or not groups:
    raise ValueError(f"{where}: needs config_groups")
  sizes = set()
  for name, group in groups.items():
    at = f"{where}: config_groups.{name}"
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
      raise ValueError(f"{at} needs a 'weights' object")
    if group.get("format", "pack-quantized") != "pack-quantized":
      raise ValueError(f"{at}.format={group['format']!r} is not implemented")
    for act in ("input_activations", "output_activations"):
      if group.get(act):
        raise ValueError(f"{at}.{act} is set: activation quantization is not implemented "
                         "(weights only, W4A16)")
    w = group["weights"]
    want = dict(num_bits=4, type="int", symmetric=True, strategy="group")
    for key, value in want.items():
      if w.get(key) != value:
        raise ValueError(f"{at}.weights.{key}={w.get(key)!r} is not implemented (only {value!r})")
    for key in ("actorder", "dynamic", "block_structure"):
      if w.get(key) not in (None, False):
        raise ValueError(f"{at}.weights.{key}={w[key]!r} is not implemented")
    if w.get("group_size") not in INT4_GROUP_SIZES:
      raise ValueError(f"{at}.weights.group_size={w.get('group_size')!r} is not implemented "
                       f"(supported: {INT4_GROUP_SIZES})")
    sizes.add(w["group_size"])
  if len(sizes) > 1:
    raise ValueError(f"{where}: config groups with different group sizes {sorted(sizes)}")
  return sizes.pop()


# -------------------------------------------------------------------------- per-tensor reading


def is_packed(tensors, name: str) -> bool:
  """Whether Linear weight `name` (...`.weight`) is stored pack-quantized."""
  return name.endswith(".weight") and name + "_packed" in tensors


def is_fp8(t) -> bool:
  return np.dtype(t.dtype) == ml_dtypes.float8_e4m3fn


def _int4_parts(r, name: str, out_dim: int, in_dim: int):
  """Checked (packed [out, in/8], scale [out, in/G]) of pack-quantized Linear `name`."""
  g = r.quantization.int4_group
  packed_name, scale_name, shape_name = (name + "_packed", name[:-len("weight")] + "weight_scale",
                                         name + "_shape")
  if g is None:
    raise CheckpointError(f"{r.where(packed_name)} is pack-quantized but config.json has no "
                          "compressed-tensors quantization_config")
  for n in (scale_name, shape_name):
    if n not in r.tensors:
      raise CheckpointError(f"{r.where(packed_name)} has no {n!r} (a pack-quantized Linear needs "
                            "weight_packed, weight_scale and weight_shape)")
  stated = tuple(int(v) for v in np.asarray(r.tensors[shape_name]).reshape(-1))
  if stated != (out_dim, in_dim):
    raise CheckpointError(f"{r.where(shape_name)} is {list(stated)}, the model expects "
                          f"[{out_dim}, {in_dim}]")
  if in_dim % g:
    raise CheckpointError(f"{r.where(packed_name)}: group_size {g} does not divide the input "
                          f"dim {in_dim}")
  packed, scale = r.tensors[packed_name], r.tensors[scale_name]
  if packed.dtype != np.int32 or tuple(packed.shape) != (out_dim, in_dim // quant.NIBBLES):
    raise CheckpointError(f"{r.where(packed_name)} is {packed.dtype} {tuple(packed.shape)}, "
                          f"expected int32 {(out_dim, in_dim // quant.NIBBLES)} for weight_shape "
                          f"{list(stated)}")
  if tuple(scale.shape) != (out_dim, in_dim // g):
    raise CheckpointError(f"{r.where(scale_name)} has shape {tuple(scale.shape)}, expected "
                          f"{(out_dim, in_dim // g)} (group_size {g})")
  r.used.update((packed_name, scale_name, shape_name))
  return packed, scale


def int4_views(r, name: str, out_dim: int, in_dim: int) -> quant.Int4Experts:
  """A pack-quantized Linear as an `Int4Experts` record of lazy views without the experts
  axis: packed [in/8, out], scale [in/G, out]."""
  packed, scale = _int4_parts(r, name, out_dim, in_dim)
  return quant.Int4Experts(packed=packed.T, scale=scale.T,
                           group_size=r.quantization.int4_group)


def host_int4(r, name: str, shape) -> np.ndarray:
  """A pack-quantized Linear [out, in] the engine keeps in float: dequantized, float32."""
  packed, scale = _int4_parts(r, name, *shape)
  return quant.host_int4_dequantize(packed, scale, r.quantization.int4_group)


def _fp8_scale(r, name: str, t):
  """The checked `weight_scale_inv` [ceil(out/bo), ceil(in/bi)] of FP8 weight `name`."""
  scale_name = name + "_scale_inv"
  if r.quantization.fp8_block is None:
    raise CheckpointError(f"{r.where(name)} is float8 but config.json has no "
                          "quantization_config with weight_block_size")
  if t.ndim != 2 or scale_name not in r.tensors:
    raise CheckpointError(f"{r.where(name)}: a float8 weight needs a 2-D weight and "
                          f"{scale_name!r} (block-quantised FP8)")
  bo, bi = r.quantization.fp8_block
  want = (-(-t.shape[0] // bo), -(-t.shape[1] // bi))
  scale = r.tensors[scale_name]
  if tuple(scale.shape) != want:
    raise CheckpointError(f"{r.where(scale_name)} has shape {tuple(scale.shape)}, expected "
                          f"{want} for {tuple(t.shape)} in {bo}x{bi} blocks")
  r.used.update((name, scale_name))
  return scale


def fp8_views(r, name: str, out_dim: int, in_dim: int) -> quant.Fp8Experts:
  """An FP8 Linear as an `Fp8Experts` record of lazy views without the experts axis: q [in, out],
  scale [ceil(in/bi), ceil(out/bo)] (block read as (inputs, outputs))."""
  t = r.tensors[name]
  if tuple(t.shape) != (out_dim, in_dim):
    raise CheckpointError(f"{r.where(name)} has shape {tuple(t.shape)}, expected "
                          f"{(out_dim, in_dim)}")
  scale = _fp8_scale(r, name, t)
  bo, bi = r.quantization.fp8_block
  return quant.Fp8Experts(q=t.T, scale=scale.T, block=(bi, bo))


def host_fp8(r, name: str, t) -> np.ndarray:
  """An FP8 [out, in] weight the engine keeps in float: times its block scales, float32."""
  scale = _fp8_scale(r, name, t)
  bo, bi = r.quantization.fp8_block
  full = np.repeat(np.repeat(np.asarray(scale, np.float32), bo, 0), bi, 1)
  return np.asarray(t).astype(np.float32) * full[:t.shape[0], :t.shape[1]]


def mxfp4_views(r, name: str, experts: int, out_dim: int, in_dim: int) -> quant.Mxfp4Experts:
  """An MXFP4 expert stack `name` (`{name}_blocks` [E, out, in/32, 16], `{name}_scales`
  [E, out, in/32]) as an `Mxfp4Experts` of lazy views [E, in/2, out] / [E, in/32, out]."""
  full = r.prefix + name
  if not r.quantization.mxfp4:
    raise CheckpointError(f"{r.where(full + '_blocks')} is MXFP4 but config.json has no "
                          "quantization_config with quant_method 'mxfp4'")
  if in_dim % quant.MXFP4_BLOCK:
    raise CheckpointError(f"{r.where(full + '_blocks')}: the input dim {in_dim} is not a "
                          f"multiple of MXFP4's blocks of {quant.MXFP4_BLOCK}")
  g = in_dim // quant.MXFP4_BLOCK
  for part in ("_blocks", "_scales"):
    t = r.tensors.get(full + part)
    if t is not None and np.dtype(t.dtype) != np.uint8:
      raise CheckpointError(f"{r.where(full + part)} is {t.dtype}, MXFP4 stores uint8")
  blocks = r.get(name + "_blocks", (experts, out_dim, g, quant.MXFP4_BLOCK // 2),
                 lambda t: t.reshape(experts, out_dim, in_dim // 2).transpose(0, 2, 1))
  scales = r.get(name + "_scales", (experts, out_dim, g), lambda t: t.transpose(0, 2, 1))
  return quant.Mxfp4Experts(blocks=blocks, scales=scales)


def _format(w) -> str:
  if isinstance(w, quant.Int4Experts):
    return f"int4 (groups of {w.group_size})"
  if isinstance(w, quant.Fp8Experts):
    return f"fp8 (blocks of {w.block[0]}x{w.block[1]})"
  return f"mxfp4 (blocks of {quant.MXFP4_BLOCK})"


def compute_notice(params, dtype) -> str | None:
  """What the quantized expert stacks in `params` compute in at `dtype` (None: there are none).
  Their products are formed in `dtype` from weights dequantized in registers (float32: the
  exact float32 products, not the bfloat16-rounded weights a bfloat16 dequantizer writes); the
  Pallas expert kernels take float32 and bfloat16 only, so float16 runs XLA's
  dequantize-then-GEMM form."""
  stacks = [w for w in jax.tree.leaves(params, is_leaf=quant.is_quantized) if quant.is_quantized(w)]
  if not stacks:
    return None
  names = sorted({_format(w) for w in stacks})
  dt = jnp.dtype(dtype)
  text = (f"{len(stacks)} routed expert stacks kept {' and '.join(names)} on the device; "
          f"their products in {dt.name}")
  if dt == jnp.float16:
    text += (" through XLA's dequantize-then-GEMM form (the Pallas expert kernels take float32 "
             "or bfloat16)")
  elif dt == jnp.float32 and jax.default_backend() == "gpu" and (
      str(jax.config.jax_default_matmul_precision) not in ("highest", "float32", "F32_F32_F32")):
    text += (" at the default matmul precision, under which the Pallas kernels' float32 dots "
             "run TF32 on the GPU (IEEE under jax_default_matmul_precision='highest')")
  return text


def log_compute(params, dtype, source: str) -> None:
  """Logs `compute_notice` (at INFO) for a checkpoint just loaded from `source`."""
  text = compute_notice(params, dtype)
  if text:
    logging.getLogger(__name__).info("%s: %s", source, text)
