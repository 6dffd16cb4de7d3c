"""The gated delta rule (`models/gated_deltanet.py`, float32): the chunked prefill and the
all-nodes tree form against the token-by-token loop, node by node along each root path, and the
state an accepted path commits; the layer against a NumPy oracle; both hybrid fixtures' logits
(Qwen3.5 text, Qwen3-Next) from a plain forward built on the layer, against transformers'."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES
from ddtree_jax.checkpoints.safetensors_io import read_safetensors
from ddtree_jax.models import gated_deltanet as gd

H, DK, DV = 3, 8, 6


def _inputs(t, seed, decay=0.3):
  rng = np.random.default_rng(seed)
  unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
  q = unit(rng.normal(size=(t, H, DK))) / np.sqrt(DK)
  k = unit(rng.normal(size=(t, H, DK)))
  v = rng.normal(size=(t, H, DV))
  g = -decay * np.abs(rng.normal(size=(t, H)))
  beta = 1 / (1 + np.exp(-rng.normal(size=(t, H))))
  state = rng.normal(size=(H, DK, DV))
  return [jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta)], jnp.asarray(state, jnp.float32)


def _close(a, b, tol=2e-5):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape
  np.testing.assert_allclose(a, b, atol=tol * max(1.0, np.abs(b).max()))


@pytest.mark.parametrize("t,chunk", [(1, 4), (37, 8), (64, 64), (150, 16)])
def test_chunked_prefill_equals_the_loop(t, chunk):
  x, state = _inputs(t, seed=t)
  o, s = gd.chunked(*x, state, chunk=chunk)
  o_ref, s_ref = gd.recurrent(*x, state)
  _close(o, o_ref)
  _close(s, s_ref)


def test_ancestors_of_a_tree():
  parents = np.array([-1, 0, 0, 1, -1, 4, 3])
  want = np.eye(7, dtype=bool)
  for j in range(7):
    p = parents[j]
    while p >= 0:
      want[j, p] = True
      p = parents[p]
  np.testing.assert_array_equal(np.asarray(gd.ancestors_of(jnp.asarray(parents))), want)


@pytest.mark.parametrize("decay", [0.05, 0.3, 3.0])
def test_every_node_sees_its_own_root_path(decay):
  """Siblings at several depths (different tokens on each branch) and two roots: each node's
  output is the loop's along its root path alone; the state committed for any node's path is
  the loop's state there, and committing nothing keeps the state."""
  parents = jnp.asarray([-1, 0, 0, 1, 1, 2, 3, 3, 6, 5, -1, 10, 10])
  n = parents.shape[0]
  x, state = _inputs(n, seed=int(decay * 10), decay=decay)
  anc = gd.ancestors_of(parents)
  o, delta, big_g = gd.tree(*x, state, anc)
  for j in range(n):
    path = jnp.asarray(np.flatnonzero(np.asarray(anc[j])))
    o_ref, s_ref = gd.recurrent(*[a[path] for a in x], state)
    _close(o[j], o_ref[-1])
    _close(gd.commit(state, x[1], delta, big_g, anc[j], j), s_ref)
  _close(gd.commit(state, x[1], delta, big_g, jnp.zeros((n,), bool), -1), state, 0)
  # a sibling's branch changes the outputs: node 4 (sibling of 3) differs from node 3
  assert np.abs(np.asarray(o[3] - o[4])).max() > 1e-3


def test_conv_of_every_node_runs_along_its_root_path():
  """Kernel 4: each node's convolution equals a causal convolution over (window + its path);
  the committed window is the last 3 inputs of (window + accepted path), also for paths shorter
  than the window and for nothing accepted."""
  rng = np.random.default_rng(5)
  parents = np.array([-1, 0, 0, 1, 2, 4, 5, -1])
  n, c, k = len(parents), 5, 4
  x = jnp.asarray(rng.normal(size=(n, c)), jnp.float32)
  window = jnp.asarray(rng.normal(size=(k - 1, c)), jnp.float32)
  weight = jnp.asarray(rng.normal(size=(k, c)), jnp.float32)
  got = np.asarray(gd.tree_conv(x, jnp.asarray(parents), window, weight))
  for j in range(n):
    path = [j]
    while parents[path[-1]] >= 0:
      path.append(int(parents[path[-1]]))
    seq = np.concatenate([np.asarray(window), np.asarray(x)[path[::-1]]])   # oldest first
    want = sum(np.asarray(weight)[k - 1 - i] * seq[-1 - i] for i in range(k))
    np.testing.assert_allclose(got[j], want, rtol=1e-5, atol=1e-5)
    kept = gd.commit_window(window, x, jnp.asarray(parents), j)
    np.testing.assert_array_equal(np.asarray(kept), seq[-(k - 1):])
  np.testing.assert_array_equal(
      np.asarray(gd.commit_window(window, x, jnp.asarray(parents), -1)), np.asarray(window))
  with pytest.raises(ValueError, match="window of 2 rows"):
    gd.tree_conv(x, jnp.asarray(parents), window[1:], weight)


# --------------------------------------------------------------------------------------------
# The layer: a NumPy oracle written from the Gated DeltaNet formulas, token by token

DIMS = gd.GDNDims(key_heads=2, value_heads=4, key_dim=8, value_dim=6)
HID, KER = 16, 4
CH = 2 * 2 * 8 + 4 * 6


def _layer_params(seed=0):
  """Random weights with w_qkv [H, C] and conv [K, C] in HF's channel order (q | k | v): the
  oracle's layout; `_grouped` gives the layer's."""
  rng = np.random.default_rng(seed)
  w = lambda *s: jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)
  return gd.GDNParams(w_qkv=w(HID, CH), w_z=w(HID, 24), w_b=w(HID, 4), w_a=w(HID, 4),
                      conv=w(KER, CH), dt_bias=w(4), a_log=w(4), norm=1 + w(6), w_out=w(24, HID))


def _grouped(p):
  """HF-order params as the layer holds them: w_qkv [H, Hk, G], conv [K, Hk, G]."""
  return dataclasses.replace(p, w_qkv=gd.group_channels(p.w_qkv, DIMS),
                             conv=gd.group_channels(p.conv, DIMS))


def _oracle(p, xs, state, window):
  """Token by token in float64, on HF-order params and window [K-1, C]: (outputs [T, H], state,
  window)."""
  p = {f.name: np.asarray(getattr(p, f.name), np.float64) for f in dataclasses.fields(p)}
  silu = lambda a: a / (1 + np.exp(-a))
  state, window, out = np.array(state, np.float64), np.array(window, np.float64), []
  kd, r = 16, 2
  for x in np.asarray(xs, np.float64):
    window = np.concatenate([window, (x @ p["w_qkv"])[None]])
    conv = silu(np.sum(p["conv"] * window[-KER:], axis=0))
    window = window[1:]
    q = np.repeat(conv[:kd].reshape(2, 8), r, axis=0)
    k = np.repeat(conv[kd:2 * kd].reshape(2, 8), r, axis=0)
    v = conv[2 * kd:].reshape(4, 6)
    q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6) / np.sqrt(8)
    k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
    beta = 1 / (1 + np.exp(-(x @ p["w_b"])))
    g = -np.exp(p["a_log"]) * np.log1p(np.exp(x @ p["w_a"] + p["dt_bias"]))
    o = np.zeros((4, 6))
    for h in range(4):
      state[h] *= np.exp(g[h])
      delta = (v[h] - k[h] @ state[h]) * beta[h]
      state[h] += np.outer(k[h], delta)
      o[h] = q[h] @ state[h]
    z = (x @ p["w_z"]).reshape(4, 6)
    y = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + DIMS.eps) * p["norm"] * silu(z)
    out.append(y.reshape(-1) @ p["w_out"])
  return np.stack(out), state, window


def test_layer_prefill_tree_and_commit_equal_the_token_loop():
  """Prefill (chunked, not a multiple of the chunk) from a committed state and window; then a
  tree whose every node equals the loop over its own root path; then committing one path and
  prefilling more equals the loop over prompt + path + continuation. The layer runs on the
  group-major layout (`group_channels` of the weights and the window), the oracle on HF's."""
  p, layer = _layer_params(), _grouped(_layer_params())
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(11, HID)), jnp.float32)
  state = jnp.asarray(rng.normal(size=(4, 8, 6)) * 0.1, jnp.float32)
  window = jnp.asarray(rng.normal(size=(KER - 1, CH)) * 0.3, jnp.float32)
  y, s1, w1 = gd.prefill(layer, DIMS, x, state, gd.group_channels(window, DIMS), chunk=4)
  y_ref, s_ref, w_ref = _oracle(p, x, state, window)
  _close(y, y_ref, 1e-4)
  _close(s1, s_ref, 1e-4)
  _close(w1, gd.group_channels(w_ref, DIMS), 1e-5)
  w_ref = jnp.asarray(w_ref, jnp.float32)
  parents = jnp.asarray([-1, 0, 0, 1, 2, 3, 3, 6])
  nodes = jnp.asarray(rng.normal(size=(8, HID)), jnp.float32)
  out, pending = gd.tree_forward(layer, DIMS, nodes, parents, s1, w1)
  anc = np.asarray(gd.ancestors_of(parents))
  for j in range(8):
    path = np.flatnonzero(anc[j])
    _close(out[j], _oracle(p, nodes[path], s1, w_ref)[0][-1], 1e-4)
  path = np.flatnonzero(anc[7])                       # 0 -> 1 -> 3 -> 6 -> 7
  s2, w2 = gd.commit_tree(s1, w1, pending, jnp.asarray(anc[7]), 7)
  more = jnp.asarray(rng.normal(size=(5, HID)), jnp.float32)
  y3 = gd.prefill(layer, DIMS, more, s2, w2, chunk=4)[0]
  want = _oracle(p, jnp.concatenate([nodes[path], more]), s1, w_ref)[0][-5:]
  _close(y3, want, 1e-4)


def test_group_channels_puts_each_key_heads_value_heads_beside_it():
  """HF's channels q | k | v (2 key heads of 3, r = 2 value heads of 2 each), tagged by index:
  group h holds q_h, k_h and value heads 2h, 2h + 1 (value head j reads key head j // r)."""
  dims = gd.GDNDims(key_heads=2, value_heads=4, key_dim=3, value_dim=2)
  got = gd.group_channels(np.arange(dims.conv_dim)[None], dims)
  assert got.shape == (1, 2, dims.group_dim) and dims.group_dim == 10
  assert got[0].tolist() == [[0, 1, 2, 6, 7, 8, 12, 13, 14, 15],
                             [3, 4, 5, 9, 10, 11, 16, 17, 18, 19]]


def test_qwen3_next_projections_unfuse_by_key_head_group():
  """The fused rows as transformers lays them out (2 key heads, r = 3 value heads of 5, dk 8: a
  group is 46 rows), each row tagged by its index: q takes rows 0-7 and 46-53, k 8-15 and 54-61,
  value head 0 rows 16-20, z rows 31-45 and 77-91; b rows 0-2 and 6-8 of in_proj_ba, a 3-5, 9-11."""
  dims = gd.GDNDims(key_heads=2, value_heads=6, key_dim=8, value_dim=5)
  qkvz = np.arange(92, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
  ba = np.arange(12, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
  out = gd.unfuse_qwen3_next(qkvz, ba, dims)
  rows = lambda a: a[:, 0].astype(int).tolist()
  group = lambda lo, hi: list(range(lo, hi)) + list(range(lo + 46, hi + 46))
  assert rows(out["qkv"]) == group(0, 8) + group(8, 16) + group(16, 31)
  assert rows(out["z"]) == group(31, 46)
  assert rows(out["b"]) == [0, 1, 2, 6, 7, 8] and rows(out["a"]) == [3, 4, 5, 9, 10, 11]
  assert out["qkv"].shape == (2 * 16 + 30, 3)


# --------------------------------------------------------------------------------------------
# HF parity: both hybrid fixtures through a plain forward built on this module's layer


def _hf_forward(name, tokens):
  """Logits [T, V] of a hybrid fixture for one sequence: zero-centred RMSNorms, Gated DeltaNet
  layers through `gd.prefill` from a zero state and window (Qwen3-Next's projections unfused;
  the convolved channels regrouped, `group_channels`), gated full attention with partial rotary,
  dense MLPs or experts + a sigmoid-gated shared expert. Float32, no cache: the weights and
  conventions against transformers' logits."""
  d = os.path.join(FIXTURES, name)
  with open(os.path.join(d, "config.json")) as f:
    c = json.load(f)
  t = {k: jnp.asarray(v, jnp.float32) for k, v in read_safetensors(
      os.path.join(d, "model.safetensors")).items()}
  eps, n = c["rms_norm_eps"], len(tokens)
  dims = gd.GDNDims(c["linear_num_key_heads"], c["linear_num_value_heads"],
                    c["linear_key_head_dim"], c["linear_value_head_dim"], eps)
  norm = lambda x, w: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * (1 + w)
  swiglu = lambda x, p: (jax.nn.silu(x @ t[p + "gate_proj.weight"].T)
                         * (x @ t[p + "up_proj.weight"].T)) @ t[p + "down_proj.weight"].T
  hd, nh, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
  rot = int(hd * c["rope_parameters"]["partial_rotary_factor"])
  inv = 1.0 / c["rope_parameters"]["rope_theta"] ** (jnp.arange(0, rot, 2) / rot)
  ang = jnp.arange(n)[:, None] * inv[None]
  cos, sin = jnp.cos(jnp.concatenate([ang, ang], -1)), jnp.sin(jnp.concatenate([ang, ang], -1))

  def rope(x):  # [T, heads, hd]: rotate-half over the first `rot` dims
    r, rest = x[..., :rot], x[..., rot:]
    half = jnp.concatenate([-r[..., rot // 2:], r[..., :rot // 2]], -1)
    return jnp.concatenate([r * cos[:, None] + half * sin[:, None], rest], -1)

  h = t["model.embed_tokens.weight"][jnp.asarray(tokens)]
  for i, kind in enumerate(c["layer_types"]):
    pre = f"model.layers.{i}."
    x = norm(h, t[pre + "input_layernorm.weight"])
    if kind == "linear_attention":
      la = pre + "linear_attn."
      if la + "in_proj_qkvz.weight" in t:
        w = gd.unfuse_qwen3_next(t[la + "in_proj_qkvz.weight"], t[la + "in_proj_ba.weight"], dims)
      else:
        w = {k: t[la + f"in_proj_{k}.weight"] for k in ("qkv", "z", "b", "a")}
      p = gd.GDNParams(
          w_qkv=gd.group_channels(jnp.asarray(w["qkv"]).T, dims), w_z=jnp.asarray(w["z"]).T,
          w_b=jnp.asarray(w["b"]).T, w_a=jnp.asarray(w["a"]).T,
          conv=gd.group_channels(t[la + "conv1d.weight"][:, 0, :].T, dims),
          dt_bias=t[la + "dt_bias"], a_log=t[la + "A_log"], norm=t[la + "norm.weight"],
          w_out=t[la + "out_proj.weight"].T)
      state = jnp.zeros((dims.value_heads, dims.key_dim, dims.value_dim))
      window = jnp.zeros((c["linear_conv_kernel_dim"] - 1, dims.key_heads, dims.group_dim))
      y = gd.prefill(p, dims, x, state, window, chunk=4)[0]
    else:
      sa = pre + "self_attn."
      qg = (x @ t[sa + "q_proj.weight"].T).reshape(n, nh, 2 * hd)
      q, gate = qg[..., :hd], qg[..., hd:].reshape(n, nh * hd)
      q = rope(norm(q, t[sa + "q_norm.weight"]))
      k = rope(norm((x @ t[sa + "k_proj.weight"].T).reshape(n, nkv, hd), t[sa + "k_norm.weight"]))
      v = (x @ t[sa + "v_proj.weight"].T).reshape(n, nkv, hd)
      k, v = (jnp.repeat(a, nh // nkv, axis=1) for a in (k, v))
      s = jnp.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
      s = jnp.where(jnp.tril(jnp.ones((n, n), bool))[None], s, -jnp.inf)
      o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, -1), v).reshape(n, nh * hd)
      y = (o * jax.nn.sigmoid(gate)) @ t[sa + "o_proj.weight"].T
    h = h + y
    x = norm(h, t[pre + "post_attention_layernorm.weight"])
    if pre + "mlp.gate.weight" in t:
      probs = jax.nn.softmax(x @ t[pre + "mlp.gate.weight"].T, -1)
      top_w, top_e = jax.lax.top_k(probs, c["num_experts_per_tok"])
      if c.get("norm_topk_prob", True):
        top_w = top_w / top_w.sum(-1, keepdims=True)
      experts = jnp.stack([swiglu(x, pre + f"mlp.experts.{e}.")
                           for e in range(c["num_experts"])], 1)          # [T, E, H]
      y = jnp.einsum("tk,tkh->th", top_w, jnp.take_along_axis(experts, top_e[..., None], 1))
      y = y + jax.nn.sigmoid(x @ t[pre + "mlp.shared_expert_gate.weight"].T) * swiglu(
          x, pre + "mlp.shared_expert.")
    else:
      y = swiglu(x, pre + "mlp.")
    h = h + y
  return norm(h, t["model.norm.weight"]) @ t["lm_head.weight"].T


@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_next"])
def test_the_layer_in_a_plain_forward_matches_transformers(name):
  ref = np.load(os.path.join(FIXTURES, name, "reference.npz"))
  for row in range(ref["input_ids"].shape[0]):
    got = _hf_forward(name, ref["input_ids"][row])
    _close(got, ref["logits"][row], 1e-4)
