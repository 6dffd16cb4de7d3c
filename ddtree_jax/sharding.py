"""Tensor parallelism (and data parallelism over the batch) on a device mesh.

Mesh axes: "tp" splits heads, MLP width and vocab; optional "dp" splits the batch and "ep" a MoE
layer's experts (its expert width also over "tp"). A
`ShardingRules` maps the logical axes to mesh axes; the functions below turn a params / cache /
decode-state pytree into a matching pytree of NamedShardings. Layouts (model.py, drafter.py):

  wq [H, N, D] split N     wkv [H, 2, K, D] split K    wo [N, D, H] split N (row parallel:
  w_gate_up [H, 2, I] split I    w_down [I, H] split I      XLA inserts the all-reduce)
  embed [V, H], lm_head [H, V] split V (argmax/top-k still return global ids)
  norms, q_norm, k_norm replicated; drafter fc [k*H, H] split on its output columns when its
  kv heads split (replicated when they are)
  an int8 drafter's Int8Weight: q (K-major) and scale split like the float weight's dims
  (its stacked context_wkv [H, L, 2, K, D] split K); a drafter's own lm_head [H, V or Vd] split
  like the target's (replicated when a draft vocabulary's Vd is not divisible), draft_vocab
  replicated
  MoE experts w_gate_up [E, H, 2, I], w_down [E, I, H]: E over ep, I over tp; router replicated
  KV cache [L, B, K, S, D]: B over dp, K over tp; per-sequence decode state over dp

Everything else is GSPMD: params and caches carry NamedShardings and jit propagates them. The
kernels (attention, the Pallas q/k norm + RoPE, the embedding lookup) run per shard inside
`jax.shard_map`: `kernels.Kernels` with a mesh wraps them (`kernels.shard_attention`, ...).

Indivisible dimensions: a dimension mapped to a mesh axis must divide by the axis size, else a
ValueError names it; nothing is padded or sharded unevenly. Set that rule to None to replicate
the dimension instead. In particular `ShardingRules(kv_heads=None)` replicates the K/V
projections and caches over tp (each device holds every kv head, the usual fix when kv heads <
tp); `kernels.shard_attention` then hands each device only the kv heads its own query heads use.

Multi-host: call `initialize_distributed` (or `mesh_from_flags`) on every process first; the
mesh then spans all hosts' devices and the same code runs on each process.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from ddtree_jax.drafter import DrafterParams
from ddtree_jax.model import Int8Weight, KVCache, LayerParams, Params
from ddtree_jax.mla import MLAParams
from ddtree_jax.moe import MoEParams


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

  def __post_init__(self):
    if self.kv_heads is not None and self.kv_heads != self.heads:
      raise ValueError(f"kv_heads={self.kv_heads!r} must be sharded like heads={self.heads!r} "
                       "(or replicated: kv_heads=None)")


DEFAULT_RULES = ShardingRules()

# Named layouts (`--mesh_layout`, `rules_from_flags`). "split": every layer's heads and MLP width
# over tp, two all-reduces per layer. "replicated_attention": attention weights and KV caches
# whole on every device, only the MLP (and the vocab) split: one all-reduce per layer, for small
# batches, where a collective's latency costs more than reading the attention weights.
LAYOUTS = {"split": DEFAULT_RULES,
           "replicated_attention": ShardingRules(heads=None, kv_heads=None)}


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


def _axis(mesh: Mesh, rules: ShardingRules, field: str, size: int, what: str):
  """The mesh axis for logical axis `field` of a dimension of `size`, or None (replicated).
  Raises ValueError when the axis size does not divide `size`."""
  name = getattr(rules, field)
  if name is None or name not in mesh.shape:
    return None
  if size % mesh.shape[name]:
    raise ValueError(f"{what} ({size}) is not divisible by mesh axis {name!r} of size "
                     f"{mesh.shape[name]}; use a mesh that divides it, or "
                     f"ShardingRules({field}=None) to replicate it")
  return name


# --------------------------------------------------------------------------------------------
# PartitionSpec pytrees


def _w(w, *spec):
  """The spec of a weight [in..., out...]; an Int8Weight's q [out..., in...] and scale [out...]
  take the same axes."""
  if isinstance(w, Int8Weight):
    n_in = len(spec) - w.scale.ndim
    return Int8Weight(q=P(*spec[n_in:], *spec[:n_in]), scale=P(*spec[n_in:]))
  return P(*spec)


def _mla_specs(p: MLAParams, mesh, rules) -> MLAParams:
  """Latent attention: heads over tp (q, W_UK, W_UV, o); the latent path replicated (the cache
  holds one latent row per token for all heads)."""
  hd = _axis(mesh, rules, "heads", p.w_uk.shape[1], "attention heads")
  opt = lambda x, *spec: None if x is None else P(*spec)
  return MLAParams(wq=opt(p.wq, None, hd, None), wq_a=opt(p.wq_a), q_a_norm=opt(p.q_a_norm),
                   wq_b=opt(p.wq_b, None, hd, None), wkv_a=P(), kv_a_norm=P(),
                   w_uk=P(None, hd, None), w_uv=P(None, hd, None), wo=P(hd, None, None))


def _layer_specs(layer: LayerParams, mesh, rules) -> LayerParams:
  if layer.wqkv is not None:
    raise ValueError("fused q/k/v weights (model.fuse_qkv) cannot be sharded: q and kv heads "
                     "split on their own axes; shard unfused params (checkpoint.load_target("
                     "..., fuse_qkv=False), or give load_target the mesh)")
  opt = lambda x: None if x is None else P()
  mlp = {}
  if layer.w_down is not None:  # the dense MLP, or DeepSeek's shared experts beside the experts
    ml = _axis(mesh, rules, "mlp", layer.w_down.shape[0], "intermediate_size")
    mlp = dict(w_gate_up=_w(layer.w_gate_up, None, None, ml), w_down=_w(layer.w_down, ml, None))
  if layer.moe is not None:
    e, _, _, i = layer.moe.w_gate_up.shape
    ep = _axis(mesh, rules, "experts", e, "num_experts")
    ml = _axis(mesh, rules, "mlp", i, "moe_intermediate_size")
    mlp = dict(dict(w_gate_up=None, w_down=None), **mlp, moe=MoEParams(
        router=P(), w_gate_up=P(ep, None, None, ml), w_down=P(ep, ml, None),
        bias=opt(layer.moe.bias)))
  if layer.mla is not None:
    return LayerParams(input_norm=P(), wq=None, wkv=None, wo=None, q_norm=None, k_norm=None,
                       post_norm=P(), mla=_mla_specs(layer.mla, mesh, rules), **mlp)
  hd = _axis(mesh, rules, "heads", layer.wq.shape[1], "query heads")
  kv = _axis(mesh, rules, "kv_heads", layer.wkv.shape[2], "kv heads")
  return LayerParams(input_norm=P(), wq=_w(layer.wq, None, hd, None),
                     wkv=_w(layer.wkv, None, None, kv, None), wo=_w(layer.wo, hd, None, None),
                     q_norm=opt(layer.q_norm), k_norm=opt(layer.k_norm), post_norm=P(), **mlp)


def _param_specs(params: Params, mesh, rules) -> Params:
  voc = _axis(mesh, rules, "vocab", params.embed.shape[0], "vocab_size")
  return Params(embed=P(voc, None), layers=[_layer_specs(l, mesh, rules) for l in params.layers],
                final_norm=P(), lm_head=None if params.lm_head is None else P(None, voc))


def _drafter_specs(params: DrafterParams, mesh, rules) -> DrafterParams:
  """As the target's, and fc split on its output columns only when the layers' kv heads split:
  its output feeds their k/v projections, and with those replicated a split fc output made GSPMD
  split the drafter's residual stream over H (12 collectives per drafter layer instead of 2 at
  the Qwen3-30B-A3B shape on tp=8: experiments/perf/collectives.py)."""
  fc = _axis(mesh, rules, "fc", params.fc.shape[1], "drafter fc output (hidden_size)")
  if _axis(mesh, rules, "kv_heads", params.layers[0].wkv.shape[2], "drafter kv heads") is None:
    fc = None
  head = params.lm_head
  if head is not None:
    vd, name = head.shape[1], rules.vocab
    if params.draft_vocab is not None and name in mesh.shape and vd % mesh.shape[name]:
      head = _w(head, None, None)  # a draft vocabulary the axis does not divide: replicated
    else:
      head = _w(head, None, _axis(mesh, rules, "vocab", vd, "drafter lm_head vocab"))
  ctx = params.context_wkv
  if ctx is not None:
    kv = _axis(mesh, rules, "kv_heads", ctx.shape[3], "drafter kv heads")
    ctx = _w(ctx, None, None, None, kv, None)
  return DrafterParams(fc=_w(params.fc, None, fc), hidden_norm=P(),
                       layers=[_layer_specs(l, mesh, rules) for l in params.layers],
                       final_norm=P(), lm_head=head, context_wkv=ctx,
                       draft_vocab=None if params.draft_vocab is None else P())


def _cache_specs(cache: KVCache, mesh, rules) -> KVCache:
  bt = _axis(mesh, rules, "batch", cache.lens.shape[0], "batch")
  latent = cache.v.shape[-1] == 0  # MLA: one latent row per token for all heads, replicated
  kv = None if latent else _axis(mesh, rules, "kv_heads", cache.k.shape[2], "kv heads")
  spec = P(None, bt, kv, None, None)  # [L, B, K, S, D]
  return KVCache(k=spec, v=spec, lens=P(bt))


# decode.DecodeState fields split over dp and the dimension that holds the batch; every other
# field (step, key, anything unknown) is replicated.
_STATE_BATCH_DIM = {"bonus": 0, "out": 0, "n_out": 0, "done": 0, "accepted": 1}


def _state_specs(state, mesh, rules):
  fields = {}
  for f in dataclasses.fields(state):
    x = getattr(state, f.name)
    if x is None or isinstance(x, KVCache):
      fields[f.name] = None if x is None else _cache_specs(x, mesh, rules)
    elif f.name in _STATE_BATCH_DIM:
      dim = _STATE_BATCH_DIM[f.name]
      spec = [None] * len(x.shape)
      spec[dim] = _axis(mesh, rules, "batch", x.shape[dim], "batch")
      fields[f.name] = P(*spec)
    else:
      fields[f.name] = jax.tree.map(lambda _: P(), x)
  return type(state)(**fields)


def specs(tree, mesh: Mesh, rules: ShardingRules | None = None):
  """PartitionSpecs for a Params, DrafterParams, LayerParams, KVCache or decode.DecodeState
  (arrays or ShapeDtypeStructs), same structure; None leaves stay None."""
  rules = rules or DEFAULT_RULES
  if isinstance(tree, Params):
    return _param_specs(tree, mesh, rules)
  if isinstance(tree, DrafterParams):
    return _drafter_specs(tree, mesh, rules)
  if isinstance(tree, LayerParams):
    return _layer_specs(tree, mesh, rules)
  if isinstance(tree, KVCache):
    return _cache_specs(tree, mesh, rules)
  if dataclasses.is_dataclass(tree) and hasattr(tree, "cache") and hasattr(tree, "bonus"):
    return _state_specs(tree, mesh, rules)
  raise TypeError(f"no sharding layout for {type(tree).__name__}")


def shardings(tree, mesh: Mesh, rules: ShardingRules | None = None):
  """The NamedSharding pytree for `tree` (see `specs`)."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs(tree, mesh, rules),
                      is_leaf=lambda x: isinstance(x, P))


def shard_params(tree, mesh: Mesh | None, rules: ShardingRules | None = None):
  """Places params (target or drafter), a cache or a decode state on the mesh (None: as is)."""
  if mesh is None:
    return tree
  return jax.device_put(tree, shardings(tree, check_mesh(mesh), rules))


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
  bt = _axis(mesh, rules or DEFAULT_RULES, "batch", x.shape[0], "batch")
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
           "make_mesh", "mesh_from_flags", "pad_batch", "put_batch", "replicate",
           "rules_from_flags", "shard_params", "shardings", "specs", "to_host"]
