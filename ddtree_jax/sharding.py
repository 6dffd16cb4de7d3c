"""Tensor parallelism (and data parallelism over the batch) on a device mesh.

Mesh axes: "tp" splits heads, MLP width and vocab; optional "dp" splits the batch and "ep" a MoE
layer's experts (its expert width also over "tp"). A
`ShardingRules` maps the logical axes to mesh axes; the functions below turn a params / cache /
decode-state pytree into a matching pytree of NamedShardings. Each pytree type states its own
layout (its `partition_specs(axes)` method, beside its layer kind: models/decoder.py, mla.py,
moe.py, drafter.py; speculative/decode.py for the decode state), through `Axes`, which maps a
logical axis to a mesh axis. The layouts:

  wq [H, N, D] split N     wkv [H, 2, K, D] split K    wo [N, D, H] split N (row parallel:
  w_gate_up [H, 2, I] split I    w_down [I, H] split I      XLA inserts the all-reduce)
  embed [V, H], lm_head [H, V] split V, padded where V does not divide (argmax/top-k still
  return global ids)
  norms, q_norm, k_norm replicated; drafter fc [k*H, H] split on its output columns when its
  kv heads split (replicated when they are)
  an int8 drafter's Int8Weight: q (K-major) and scale split like the float weight's dims
  (its stacked context_wkv [H, L, 2, K, D] split K); a drafter's own lm_head [H, V or Vd] split
  like the target's (replicated when a draft vocabulary's Vd is not divisible), draft_vocab
  replicated
  MoE experts w_gate_up [E, H, 2, I], w_down [E, I, H]: E over ep, I over tp; router replicated
  Gated DeltaNet w_qkv [H, Hk, G], conv [K, Hk, G] split Hk (key-head groups); w_z, w_b, w_a,
  dt_bias, A_log split Hv; w_out [Hv dv, H] split rows (row parallel); its norm replicated
  KV cache [L, B, K, S, D]: B over dp, K over tp; per-sequence decode state over dp; Gated
  DeltaNet state [Lr, B, Hv, dk, dv] split Hv, window [Lr, B, K-1, Hk, G] split Hk

Everything else is GSPMD: params and caches carry NamedShardings and jit propagates them. The
kernels (attention, the Pallas q/k norm + RoPE, the embedding lookup) run per shard inside
`jax.shard_map`: `kernels.Kernels` with a mesh wraps them (`kernels.shard_attention`, ...).

Indivisible dimensions: a dimension mapped to a mesh axis must divide by the axis size, else a
ValueError names it; nothing is sharded unevenly. Set that rule to None to replicate the
dimension instead. In particular `ShardingRules(kv_heads=None)` replicates the K/V projections
and caches over tp (each device holds every kv head, the usual fix when kv heads < tp);
`kernels.shard_attention` then hands each device only the kv heads its own query heads use.
The vocabulary is padded instead: placing params (`shard_params`, `hf.load_target`) zero-pads
it to the next multiple of the vocab axis (`pad_vocab`), as vLLM and SGLang pad their
vocabulary shards, and the logits drop the padding again (`decoder.lm_head`).

Multi-host: call `initialize_distributed` (or `mesh_from_flags`) on every process first; the
mesh then spans all hosts' devices and the same code runs on each process.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P



@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """Logical axis -> mesh axis name (None = replicated). Hashable: usable in a jit static arg.

  A rule naming an axis the mesh lacks is treated as None (a tp-only mesh ignores batch="dp").
  """
  batch: str | None = "dp"
  heads: str | None = "tp"
  kv_heads: str | None = "tp"
  mlp: str | None = "tp"
  vocab: str | None = "tp"
  fc: str | None = "tp"           # drafter fc output columns
  experts: str | None = "ep"      # a MoE layer's experts (expert parallelism)
  linear_heads: str | None = "tp"  # a Gated DeltaNet layer's key-head groups (and their state)

  def __post_init__(self):
    if self.kv_heads is not None and self.kv_heads != self.heads:
      raise ValueError(f"kv_heads={self.kv_heads!r} must be sharded like heads={self.heads!r} "
                       "(or replicated: kv_heads=None)")


DEFAULT_RULES = ShardingRules()

# Named layouts (`--mesh_layout`, `rules_from_flags`). "split": every layer's heads and MLP width
# over tp, two all-reduces per layer. "replicated_attention": attention weights and KV caches
# (and a hybrid's Gated DeltaNet layers) whole on every device, only the MLP (and the vocab)
# split: one all-reduce per layer, for small batches, where a collective's latency costs more
# than reading the attention weights.
LAYOUTS = {"split": DEFAULT_RULES,
           "replicated_attention": ShardingRules(heads=None, kv_heads=None, linear_heads=None)}


def make_mesh(shape: dict[str, int] | None = None, devices=None) -> Mesh:
  """A mesh from axis sizes, e.g. {"dp": 1, "tp": 8}; -1 takes the remaining devices.

  Uses the first prod(shape) of `devices` (default jax.devices(), all hosts). Axes are
  AxisType.Auto, so jit's GSPMD propagation places everything not pinned explicitly.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = dict(shape or {"dp": 1, "tp": -1})
  known = int(np.prod([s for s in shape.values() if s != -1]))
  shape = {k: (len(devices) // known if s == -1 else int(s)) for k, s in shape.items()}
  n = int(np.prod(list(shape.values())))
  if n < 1 or n > len(devices) or any(s < 1 for s in shape.values()):
    raise ValueError(f"mesh shape {shape} needs {n} devices; {len(devices)} available")
  return jax.make_mesh(tuple(shape.values()), tuple(shape), devices=devices[:n],
                       axis_types=(AxisType.Auto,) * len(shape))


def check_mesh(mesh: Mesh) -> Mesh:
  """The mesh with every axis AxisType.Auto (the engine relies on GSPMD propagation): a mesh
  from jax.make_mesh, whose axes are Explicit by default, is converted, not refused."""
  if not isinstance(mesh, Mesh):
    raise TypeError(f"expected a jax.sharding.Mesh, got {type(mesh).__name__}")
  if all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


@dataclasses.dataclass(frozen=True)
class Axes:
  """Logical axes -> axes of one mesh under one set of rules: what a pytree's
  `partition_specs(axes)` asks for its dimensions."""
  mesh: Mesh
  rules: ShardingRules

  def __call__(self, field: str, size: int, what: str) -> str | None:
    """The mesh axis for logical axis `field` (a ShardingRules field) of a dimension of `size`,
    or None (replicated). Raises ValueError when the axis size does not divide `size`."""
    name = getattr(self.rules, field)
    if name is None or name not in self.mesh.shape:
      return None
    if size % self.mesh.shape[name]:
      raise ValueError(f"{what} ({size}) is not divisible by mesh axis {name!r} of size "
                       f"{self.mesh.shape[name]}; use a mesh that divides it, or "
                       f"ShardingRules({field}=None) to replicate it")
    return name

  def divides(self, field: str, size: int) -> bool:
    """Whether `size` can split over `field`'s mesh axis (True when it is not split at all)."""
    return size % self.size(field) == 0

  def size(self, field: str) -> int:
    """The size of `field`'s mesh axis (1 when it is not split)."""
    name = getattr(self.rules, field)
    return 1 if name is None or name not in self.mesh.shape else self.mesh.shape[name]


def specs(tree, mesh: Mesh, rules: ShardingRules | None = None):
  """PartitionSpecs for a Params, DrafterParams, LayerParams, KVCache or decode.DecodeState
  (arrays or ShapeDtypeStructs), same structure; None leaves stay None."""
  if not hasattr(tree, "partition_specs"):
    raise TypeError(f"no sharding layout for {type(tree).__name__}")
  return tree.partition_specs(Axes(mesh, rules or DEFAULT_RULES))


def shardings(tree, mesh: Mesh, rules: ShardingRules | None = None):
  """The NamedSharding pytree for `tree` (see `specs`)."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs(tree, mesh, rules),
                      is_leaf=lambda x: isinstance(x, P))


def shard_params(tree, mesh: Mesh | None, rules: ShardingRules | None = None):
  """Places params (target or drafter; their vocabulary padded: `pad_vocab`), a cache or a
  decode state on the mesh (None: as is)."""
  if mesh is None:
    return tree
  tree = pad_vocab(tree, mesh, rules)
  return jax.device_put(tree, shardings(tree, check_mesh(mesh), rules))


def pad_vocab(tree, mesh: Mesh | None, rules: ShardingRules | None = None):
  """Params (target or drafter; device arrays or host views) whose vocabulary the vocab axis
  does not divide, zero-padded to its next multiple (the pytree's `pad_vocab`: embedding rows
  and lm_head columns past V are zero, and the logits slice them off). Both placements call it:
  `shard_params` (device arrays) and `hf.load_target` / `load_drafter` (host tensors, padded
  lazily: a device still reads only its shard). Other trees, or no mesh: as they are."""
  if mesh is None or not hasattr(tree, "pad_vocab"):
    return tree
  multiple = Axes(check_mesh(mesh), rules or DEFAULT_RULES).size("vocab")
  return tree if multiple == 1 else tree.pad_vocab(multiple, _pad_to)


def _pad_to(x, axis: int, size: int):
  """x zero-padded to `size` along `axis`: on its devices for a jax.Array, else a lazy view of
  the host tensor (`_ZeroPadded`)."""
  if isinstance(x, jax.Array):
    return jnp.pad(x, [(0, size - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)])
  return _ZeroPadded(x, axis, size)


class _ZeroPadded:
  """A host tensor (numpy array or lazy view) zero-padded along `axis` to `size`, lazily: a shard
  reads only the tensor's part of it. Indexed as make_array_from_callback indexes: one
  contiguous slice per dimension."""

  def __init__(self, base, axis: int, size: int):
    self.base, self.axis = base, axis
    self.shape = tuple(base.shape[:axis]) + (size,) + tuple(base.shape[axis + 1:])
    self.dtype = base.dtype

  def __getitem__(self, idx):
    start, stop, _ = idx[self.axis].indices(self.shape[self.axis])
    n = self.base.shape[self.axis]
    inside = slice(min(start, n), min(stop, n))
    part = np.asarray(self.base[idx[:self.axis] + (inside,) + idx[self.axis + 1:]])
    widths = [(0, 0)] * part.ndim
    widths[self.axis] = (0, stop - start - part.shape[self.axis])
    return np.pad(part, widths)


def constrain(tree, mesh: Mesh | None, rules: ShardingRules | None = None):
  """with_sharding_constraint to the layout of `tree` inside jit; identity when mesh is None."""
  if mesh is None or tree is None:
    return tree
  return jax.lax.with_sharding_constraint(tree, shardings(tree, mesh, rules))


# --------------------------------------------------------------------------------------------
# Engine inputs and outputs


def batch_multiple(mesh: Mesh | None, rules: ShardingRules | None = None) -> int:
  """The batch must be a multiple of this (the dp axis size; 1 without a mesh)."""
  name = (rules or DEFAULT_RULES).batch
  return 1 if mesh is None or name not in mesh.shape else mesh.shape[name]


def pad_batch(arrays, mesh: Mesh | None, rules: ShardingRules | None = None):
  """Pads numpy arrays [B, ...] to a batch multiple of dp by repeating row 0 (a real prompt, so
  the padding finishes with it); callers drop rows >= B from the results."""
  m = batch_multiple(mesh, rules)
  extra = -arrays[0].shape[0] % m
  if not extra:
    return tuple(arrays)
  return tuple(np.concatenate([a, np.repeat(a[:1], extra, axis=0)]) for a in arrays)


def put_batch(x: np.ndarray, mesh: Mesh | None, rules: ShardingRules | None = None):
  """Host array [B, ...] -> device array with B over dp (each process supplies its shards)."""
  if mesh is None:
    return jnp.asarray(x)
  bt = Axes(mesh, rules or DEFAULT_RULES)("batch", x.shape[0], "batch")
  sh = NamedSharding(mesh, P(bt, *[None] * (x.ndim - 1)))
  return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])


def replicate(x, mesh: Mesh | None):
  """A small array (e.g. a PRNG key) replicated over the mesh (every process passes the same)."""
  if mesh is None:
    return x
  sh = NamedSharding(mesh, P())
  if jax.process_count() == 1:
    return jax.device_put(x, sh)
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # multi-host: rebuild from key data
    data = np.asarray(jax.random.key_data(x))
    raw = jax.make_array_from_callback(data.shape, sh, lambda idx: data[idx])
    return jax.random.wrap_key_data(raw, impl=jax.random.key_impl(x))
  data = np.asarray(x)
  return jax.make_array_from_callback(data.shape, sh, lambda idx: data[idx])


def to_host(tree):
  """Device arrays -> numpy, gathering shards from every process when multi-host."""
  leaves = jax.tree.leaves(tree)
  if all(getattr(x, "is_fully_addressable", True) for x in leaves):
    return jax.device_get(tree)
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return multihost_utils.process_allgather(tree, tiled=True)


# --------------------------------------------------------------------------------------------
# Multi-host start and absl flags


def initialize_distributed(coordinator_address: str | None = None, num_processes: int = 1,
                           process_id: int = 0) -> None:
  """Multi-host entry: run on every process before any other JAX call.

  Calls `jax.distributed.initialize` only when num_processes > 1 (a single process needs
  nothing). Afterwards jax.devices() lists every host's devices, `make_mesh` spans them, and
  every process runs the same program (SPMD); `to_host` gathers results on each process.
  """
  if num_processes > 1:
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)


def define_mesh_flags() -> None:
  """absl flags --coordinator_address --num_processes --process_id --mesh_dp --mesh_tp
  --mesh_ep."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  if "mesh_tp" in flags.FLAGS:
    return
  flags.DEFINE_string("coordinator_address", None, "multi-host: host:port of process 0")
  flags.DEFINE_integer("num_processes", 1, "multi-host: number of processes")
  flags.DEFINE_integer("process_id", 0, "multi-host: index of this process")
  flags.DEFINE_integer("mesh_dp", 1, "data-parallel mesh axis size (batch)")
  flags.DEFINE_integer("mesh_tp", 1, "tensor-parallel mesh axis size (heads, MLP, vocab)")
  flags.DEFINE_integer("mesh_ep", 1, "expert-parallel mesh axis size (a MoE layer's experts)")


def mesh_from_flags() -> Mesh | None:
  """Initialises multi-host if asked, then the {"dp": mesh_dp, "tp": mesh_tp} mesh (and "ep":
  mesh_ep when > 1), or None for a single device (all 1 on one process)."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  f = flags.FLAGS
  initialize_distributed(f.coordinator_address, f.num_processes, f.process_id)
  if f.mesh_dp * f.mesh_tp * f.mesh_ep == 1 and f.num_processes == 1:
    return None
  shape = {"dp": f.mesh_dp, "tp": f.mesh_tp} | ({"ep": f.mesh_ep} if f.mesh_ep > 1 else {})
  return make_mesh(shape)


def define_layout_flag() -> None:
  """absl flag --mesh_layout (a name of LAYOUTS), for scripts that pass `rules_from_flags()` on
  to their params, caches and kernels (a script without it refuses the flag)."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  if "mesh_layout" not in flags.FLAGS:
    flags.DEFINE_enum("mesh_layout", "split", list(LAYOUTS), "sharding.LAYOUTS: split (heads and "
                      "MLP over tp) or replicated_attention (the MLP only: one all-reduce a layer)")


def rules_from_flags() -> ShardingRules:
  """The ShardingRules of --mesh_layout."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  return LAYOUTS[flags.FLAGS.mesh_layout]


__all__ = ["DEFAULT_RULES", "LAYOUTS", "ShardingRules", "batch_multiple", "check_mesh",
           "constrain", "define_layout_flag", "define_mesh_flags", "initialize_distributed",
           "make_mesh", "mesh_from_flags", "pad_batch", "pad_vocab", "put_batch", "replicate",
           "rules_from_flags", "shard_params", "shardings", "specs", "to_host"]
