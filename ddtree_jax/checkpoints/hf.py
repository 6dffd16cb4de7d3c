"""Hugging Face checkpoint loading without torch: config.json + safetensors (+ tokenizer.json),
and orbax checkpoints of our own params. Tensors are memory-mapped (`safetensors_io`) and stay on
the host until placed, each device receiving only its shard. Nothing shipped with a checkpoint is
ever executed. Writing HF directories: `hf_export`."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ddtree_jax import sharding
from ddtree_jax.checkpoints import files, quantized
from ddtree_jax.models import registry
from ddtree_jax.models.config import ModelConfig
from ddtree_jax.models.decoder import Params
from ddtree_jax.checkpoints.safetensors_io import CheckpointError, read_safetensors
from ddtree_jax.checkpoints.tensor_reader import SKIPPED_TENSORS, TensorReader


def read_checkpoint_tensors(path: str) -> dict[str, np.ndarray]:
  """All tensors of an HF directory: model.safetensors or a sharded index whose shards lie
  inside the directory and hold every tensor the index names."""
  return checkpoint_tensors(path)[0]


def checkpoint_tensors(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """`read_checkpoint_tensors`, and the file that holds each tensor."""
  single = os.path.join(path, "model.safetensors")
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(single):
    tensors = read_safetensors(single)
    return tensors, dict.fromkeys(tensors, single)
  if not os.path.exists(index):
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json "
                            "(only safetensors checkpoints are loaded)")
  weight_map = read_json(index).get("weight_map")
  if not isinstance(weight_map, dict) or not all(
      isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
    raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
  root = os.path.realpath(path)
  tensors, by_file, files = {}, {}, {}
  for name, file in weight_map.items():
    by_file.setdefault(file, []).append(name)
  for file, names in sorted(by_file.items()):
    shard = os.path.realpath(os.path.join(root, file))
    if os.path.commonpath([root, shard]) != root or os.path.dirname(shard) != root:
      raise CheckpointError(f"{index}: shard {file!r} is not a file of the checkpoint "
                            "directory")
    if not os.path.isfile(shard):
      raise CheckpointError(f"{index}: shard {file!r} does not exist")
    part = read_safetensors(shard)
    missing = sorted(set(names) - set(part))
    if missing:
      raise CheckpointError(f"{shard}: lacks tensors the index puts there: {missing[:5]}")
    tensors.update(part)
    files.update(dict.fromkeys(part, shard))
  return tensors, files


def read_json(file: str) -> dict[str, Any]:
  """A JSON object from `file`; errors name the file."""
  try:
    with open(file) as f:
      obj = json.load(f)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{file}: not valid JSON ({e})") from None
  if not isinstance(obj, dict):
    raise CheckpointError(f"{file}: expected a JSON object, got {type(obj).__name__}")
  return obj


def read_config(path: str) -> dict[str, Any]:
  file = os.path.join(path, "config.json")
  if not os.path.exists(file):
    raise FileNotFoundError(f"{path}: no config.json")
  return read_json(file)


# Leaves kept in float32 whatever the weights' dtype.
FLOAT32_LEAVES = ("router", "bias", "router_bias")


def _leaf_dtype(path, t, dtype):
  """The device dtype of a host leaf: a quantized stack's words, fp8 values and scales keep the
  checkpoint's dtype (`quant.Int4Experts`, `quant.Fp8Experts`); routers float32; the rest
  `dtype`."""
  stored = np.dtype(t.dtype)
  if stored.kind in "iu" or stored == ml_dtypes.float8_e4m3fn or _key(path[-1]) == "scale":
    return stored
  return jnp.dtype(jnp.float32) if _key(path[-1]) in FLOAT32_LEAVES else dtype


def place(host_tree, dtype, shardings=None):
  """Host tensors (numpy views / Stacked / Joined) -> device arrays of `dtype`.

  Without shardings each tensor goes whole to the default device. With a NamedSharding pytree
  every device receives only its own shard, read and converted from the memory map by
  `jax.make_array_from_callback`: no device (and no host buffer) ever holds a full copy of a
  sharded tensor. A MoE router stays float32 (routing is computed in float32); quantized expert
  stacks stay as stored (`_leaf_dtype`)."""
  dtype = jnp.dtype(dtype)

  def read(path, t, idx):
    dt = _leaf_dtype(path, t, dtype)
    x = np.asarray(t[idx]).astype(dt, copy=False)
    bad = x.size - int(np.isfinite(x).sum())
    if bad:
      raise CheckpointError(f"weights {jax.tree_util.keystr(path)}: {bad} non-finite values in "
                            f"{dt.name} (a broken checkpoint, or values that overflow it)")
    return x

  if shardings is None:
    return jax.tree_util.tree_map_with_path(lambda p, t: jnp.asarray(read(p, t, ...)), host_tree)
  return jax.tree_util.tree_map_with_path(
      lambda p, t, s: jax.make_array_from_callback(tuple(t.shape), s,
                                                   lambda idx: read(p, t, idx)),
      host_tree, shardings)


def load_tokenizer(path: str):
  file = os.path.join(path, "tokenizer.json")
  if not os.path.exists(file):
    return None
  import tokenizers  # pylint: disable=import-outside-toplevel
  try:
    return tokenizers.Tokenizer.from_file(file)
  except Exception as e:  # pylint: disable=broad-except  (tokenizers raises plain Exceptions)
    raise CheckpointError(f"{file}: not a readable tokenizer ({e})") from None


@dataclasses.dataclass(frozen=True)
class Target:
  """A loaded target model: params pytree + static config (+ tokenizer when shipped)."""
  params: Params
  config: ModelConfig
  tokenizer: Any = None
  path: str | None = None
  mesh: Any = None                # jax.sharding.Mesh when tensor-parallel (see sharding.py)
  rules: Any = None               # sharding.ShardingRules used with mesh

  @property
  def dtype(self):
    return self.params.embed.dtype


DTYPE_NAMES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32,
               "fp32": jnp.float32, "float16": jnp.float16}


def parse_dtype(dtype) -> jnp.dtype:
  """A float compute dtype: a name of DTYPE_NAMES or a float32 / bfloat16 / float16 dtype."""
  if isinstance(dtype, str):
    if dtype not in DTYPE_NAMES:
      raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPE_NAMES)}")
    return jnp.dtype(DTYPE_NAMES[dtype])
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPE_NAMES)}") from None
  if dt not in {jnp.dtype(v) for v in DTYPE_NAMES.values()}:
    raise ValueError(f"dtype {dt.name} cannot hold weights; choose one of {sorted(DTYPE_NAMES)}")
  return dt


def place_sharded(host, dtype, mesh, rules):
  """Host params -> device params, sharded over `mesh` by `rules` when a mesh is given (the
  vocabulary padded to the vocab axis where it does not divide: `sharding.pad_vocab`)."""
  if mesh is None:
    return place(host, dtype)
  mesh = sharding.check_mesh(mesh)
  host = sharding.pad_vocab(host, mesh, rules)
  return place(host, dtype, sharding.shardings(host, mesh, rules))


def load_target_params(path: str, cfg: ModelConfig, dtype, mesh=None, rules=None,
                       fuse_qkv: bool = False, raw: dict[str, Any] | None = None) -> Params:
  """The target's weights on the device (or `mesh`); fuse_qkv (one device): `decoder.fuse_qkv`'s
  layout, concatenated on the host. raw: config.json's dict (FP8 blocks, MTP layers)."""
  if fuse_qkv and mesh is not None:
    raise ValueError("fuse_qkv is for one device: on a mesh q and kv heads shard on their own "
                     "axes (load with fuse_qkv=False)")
  raw = read_config(path) if raw is None else raw
  source = os.path.join(path, "config.json")
  family = registry.lookup(cfg.model_type, source)
  tensors, where = checkpoint_tensors(path)
  r = TensorReader(tensors, path, quantized.from_config(raw, source), where)
  host = family.params(r, cfg, raw, fuse_qkv)
  r.check_complete(skip=SKIPPED_TENSORS + tuple(family.skip(raw, cfg)),
                   hint=f"Does config.json (num_hidden_layers {cfg.num_layers}, "
                        f"tie_word_embeddings {cfg.tie_word_embeddings}) describe this checkpoint?")
  return place_sharded(host, dtype, mesh, rules)


def load_target(path: str, dtype="bfloat16", mesh=None, rules=None, fuse_qkv: bool = True) -> Target:
  """Loads a Hugging Face directory of a registered family (`registry.supported()`: Qwen3 dense
  or MoE, Llama, DeepSeek-V3 / Kimi-K2, Kimi K2.5 / K2.6, the Qwen3.5 hybrids, gpt-oss),
  safetensors only. Quantized routed experts (int4 pack-quantized, block FP8, MXFP4) stay quantized on the device whatever `dtype` and
  compute in it (logged: `quantized.compute_notice`); other quantized Linears are dequantised to
  `dtype` (`checkpoints/quantized.py`).

  With a `mesh` (sharding.make_mesh) every tensor goes straight from the memory map onto its
  shards, laid out by `rules` (default sharding.ShardingRules(): tensor parallel over "tp");
  a vocabulary that the vocab axis does not divide is padded (`sharding.pad_vocab`), any other
  dimension that does not divide the mesh is refused with a ValueError (see sharding.py).
  On one device (no mesh) each layer's q and k/v weights become one wqkv (`decoder.fuse_qkv`'s
  layout, concatenated on the host: one projection GEMM per layer) unless fuse_qkv=False; fused
  params cannot be sharded (nor an orbax checkpoint of them restored onto a mesh).
  """
  raw = read_config(path)
  cfg = registry.config_from_hf(raw, source=os.path.join(path, "config.json"))
  dtype = parse_dtype(dtype)
  if mesh is not None:
    mesh = sharding.check_mesh(mesh)
    rules = rules or sharding.DEFAULT_RULES
  params = load_target_params(path, cfg, dtype, mesh, rules,
                              fuse_qkv=mesh is None and fuse_qkv and not cfg.is_mla, raw=raw)
  quantized.log_compute(params, dtype, path)
  return Target(params=params, config=cfg, tokenizer=load_tokenizer(path), path=path, mesh=mesh,
                rules=rules)


# --------------------------------------------------------------------------------------------
# Orbax checkpoints of our own params pytrees, restorable onto any mesh.


def _key(k) -> str:
  """A pytree path entry (attribute, list index or dict key) as a string."""
  return str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k))))


def _nested(tree) -> dict:
  """Params-like pytree -> nested dict keyed by field names / list indices (None leaves dropped),
  the form orbax stores; the layout is independent of how the arrays are sharded."""
  out: dict = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    keys = [_key(k) for k in path]
    d = out
    for k in keys[:-1]:
      d = d.setdefault(k, {})
    d[keys[-1]] = leaf
  return out


def save_params(path: str, params) -> None:
  """Writes a params pytree (target or drafter; sharded or not) as an orbax checkpoint."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  path = os.path.abspath(path)
  files.remove_stale_orbax_temporaries(os.path.dirname(path), glob.escape(os.path.basename(path)))
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, _nested(params))
    ckptr.wait_until_finished()


def restore_params(path: str, like, mesh=None, rules=None):
  """Restores a `save_params` checkpoint into the structure of `like` (arrays or
  ShapeDtypeStructs), each array read straight onto its shards of `mesh` laid out by `rules`
  (None: one device). The saving mesh does not matter."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  if mesh is None:
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target_sh = jax.tree.map(lambda _: dev, like)
  else:
    target_sh = sharding.shardings(like, sharding.check_mesh(mesh), rules)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          like, target_sh)
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(os.path.abspath(path), _nested(abstract))
  paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  leaves = []
  for p, _ in paths:
    d = restored
    for k in p:
      d = d[_key(k)]
    leaves.append(d)
  return jax.tree_util.tree_unflatten(treedef, leaves)
