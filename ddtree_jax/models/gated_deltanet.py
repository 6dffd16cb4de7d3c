"""The gated delta rule of Gated DeltaNet layers (Qwen3.5, Qwen3-Next): a recurrent state per
value head, S [H, dk, dv], updated per token t with decay g_t <= 0 and write strength beta_t:

  S_t = exp(g_t) S_{t-1} + k_t delta_t^T,   delta_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)
  o_t = S_t^T q_t

(q, k L2-normed and q scaled before; the HF reference `torch_recurrent_gated_delta_rule` in this
op order). `recurrent` is that loop, the reference of the tests.

A draft tree cannot keep one state per node cheaply (H x dk x dv floats each), and it need not:
along a root path the loop unrolls to

  S_j = exp(G_j) S_0 + sum_{l <= j} exp(G_j - G_l) k_l delta_l^T,   G_j = sum_{l <= j} g_l
  delta_j = beta_j (v_j - exp(G_j) S_0^T k_j - sum_{l < j} exp(G_j - G_l) (k_l . k_j) delta_l)

so the deltas solve (I + A) delta = beta (V - exp(G) K S_0) with A_jl = beta_j exp(G_j - G_l)
(k_j . k_l) for l before j on the path. `tree` replaces "before on the path" with "an ancestor
of": every node's delta and output are those of the loop along its own root path, all nodes at
once (nodes listed parents first, so A is strictly lower triangular: one triangular solve of N
rows per head, N^2 dk + N^2 dv multiply-adds, against N copies of the state for a per-node form).
`commit` builds the state after an accepted root path from the tree's own deltas (no recompute),
and `chunked` is prefill: chains of `chunk` tokens through the same solve, the state carried
from chunk to chunk.

The layer's causal depthwise convolution (kernel K over its q / k / v channels) sees, for a
node, the inputs along its own root path, continued into the committed window of the last K - 1
inputs: `tree_conv` walks each node's path back K - 1 steps through the parents, then the window;
`commit_window` keeps the last K - 1 inputs of the accepted path.

The layer around the rule (`GDNParams`): q / k / v from one projection through the convolution
and SiLU, q and k L2-normed (q also scaled by dk^-0.5) and repeated from the key heads to the
value heads (value head j reads key head j // r, r = Hv / Hk, transformers' repeat_interleave),
beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), then per value head an RMSNorm of the
output gated by silu(z), and the out projection. The convolved channels are kept group-major
(`group_channels`): per key head h its q, its k and the v of its r value heads, so that a slice
of key heads is a whole group and tensor parallelism splits the layer by groups. `prefill` runs
it over a prompt (chunked), `tree_forward` over a draft tree, `commit_tree` keeps the accepted
path's state and window. `block` / `commit_block` are the same over a batch, in the decoder's
terms (positions and a visibility mask, as attention gets; the accepted rows as `decoder.commit`
gets them).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

Array = jax.Array
F32 = jnp.float32


def recurrent(q, k, v, g, beta, state):
  """The token-by-token loop: q, k [T, H, dk], v [T, H, dv], g, beta [T, H], state [H, dk, dv]
  -> (o [T, H, dv], the state after the last token). Float32 throughout."""
  def step(s, x):
    qt, kt, vt, gt, bt = x
    s = s * jnp.exp(gt)[:, None, None]
    delta = (vt - jnp.einsum("hk,hkv->hv", kt, s)) * bt[:, None]
    s = s + kt[:, :, None] * delta[:, None, :]
    return s, jnp.einsum("hk,hkv->hv", qt, s)
  xs = tuple(a.astype(F32) for a in (q, k, v, g, beta))
  state, o = jax.lax.scan(step, state.astype(F32), xs)
  return o, state


def ancestors_of(parents):
  """parents [N] int (-1: a child of the committed state; each parent listed before its child)
  -> [N, N] bool, [j, l] true when l is j or one of its ancestors."""
  n = parents.shape[0]
  eye = jnp.eye(n, dtype=bool)
  up = (parents[:, None] == jnp.arange(n)[None, :])             # [j, parent(j)]

  def body(_, anc):  # one more generation: ancestors of my parent
    return anc | (up.astype(F32) @ anc.astype(F32) > 0)
  return jax.lax.fori_loop(0, n, body, eye)


def tree(q, k, v, g, beta, state, ancestors):
  """Every node of a tree at once: q, k [N, H, dk], v [N, H, dv], g, beta [N, H], state
  [H, dk, dv] (the committed one), ancestors [N, N] (`ancestors_of`) -> (o [N, H, dv], delta
  [N, H, dv], G [N, H]): node j's output and delta are the loop's along its root path; G is the
  summed decay of that path (what `commit` needs)."""
  q, k, v, g, beta, state = (a.astype(F32) for a in (q, k, v, g, beta, state))
  anc = ancestors.astype(F32)
  big_g = jnp.einsum("jl,lh->jh", anc, g)                          # [N, H]
  strict = ancestors & ~jnp.eye(anc.shape[0], dtype=bool)
  # exp(G_j - G_l) <= 1 for an ancestor l of j; other pairs are masked (and kept finite)
  decay = jnp.exp(jnp.where(ancestors[None], big_g.T[:, :, None] - big_g.T[:, None, :], 0.0))
  kk = jnp.einsum("jhd,lhd->hjl", k, k)
  a = jnp.where(strict[None], beta.T[:, :, None] * decay * kk, 0.0)
  rhs = beta[:, :, None] * (v - jnp.exp(big_g)[:, :, None] * jnp.einsum("jhd,hdv->jhv", k, state))
  eye = jnp.eye(anc.shape[0], dtype=F32)
  delta = jax.vmap(lambda m, b: jax.scipy.linalg.solve_triangular(m, b, lower=True,
                                                                  unit_diagonal=True),
                   in_axes=(0, 1), out_axes=1)(eye[None] + a, rhs)   # [N, H, dv]
  qk = jnp.where(ancestors[None], decay * jnp.einsum("jhd,lhd->hjl", q, k), 0.0)
  o = (jnp.exp(big_g)[:, :, None] * jnp.einsum("jhd,hdv->jhv", q, state)
       + jnp.einsum("hjl,lhv->jhv", qk, delta))
  return o, delta, big_g


def commit(state, k, delta, big_g, path, last):
  """The state after an accepted root path, from `tree`'s deltas (no recompute): state [H, dk,
  dv], k [N, H, dk], delta [N, H, dv], G [N, H], path [N] bool (the accepted nodes, a root
  path), last: its deepest node (-1: none accepted, the state unchanged) -> [H, dk, dv]."""
  g_last = jnp.where(last >= 0, big_g[jnp.maximum(last, 0)], 0.0)     # [H]
  w = jnp.where(path[:, None], jnp.exp(jnp.minimum(g_last[None, :] - big_g, 0.0)), 0.0)
  writes = jnp.einsum("nh,nhd,nhv->hdv", w, k.astype(F32), delta)
  return jnp.exp(g_last)[:, None, None] * state.astype(F32) + writes


def chunked(q, k, v, g, beta, state, chunk: int = 64):
  """Prefill: `recurrent`'s result (o [T, H, dv], final state) through `tree` on chains of
  `chunk` tokens, the state carried between chunks (T padded to a multiple with g = beta = 0
  tokens, which change nothing)."""
  t = q.shape[0]
  pad = -t % chunk
  padded = [jnp.pad(a.astype(F32), [(0, pad)] + [(0, 0)] * (a.ndim - 1))
            for a in (q, k, v, g, beta)]
  chain = jnp.tril(jnp.ones((chunk, chunk), bool))
  every = jnp.ones((chunk,), bool)

  def step(s, x):
    qc, kc, vc, gc, bc = x
    o, delta, big_g = tree(qc, kc, vc, gc, bc, s, chain)
    return commit(s, kc, delta, big_g, every, chunk - 1), o
  xs = tuple(a.reshape(-1, chunk, *a.shape[1:]) for a in padded)
  state, o = jax.lax.scan(step, state.astype(F32), xs)
  return o.reshape(-1, *o.shape[2:])[:t], state


def _step_back(pos, parents, w: int):
  """One input back along each path, in the rows of [window (w rows, newest last); nodes]: a
  node's parent, a root node's newest window row, a window row the one before it."""
  node = pos - w
  parent = parents[jnp.clip(node, 0, parents.shape[0] - 1)]
  return jnp.where(node >= 0, jnp.where(parent >= 0, parent + w, w - 1), pos - 1)


def tree_conv(x, parents, window, weight):
  """Causal depthwise convolution of every node over its root path: x [N, *C] the nodes' inputs
  (C any channel shape), parents [N] (-1: a child of the committed inputs), window [K-1, *C] the
  last committed inputs (newest last), weight [K, *C] (weight[K-1] multiplies the node's own
  input) -> [N, *C] float32, before the activation."""
  k, w = weight.shape[0], window.shape[0]
  if w != k - 1:
    raise ValueError(f"tree_conv: a window of {w} rows for a kernel of {k} (needs {k - 1})")
  rows = jnp.concatenate([window, x]).astype(F32)
  pos = jnp.arange(x.shape[0]) + w
  out = weight[k - 1].astype(F32) * rows[pos]
  for i in range(1, k):
    pos = _step_back(pos, parents, w)
    out = out + weight[k - 1 - i].astype(F32) * rows[pos]
  return out


def commit_window(window, x, parents, last):
  """The window after an accepted root path ending at node `last` (-1: none; the window kept):
  its last K - 1 inputs along the path, continued into the old window, newest last."""
  w = window.shape[0]
  rows = jnp.concatenate([window, x.astype(window.dtype)])
  pos = jnp.where(last >= 0, last + w, w - 1)
  picked = [pos]
  for _ in range(w - 1):
    pos = _step_back(pos, parents, w)
    picked.append(pos)
  return rows[jnp.stack(picked[::-1])]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GDNParams:
  """One Gated DeltaNet layer: Hk key heads of dk, Hv = r Hk value heads of dv, hidden H, kernel
  K; G = 2 dk + r dv channels per key-head group (`group_channels`)."""
  w_qkv: Array     # [H, Hk, G]: per group q_h | k_h | v of its r value heads (convolved)
  w_z: Array       # [H, Hv dv]: the output gate
  w_b: Array       # [H, Hv]: write strength, beta = sigmoid(b)
  w_a: Array       # [H, Hv]: decay input
  conv: Array      # [K, Hk, G]: conv[K-1] multiplies the newest input
  dt_bias: Array   # [Hv]
  a_log: Array     # [Hv]
  norm: Array      # [dv]: the gated RMSNorm's weight (1 is identity: not zero-centred)
  w_out: Array     # [Hv dv, H]

  def partition_specs(self, axes) -> GDNParams:
    """Key-head groups over tp (`linear_heads`): w_qkv and conv on Hk, the per-value-head weights
    on Hv (a group's value heads are contiguous), w_out row parallel (XLA adds the all-reduce, as
    after attention's wo); norm replicated."""
    g = axes("linear_heads", self.w_qkv.shape[1], "Gated DeltaNet key heads")
    return GDNParams(w_qkv=P(None, g, None), w_z=P(None, g), w_b=P(None, g), w_a=P(None, g),
                     conv=P(None, g, None), dt_bias=P(g), a_log=P(g), norm=P(), w_out=P(g, None))


@dataclasses.dataclass(frozen=True)
class GDNDims:
  """A Gated DeltaNet layer's widths (hashable: static)."""
  key_heads: int
  value_heads: int
  key_dim: int
  value_dim: int
  eps: float = 1e-6     # the gated RMSNorm's (the L2 norm's is 1e-6 always)
  conv_kernel: int = 4  # K: the window holds the last K - 1 inputs

  @property
  def conv_dim(self) -> int:
    """C = Hk G, the convolved channels."""
    return self.key_heads * self.group_dim

  @property
  def group_dim(self) -> int:
    """G = 2 dk + r dv, one key-head group's channels: its q, its k, its r value heads' v."""
    return 2 * self.key_dim + self.value_heads // self.key_heads * self.value_dim


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pending:
  """What a verified tree leaves for `commit_tree`: the nodes' convolution inputs [N, Hk, G], keys
  [N, Hv, dk] (normed), deltas [N, Hv, dv], summed decays G [N, Hv] and parents [N]."""
  inputs: Array
  k: Array
  delta: Array
  big_g: Array
  parents: Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Prefilled:
  """What a prompt leaves: the state [Hv, dk, dv] and window [K-1, Hk, G] after its last token."""
  state: Array
  window: Array


def _l2norm(x):
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _rule_inputs(p: GDNParams, d: GDNDims, x, conv_out):
  """(q, k [N, Hv, dk], v [N, Hv, dv], g, beta [N, Hv]) float32 from the convolved channels
  [N, Hk, G]."""
  dk = d.key_dim
  act = jax.nn.silu(conv_out).astype(x.dtype).astype(F32)
  heads = lambda a: jnp.repeat(a, d.value_heads // d.key_heads, axis=1)
  q = _l2norm(heads(act[..., :dk])) * dk ** -0.5
  k = _l2norm(heads(act[..., dk:2 * dk]))
  v = act[..., 2 * dk:].reshape(act.shape[0], d.value_heads, d.value_dim)
  beta = jax.nn.sigmoid(x @ p.w_b).astype(F32)
  g = -jnp.exp(p.a_log.astype(F32)) * jax.nn.softplus((x @ p.w_a).astype(F32)
                                                     + p.dt_bias.astype(F32))
  return q, k, v, g, beta


def _output(p: GDNParams, d: GDNDims, x, o):
  """o [N, Hv, dv] float32 -> RMSNorm per head, times silu(z), out projection: [N, H]."""
  z = (x @ p.w_z).reshape(o.shape).astype(F32)
  normed = (o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + d.eps)).astype(x.dtype)
  y = (p.norm * normed).astype(F32) * jax.nn.silu(z)
  return y.astype(x.dtype).reshape(x.shape[0], -1) @ p.w_out


def prefill(p: GDNParams, d: GDNDims, x, state, window, valid=None, chunk: int = 64):
  """A prompt x [T, H] after the committed (state [Hv, dk, dv], window [K-1, Hk, G]) -> (y [T, H],
  state, window). valid [T] bool (right padding false): the state and window are those after
  the last valid token (padding gets g = beta = 0, which leaves the state as it is)."""
  t = x.shape[0]
  chain = jnp.arange(t) - 1
  inputs = jnp.einsum("th,hgc->tgc", x, p.w_qkv)
  q, k, v, g, beta = _rule_inputs(p, d, x, tree_conv(inputs, chain, window, p.conv))
  last = t - 1
  if valid is not None:
    g, beta = (jnp.where(valid[:, None], a, 0.0) for a in (g, beta))
    last = jnp.sum(valid) - 1
  o, state = chunked(q, k, v, g, beta, state, chunk)
  return _output(p, d, x, o), state, commit_window(window, inputs, chain, last)


def tree_forward(p: GDNParams, d: GDNDims, x, parents, state, window, ancestors=None, rule=tree):
  """Draft-tree nodes x [N, H] (parents [N], parents first; -1 hangs off the committed state;
  ancestors [N, N] = `ancestors_of(parents)` when known) -> (y [N, H], Pending): each node's
  output is the layer's along its own root path. rule: `tree` or a kernel of its contract."""
  inputs = jnp.einsum("th,hgc->tgc", x, p.w_qkv)
  q, k, v, g, beta = _rule_inputs(p, d, x, tree_conv(inputs, parents, window, p.conv))
  anc = ancestors_of(parents) if ancestors is None else ancestors
  o, delta, big_g = rule(q, k, v, g, beta, state, anc)
  return _output(p, d, x, o), Pending(inputs, k, delta, big_g, parents)


def commit_tree(state, window, pending: Pending, path, last):
  """(state, window) after the accepted root path (path [N] bool, its deepest node `last`; -1:
  none) of a verified tree, from its Pending: no node is recomputed."""
  return (commit(state, pending.k, pending.delta, pending.big_g, path, last),
          commit_window(window, pending.inputs, pending.parents, last))


def parents_of(positions, visible):
  """positions [N], visible [N, N] (ancestor-or-self, as attention's mask) -> parents [N]: the
  visible node one position back (-1: none, the node continues the committed state)."""
  back = visible & (positions[None, :] == positions[:, None] - 1)
  return jnp.where(jnp.any(back, axis=1), jnp.argmax(back, axis=1), -1).astype(jnp.int32)


def block(p: GDNParams, d: GDNDims, x, positions, visible, state, window, chain: bool,
          chunk: int = 64, rule=tree):
  """The layer over a batch: x [B, T, H], positions [B, T], visible [B, T, T] (a causal mask with
  padding when `chain`, a draft tree's ancestor-or-self visibility otherwise), the committed
  state [B, Hv, dk, dv] and window [B, K-1, Hk, G] -> (y [B, T, H], Prefilled (chain: a prompt,
  chunked) or Pending (a tree) per row). rule: the tree's delta rule (`tree` or a kernel of its
  contract, vmapped over the rows)."""
  if chain:
    valid = jnp.diagonal(visible, axis1=1, axis2=2)
    y, s, w = jax.vmap(lambda *a: prefill(p, d, *a, chunk=chunk))(x, state, window, valid)
    return y, Prefilled(s, w)
  parents = jax.vmap(parents_of)(positions, visible)
  return jax.vmap(lambda x, par, s, w, vis: tree_forward(p, d, x, par, s, w, vis, rule))(
      x, parents, state, window, visible)


def commit_block(state, window, pending, src, count):
  """(state [B, Hv, dk, dv], window [B, K-1, Hk, G]) after each row's accepted rows: src [B, R] the
  verified rows kept, in path order, count [B] how many (`decoder.commit`'s arguments). A
  Prefilled block holds them already (src, count: the prompt's rows)."""
  if isinstance(pending, Prefilled):
    return pending.state, pending.window
  b, n = pending.big_g.shape[:2]
  kept = jnp.arange(src.shape[1])[None] < count[:, None]
  path = jnp.zeros((b, n), bool).at[jnp.arange(b)[:, None], src].max(kept)
  last = jnp.where(count > 0, jnp.take_along_axis(src, jnp.maximum(count - 1, 0)[:, None],
                                                  axis=1)[:, 0], -1)
  return jax.vmap(commit_tree)(state, window, pending, path, last)


def init_params(d: GDNDims, hidden: int, key, dtype, std: float = 0.02) -> GDNParams:
  """Random weights (benchmarks and tests): decays as HF initialises them, the convolution at
  PyTorch's scale for its fan-in K."""
  ks = jax.random.split(key, 7)
  w = lambda k, *shape: (std * jax.random.normal(k, shape, F32)).astype(dtype)
  hv, groups = d.value_heads, (d.key_heads, d.group_dim)
  conv = jax.random.normal(ks[4], (d.conv_kernel, *groups)) * d.conv_kernel ** -0.5
  return GDNParams(
      w_qkv=w(ks[0], hidden, *groups), w_z=w(ks[1], hidden, hv * d.value_dim),
      w_b=w(ks[2], hidden, hv), w_a=w(ks[3], hidden, hv), conv=conv.astype(dtype),
      dt_bias=jnp.ones((hv,), dtype),
      a_log=jnp.log(jax.random.uniform(ks[5], (hv,), F32, 0.01, 16.0)).astype(dtype),
      norm=jnp.ones((d.value_dim,), dtype), w_out=w(ks[6], hv * d.value_dim, hidden))


def unfuse_qwen3_next(w_qkvz, w_ba, d: GDNDims) -> dict[str, np.ndarray]:
  """Qwen3-Next's fused projections (HF [out, in]) in Qwen3.5's layout: per key head g the
  fused rows are [q_g | k_g | v and z of its r value heads], and b / a [b of its r | a of its r];
  returns {"qkv": [2 Hk dk + Hv dv, in] (all q, all k, all v, head-major), "z": [Hv dv, in],
  "b": [Hv, in], "a": [Hv, in]}: the same layer, so one layout (then `group_channels`) serves
  both families."""
  hk, dk, dv = d.key_heads, d.key_dim, d.value_dim
  r = d.value_heads // hk
  w = np.asarray(w_qkvz).reshape(hk, 2 * dk + 2 * r * dv, -1)
  q, k, v, z = np.split(w, np.cumsum([dk, dk, r * dv]), axis=1)
  flat = lambda a: a.reshape(-1, a.shape[-1])
  b, a = np.split(np.asarray(w_ba).reshape(hk, 2 * r, -1), 2, axis=1)
  return {"qkv": np.concatenate([flat(q), flat(k), flat(v)]), "z": flat(z), "b": flat(b),
          "a": flat(a)}


def group_channels(a, d: GDNDims, concat=None):
  """a [..., C] over the convolved channels in HF's order (all q | all k | all v, head-major:
  in_proj_qkv's rows, conv1d's channels) -> [..., Hk, G] group-major: per key head h, q_h | k_h
  | v of value heads h r .. h r + r - 1. NumPy or jax arrays; concat(parts, axis) joins the
  three parts (default np / jnp.concatenate; a loader passes a lazy join)."""
  kd, lead = d.key_heads * d.key_dim, a.shape[:-1]
  group = lambda part: part.reshape(*lead, d.key_heads, -1)
  if concat is None:
    concat = np.concatenate if isinstance(a, np.ndarray) else jnp.concatenate
  return concat([group(a[..., :kd]), group(a[..., kd:2 * kd]), group(a[..., 2 * kd:])],
                axis=len(lead) + 1)
