"""The kernel switch: which implementation of each hot operation the model runs.

`Kernels(attention, mesh, rules, tuning)` is built once per configuration and handed to
`decoder.forward`, the drafter and the verify. It is compared and hashed by those four fields, so it
is a jit static argument: each configuration compiles its own program. It holds

  attend         the attention contract (`attention_lib.attend_xla`; Pallas `tree_attention`)
  attend_latent  latent attention (`mla.attend_latent`; Pallas `latent_attention`)
  project_qkv    q/k/v projections + q/k RMSNorm + RoPE (`attention_lib.project_norm_rope`; Pallas)
  residual_norm  the residual add + next RMSNorm after o and down (`ops.residual_norm`; Pallas)
  embed          the embedding lookup (`ops.embed_lookup`)
  moe            a MoE layer's router + experts (`moe.grouped`; on Pallas its expert GEMMs
                 `pallas.grouped_gemm`, decode steps pair by pair)
  moe_residual   a MoE block from its input norm to the next norm: moe, the shared experts'
                 output, the residual add and the RMSNorm (decode rows: `pallas.moe_decode`)
  vocab_top_k    the tree's top-k and logsumexp over the vocabulary (`topk.vocab_top_k`)
  delta_tree     a Gated DeltaNet layer's delta rule over a draft tree (`gated_deltanet.tree`;
                 Pallas `delta_tree`)

and, on a mesh, runs each per shard under `jax.shard_map` (a pallas_call cannot take sharded
operands; the vocab-split lookup needs one psum). `KernelTuning` (pallas/tuning.py) holds every
tuning default of the Pallas kernels. Each kernel imports only its reference and the tuning, never
this switch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ddtree_jax import sharding
from ddtree_jax.models import attention as attention_lib
from ddtree_jax.models import gated_deltanet, mla, moe as moe_lib, quant
from ddtree_jax.models.ops import dense, embed_lookup, residual_norm, rms_norm
from ddtree_jax.pallas import (add_rms_norm, delta_tree, latent_attention, moe_decode, moe_ops,
                               qk_norm_rope)
from ddtree_jax.pallas.tree_attention import tree_attention
from ddtree_jax.pallas.tuning import KernelTuning
from ddtree_jax.speculative import topk

ATTENTIONS = ("xla", "pallas")



@dataclasses.dataclass(frozen=True)
class Kernels:
  """The implementations of attention, q/k/v projection + norm + RoPE, residual + norm and the
  embedding lookup for one (attention, mesh, rules, tuning)."""
  attention: str = "xla"          # "pallas": the Pallas tree attention, q/k and residual kernels
  mesh: Any = None                # jax.sharding.Mesh: every kernel per shard
  rules: Any = None               # sharding.ShardingRules (None: the defaults)
  tuning: KernelTuning = KernelTuning()

  def __post_init__(self):
    if self.attention not in ATTENTIONS:
      raise ValueError(f"unknown attention {self.attention!r}; choose one of {ATTENTIONS}")

  @functools.cached_property
  def attend(self) -> Callable:
    """q, k_cache, v_cache, prefix_len, k_new, v_new, new_mask, *, scale, layer -> [B, T, N, D]."""
    fn = attention_lib.attend_xla
    if self.attention == "pallas":
      fn = functools.partial(tree_attention, tuning=self.tuning)
    return fn if self.mesh is None else shard_attention(fn, self.mesh, self._rules)

  @functools.cached_property
  def attend_latent(self) -> Callable:
    """q [B, T, N, C + R], latent cache, prefix_len, new rows, new_mask, *, scale, value_dim,
    layer -> [B, T, N, value_dim] (`mla.attend_latent`'s contract). XLA's form (on a mesh GSPMD
    splits the heads, the latent replicated), or with tuning.latent_pallas on one device the
    Pallas kernel where the widths allow it and tuning.use_latent_pallas says."""
    if self.attention != "pallas" or self.mesh is not None or not self.tuning.latent_pallas:
      return mla.attend_latent
    tuning = self.tuning

    def attend(q, cache, prefix_len, new, new_mask, *, scale, value_dim, layer=None):
      c, r = value_dim, q.shape[-1] - value_dim
      if (c != latent_attention.pow2(c) or r != latent_attention.pow2(r) or min(c, r) < 16
          or not tuning.use_latent_pallas(q.shape[1], q.shape[2], cache.shape[-2])):
        return mla.attend_latent(q, cache, prefix_len, new, new_mask, scale=scale,
                                 value_dim=value_dim, layer=layer)
      splits = max(1, min(tuning.latent_max_splits, cache.shape[-2] // tuning.latent_split_rows))
      block_q, block_k, warps, stages = tuning.latent_launch
      return latent_attention.latent_attention(
          q, cache, prefix_len, new, new_mask, scale=scale, value_dim=value_dim, layer=layer,
          num_splits=splits, block_q=block_q, block_k=block_k, num_warps=warps,
          num_stages=stages, interpret=tuning.interpret)
    return attend

  @functools.cached_property
  def project_qkv(self) -> Callable:
    """layer, h [B, T, H], cos, sin, *, eps -> q [B, T, N, D], k, v [B, T, K, D] (q, k normed
    and RoPE'd). Pallas on a mesh: XLA's projections, then the q/k kernel per shard."""
    if self.attention != "pallas":
      return attention_lib.project_norm_rope
    if self.mesh is None:
      return functools.partial(qk_norm_rope.project_qk_norm_rope, tuning=self.tuning)
    return shard_qk_norm_rope(functools.partial(qk_norm_rope.qk_norm_rope,
                                                interpret=self.tuning.interpret),
                              self.mesh, self._rules)

  @functools.cached_property
  def residual_norm(self) -> Callable:
    """x, spec, a, w, norm, *, eps -> (x + dense(spec, a, w), its RMSNorm). The Pallas kernel on
    one device only: on a mesh o and down are split over their contracted dim."""
    if self.attention != "pallas" or self.mesh is not None:
      return residual_norm
    return functools.partial(add_rms_norm.residual_norm, tuning=self.tuning)

  @functools.cached_property
  def embed(self) -> Callable:
    """table [V, H], tokens [...] -> [..., H]."""
    return embed_lookup if self.mesh is None else shard_embed_lookup(self.mesh, self._rules)

  @functools.cached_property
  def moe(self) -> Callable:
    """params, x [R, H], *, routing (`moe.Routing`) -> [R, H]: the router and the dropless
    mixture of experts. On Pallas a step of few pairs runs the decode kernels (the router, then
    the top-k inside the gate/up kernel, down and combine: `pallas.moe_decode`), others the
    expert GEMMs over the sorted pairs (`moe.grouped`), with the pair kernels (`moe.pairs`)
    between where the tuning says. On a mesh per shard: each device runs its experts (and its
    slice of their width) for every row, and one psum adds the shards."""
    if self.attention != "pallas":
      experts = lambda params, x, weights, chosen, routing: moe_lib.grouped(params, x, weights,
                                                                             chosen)
      decode = lambda params, x, routing, weights=None, chosen=None: None
    else:
      tuning = self.tuning
      grouped = functools.partial(moe_lib.grouped, ops=moe_ops.expert_ops(tuning))
      by_pair = functools.partial(moe_lib.pairs, ops=moe_ops.pair_ops(tuning))
      decode = self._moe_decode

      def experts(params, x, weights, chosen, routing):
        y = decode(params, x, routing, weights, chosen)
        if y is not None:
          return y
        most = (tuning.moe_quant_pair_max if quant.is_quantized(params.w_gate_up)
                else tuning.moe_pair_max)
        return (by_pair if chosen.size <= most else grouped)(params, x, weights, chosen)
    if self.mesh is not None:
      return shard_moe(experts, self.mesh, self._rules)

    def mixture(params, x, *, routing):
      y = decode(params, x, routing)  # (routed inside the kernels)
      if y is not None:
        return y
      weights, chosen = moe_lib.route(params, x, routing)
      return experts(params, x, weights, chosen, routing)
    return mixture

  @functools.cached_property
  def moe_residual(self) -> Callable:
    """params, x [R, H] the residual, h [R, H] its RMSNorm, shared [R, H] or None (the shared
    experts' output), norm [H], *, routing, eps -> (x', rms_norm(x', norm)) with x' = x +
    (moe(h) + shared): a MoE block after its input norm. At decode rows on one device the Pallas
    decode kernels end in one combine + residual + norm launch; elsewhere `moe`, then XLA's add
    and norm."""
    def block(params, x, h, shared, norm, *, routing, eps):
      if self.attention == "pallas" and self.mesh is None:
        out = self._moe_decode(params, h, routing, residual=x, norm=norm, shared=shared,
                               eps=eps)
        if out is not None:
          return out
      y = self.moe(params, h, routing=routing)
      if shared is not None:
        y = y + shared
      x = x + y.astype(x.dtype)
      return x, rms_norm(x, norm, eps)
    return block

  def _moe_decode(self, params, x, routing, weights=None, chosen=None, **residual):
    """`moe_decode.moe_decode` at the tuning's launch where it takes the step (few pairs, stacks
    it takes), else None."""
    tuning = self.tuning
    quantized = quant.is_quantized(params.w_gate_up)
    most = tuning.moe_decode_quant_max if quantized else tuning.moe_decode_max
    pairs = x.shape[0] * routing.top_k
    # (gpt-oss's biased, clamped experts are not plain: XLA's stages, `moe.grouped`)
    if pairs > most or not params.plain or not moe_decode.supported(params, x.dtype):
      return None
    return moe_decode.moe_decode(params, x, routing, weights, chosen,
                                 **moe_decode.launch(tuning, params, pairs, x.shape[1]),
                                 **residual)

  @functools.cached_property
  def delta_tree(self) -> Callable:
    """q, k [N, Hv, dk], v [N, Hv, dv], g, beta [N, Hv], state [Hv, dk, dv], ancestors [N, N] ->
    (o, delta, G): `gated_deltanet.tree`'s contract, vmapped over rows by the layer. The Pallas
    kernel on one device where its widths allow (`delta_tree.supported`) and the tree has at
    most tuning.delta_tree_max_nodes nodes; on a mesh XLA's form, which GSPMD splits over the
    key-head groups."""
    if self.attention != "pallas" or self.mesh is not None:
      return gated_deltanet.tree
    block_v, warps = self.tuning.delta_tree_launch
    interpret, most = self.tuning.interpret, self.tuning.delta_tree_max_nodes

    def rule(q, k, v, g, beta, state, ancestors):
      if k.shape[0] > most or not delta_tree.supported(k.shape[0], v.shape[-1], block_v):
        return gated_deltanet.tree(q, k, v, g, beta, state, ancestors)
      return delta_tree.delta_tree(q, k, v, g, beta, state, ancestors, block_v=block_v,
                                   num_warps=warps, interpret=interpret)
    return rule

  @functools.cached_property
  def vocab_top_k(self) -> Callable:
    """Draft logits [B, L, V], k -> the tree's top-k values and ids [B, L, k] and logsumexp
    [B, L, 1] (`topk.vocab_top_k`); on a mesh per vocab shard (`shard_vocab_top_k`)."""
    return topk.vocab_top_k if self.mesh is None else shard_vocab_top_k(self.mesh, self._rules)

  @functools.cached_property
  def outside_verify(self) -> Kernels:
    """The kernels of the prefill and the drafter: these, with XLA's residual add + RMSNorm
    (the residual kernel's rule was fitted to the verify)."""
    return dataclasses.replace(self, tuning=dataclasses.replace(self.tuning,
                                                                residual_rows=(1, 0)))

  @property
  def _rules(self):
    return _rules_or_default(self.rules)


REFERENCE = Kernels()  # plain XLA on one device: the reference every kernel is tested against


# --------------------------------------------------------------------------------------------
# Kernels per shard


def _rules_or_default(rules):
  return rules or sharding.DEFAULT_RULES


def _head_axes(mesh, rules, b: int, hq: int, hkv: int):
  """The mesh axes (or None) that split the batch, the query heads and the kv heads of per-shard
  kernels: each rule's axis where it divides, kv heads only when split with the query heads."""
  size = lambda name: mesh.shape[name] if name in mesh.shape else 1
  bt = rules.batch if rules.batch in mesh.shape and b % size(rules.batch) == 0 else None
  hd = rules.heads if rules.heads in mesh.shape and hq % size(rules.heads) == 0 else None
  kv = hd if hd is not None and rules.kv_heads == hd and hkv % size(hd) == 0 else None
  return bt, hd, kv


def shard_attention(attn_fn: Callable, mesh, rules=None) -> Callable:
  """An attention with the `attention_lib.attend_xla` contract, run per shard in shard_map.

  Batch over dp (when it divides), query heads q [B, T, N, D] on N and caches [B, K, S, D] (or
  [L, B, K, S, D] with `layer`) / new rows [B, T, K, D] on K over tp; prefix_len [B] and new_mask
  [B, T, T] on B only. Attention is independent per (sequence, kv head): no communication. With
  replicated kv heads (rules.kv_heads None) each device slices out the kv heads of its own query
  heads; where no clean split exists every head is computed on every device (correct, slower).
  """
  rules = _rules_or_default(rules)

  def wrapped(q, k_cache, v_cache, prefix_len, k_new, v_new, new_mask, *, scale, **kw):
    b, hq, hkv = q.shape[0], q.shape[2], k_cache.shape[-3]
    lead = (None,) * (k_cache.ndim - 4)  # the layer axis of stacked caches
    size = lambda name: mesh.shape[name] if name in mesh.shape else 1
    bt, hd, kv = _head_axes(mesh, rules, b, hq, hkv)
    g = hq // hkv
    n_loc = hq // size(hd) if hd else hq
    if hd is not None and kv is None and n_loc % g and g % n_loc:
      hd = None  # a query-head shard would straddle kv groups: every head on every device
      n_loc = hq
    kv_loc = max(1, n_loc // g)

    def local(q, kc, vc, plen, kn, vn, mask):
      if hd is not None and kv is None:  # replicated kv heads: keep those of the local q heads
        start = jax.lax.axis_index(hd) * n_loc // g
        take = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, start, kv_loc, axis)
        kc, vc, kn, vn = take(kc, kc.ndim - 3), take(vc, vc.ndim - 3), take(kn, 2), take(vn, 2)
      return attn_fn(q, kc, vc, plen, kn, vn, mask, scale=scale, **kw)

    q_spec, c_spec = P(bt, None, hd, None), P(*lead, bt, kv, None, None)
    n_spec = P(bt, None, kv, None)
    return jax.shard_map(local, mesh=mesh, out_specs=q_spec, check_vma=False,
                         in_specs=(q_spec, c_spec, c_spec, P(bt), n_spec, n_spec,
                                   P(bt, None, None)))(
        q, k_cache, v_cache, prefix_len, k_new, v_new, new_mask)

  return wrapped


def shard_qk_norm_rope(qk_fn: Callable, mesh, rules=None) -> Callable:
  """`project_qkv` on a mesh: the projections as GSPMD partitions them, then `qk_fn` (a q/k norm +
  RoPE with the `attention.norm_rope` contract) per shard: q [B, T, N, D] split on N, kv
  [B, T, 2, K, D] on K (when kv heads split with the q heads, else whole on every device), and
  everything with cos/sin [B, T, D] on B over dp when it divides. No communication."""
  rules = _rules_or_default(rules)

  def wrapped(layer, h, cos, sin, *, eps):
    if layer.wqkv is not None:
      raise ValueError("fused q/k/v weights (decoder.fuse_qkv) are for one device only: on a "
                       "mesh use unfused params (load_target(..., fuse_qkv=False))")
    q = dense("bth,hnd->btnd", h, layer.wq)
    kv = dense("bth,hskd->btskd", h, layer.wkv)
    q_norm, k_norm = layer.q_norm, layer.k_norm
    bt, hd, kv_ax = _head_axes(mesh, rules, q.shape[0], q.shape[2], kv.shape[3])
    local = lambda *a: qk_fn(*a, eps=eps)
    norm = lambda w: None if w is None else P()
    q_spec, k_spec, rows = P(bt, None, hd, None), P(bt, None, kv_ax, None), P(bt, None, None)
    return jax.shard_map(local, mesh=mesh, out_specs=(q_spec, k_spec, k_spec), check_vma=False,
                         in_specs=(q_spec, P(bt, None, None, kv_ax, None), norm(q_norm),
                                   norm(k_norm), rows, rows))(
        q, kv, q_norm, k_norm, cos, sin)

  return wrapped


def shard_moe(experts: Callable, mesh, rules=None) -> Callable:
  """A MoE layer per shard (experts: (params, x, weights, chosen, routing) -> [R, H]): experts
  [E, ...] split over rules.experts and their width I over rules.mlp (where those divide);
  rows and the router replicated (rows over dp when it divides). Each device routes every row
  (the same choice everywhere), runs the pairs that fall on its experts (the others are
  elsewhere) and one psum adds the shards' outputs."""
  rules = _rules_or_default(rules)

  def wrapped(params, x, *, routing):
    size = lambda name: mesh.shape[name] if name in mesh.shape else 1
    e = params.w_gate_up.shape[0]
    widths = quant.split_sizes(params.w_gate_up, 3) + quant.split_sizes(params.w_down, 1)
    ep = rules.experts if rules.experts in mesh.shape and e % size(rules.experts) == 0 else None
    mp = (rules.mlp if rules.mlp in mesh.shape and all(w % size(rules.mlp) == 0 for w in widths)
          else None)
    bt = rules.batch if (rules.batch in mesh.shape and rules.batch not in (ep, mp)
                         and x.shape[0] % size(rules.batch) == 0) else None
    summed = tuple(a for a in (ep, mp) if a is not None)

    def local(p, x):
      weights, chosen = moe_lib.route(p, x, routing)
      if ep is not None:  # this shard's experts: [first, first + E_loc)
        e_loc = p.w_gate_up.shape[0]
        first = jax.lax.axis_index(ep) * e_loc
        mine = (chosen >= first) & (chosen < first + e_loc)
        chosen = jnp.where(mine, chosen - first, e_loc)
      y = experts(p, x, weights, chosen, routing)
      return jax.lax.psum(y, summed) if summed else y

    return jax.shard_map(local, mesh=mesh, check_vma=False,
                         in_specs=(params.specs(ep, mp), P(bt, None)),
                         out_specs=P(bt, None))(params, x)

  return wrapped


def shard_embed_lookup(mesh, rules=None) -> Callable:
  """`ops.embed_lookup` for a vocab-split table [V, H], per shard: each device looks up the ids
  in its slice of V (zero rows elsewhere) and a psum adds the slices, one all-reduce of [..., H]
  (left to GSPMD, the whole table was all-gathered every step:
  docs/findings/tensor-parallelism.md). Token ids [B, ...] keep their batch split over dp when
  it divides. A padded table (`sharding.pad_vocab`) splits like any other: ids are < V, so its
  padding rows are never read."""
  rules = _rules_or_default(rules)

  def lookup(table, tokens):
    size = lambda name: mesh.shape[name] if name in mesh.shape else 1
    voc = rules.vocab if rules.vocab in mesh.shape and table.shape[0] % size(rules.vocab) == 0 \
        else None
    if voc is None:
      return table[tokens]
    bt = rules.batch if (rules.batch in mesh.shape and rules.batch != voc
                         and tokens.shape[0] % size(rules.batch) == 0) else None
    rest = (None,) * (tokens.ndim - 1)

    def local(tab, tok):
      n = tab.shape[0]
      idx = tok - jax.lax.axis_index(voc) * n
      mine = (idx >= 0) & (idx < n)
      rows = jnp.where(mine[..., None], tab[jnp.clip(idx, 0, n - 1)], jnp.zeros((), tab.dtype))
      return jax.lax.psum(rows, voc)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(voc, None), P(bt, *rest)),
                         out_specs=P(bt, *rest, None), check_vma=False)(table, tokens)

  return lookup


def shard_vocab_top_k(mesh, rules=None) -> Callable:
  """`topk.vocab_top_k` for vocab-split logits [B, L, V], per shard: each device takes the top k
  of its slice of V (global ids) and its slice's max and sum of exp, one all-gather brings every
  shard's, and each device merges them: the top k of the tp * k candidates (laid out by shard,
  so ties still go to the lower id: exactly lax.top_k's values and ids) and the logsumexp.
  Left to GSPMD the tree's chunked top-k took 4 collectives, and where the chunk count did not
  divide by tp it gathered the logits first (experiments/perf/collectives.py). A V that tp does
  not divide (the logits of a padded vocabulary, `decoder.lm_head`) is padded back to the next
  multiple, and no padding id is ever picked."""
  rules = _rules_or_default(rules)

  def top(logits, k):
    size = lambda name: mesh.shape[name] if name in mesh.shape else 1
    voc = rules.vocab if rules.vocab in mesh.shape else None
    extra = -logits.shape[-1] % size(voc) if voc else 0
    if voc is None or (logits.shape[-1] + extra) // size(voc) < k:
      return topk.vocab_top_k(logits, k)
    # Padding on the last shard, in lm_head's own shard boundaries (its padded width). The
    # lowest float32, not -inf: it loses every comparison with a logit (ties go to the lower,
    # real id) and its exp is 0 in the logsumexp, and a shard of padding alone has a finite max
    # (with -inf its sum of exp would be NaN). k <= V, so k real candidates always beat it.
    if extra:
      logits = jnp.pad(logits.astype(jnp.float32), [(0, 0)] * (logits.ndim - 1) + [(0, extra)],
                       constant_values=jnp.finfo(jnp.float32).min)
    bt = rules.batch if (rules.batch in mesh.shape and rules.batch != voc
                         and logits.shape[0] % size(rules.batch) == 0) else None

    def local(x):
      x = x.astype(jnp.float32)
      vals, ids = topk.top_k(x, k)
      ids = ids + jax.lax.axis_index(voc) * x.shape[-1]
      m = jnp.max(x, axis=-1, keepdims=True)
      s = jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True)
      packed = jnp.concatenate([vals, jax.lax.bitcast_convert_type(ids, jnp.float32), m, s], -1)
      allp = jax.lax.all_gather(packed, voc, axis=x.ndim - 1)  # [B, L, tp, 2k + 2]
      cand = allp[..., :k].reshape(x.shape[:-1] + (-1,))      # by shard: ties to the lower id
      cand_ids = jax.lax.bitcast_convert_type(allp[..., k:2 * k], jnp.int32).reshape(cand.shape)
      vals, pos = jax.lax.top_k(cand, k)
      ms, ss = allp[..., 2 * k], allp[..., 2 * k + 1]
      mx = jnp.max(ms, axis=-1, keepdims=True)
      lse = mx + jnp.log(jnp.sum(ss * jnp.exp(ms - mx), axis=-1, keepdims=True))
      return vals, jnp.take_along_axis(cand_ids, pos, axis=-1), lse

    spec = P(bt, None, None)
    return jax.shard_map(local, mesh=mesh, in_specs=P(bt, None, voc), out_specs=(spec,) * 3,
                         check_vma=False)(logits)

  return top
