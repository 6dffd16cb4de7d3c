"""DFlash drafter forward vs an independent float64 NumPy implementation (real checkpoint format)."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dj
from ddtree_jax.models import decoder
from ddtree_jax.checkpoints.hf import read_checkpoint_tensors
from conftest import FIXTURES
from helpers import write_drafter


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  target = dj.load_target(os.path.join(FIXTURES, "qwen3_gqa"), dtype="float32")
  path = write_drafter(str(tmp_path_factory.mktemp("d")), target.config, num_layers=2,
                       block_size=6, mask_token_id=7, target_layer_ids=(1, 0))
  return target, dj.load_drafter(path, target), path


def _taps(target, prompt, layer_ids):
  t = len(prompt)
  cache = decoder.init_cache(target.config.num_layers, 1, target.config.num_kv_heads, 0,
                           target.config.head_dim, jnp.float32)
  hidden, _, _, taps = decoder.forward(target.params, target.config, jnp.asarray([prompt]),
                                     jnp.arange(t)[None], cache,
                                     decoder.causal_mask(jnp.array([t]), t), layer_ids)
  bonus = int(jnp.argmax(decoder.lm_head(target.params, hidden[0, -1])))
  return np.asarray(taps[0], np.float64), bonus


def _np_drafter(path, target_dir, taps, bonus, cfg):
  """Float64 DFlash forward from the raw safetensors (PyTorch [out, in] layout)."""
  w = {k: np.asarray(v, np.float64) for k, v in read_checkpoint_tensors(path).items()}
  tw = {k: np.asarray(v, np.float64) for k, v in read_checkpoint_tensors(target_dir).items()}
  eps, heads, kvh, hd = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

  def norm(x, g):
    return g * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)

  def rope(x, pos):  # x [T, h, D]
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2) / hd)
    ang = np.concatenate([pos[:, None] * inv] * 2, -1)[:, None]
    rot = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * np.cos(ang) + rot * np.sin(ang)

  p, bs = taps.shape[0], 6
  ctx = norm(taps @ w["fc.weight"].T, w["hidden_norm.weight"])
  x = tw["model.embed_tokens.weight"][[bonus] + [7] * (bs - 1)]
  pc, pb = np.arange(p, dtype=np.float64), np.arange(p, p + bs, dtype=np.float64)
  for l in range(2):
    a = f"layers.{l}."
    h = norm(x, w[a + "input_layernorm.weight"])
    proj = lambda m, name, n: (m @ w[a + f"self_attn.{name}_proj.weight"].T).reshape(len(m), n, hd)
    q = rope(norm(proj(h, "q", heads), w[a + "self_attn.q_norm.weight"]), pb)
    k = np.concatenate([rope(norm(proj(ctx, "k", kvh), w[a + "self_attn.k_norm.weight"]), pc),
                        rope(norm(proj(h, "k", kvh), w[a + "self_attn.k_norm.weight"]), pb)])
    v = np.concatenate([proj(ctx, "v", kvh), proj(h, "v", kvh)])
    rep = heads // kvh
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
    s = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("hqk,khd->qhd", s / s.sum(-1, keepdims=True), v).reshape(bs, -1)
    x = x + o @ w[a + "self_attn.o_proj.weight"].T
    h = norm(x, w[a + "post_attention_layernorm.weight"])
    g = h @ w[a + "mlp.gate_proj.weight"].T
    x = x + ((g / (1 + np.exp(-g))) * (h @ w[a + "mlp.up_proj.weight"].T)) @ w[a + "mlp.down_proj.weight"].T
  return norm(x[1:], w["norm.weight"]) @ tw["lm_head.weight"].T


@pytest.mark.parametrize("length", [1, 5, 23])
def test_draft_logits_match_float64_numpy(pair, length):
  target, drafter, path = pair
  prompt = list(np.random.default_rng(length).integers(2, 256, length))
  taps, bonus = _taps(target, prompt, drafter.config.target_layer_ids)
  ref = _np_drafter(path, os.path.join(FIXTURES, "qwen3_gqa"), taps, bonus, drafter.config.layers)
  got = np.asarray(dj.draft_logits(target, drafter, prompt))
  assert got.shape == (5, 256)
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_last_layer_tap_matches_the_reference_features(tmp_path):
  """A drafter tapping the target's last layer reads HF's hidden_states[L] (after the final norm,
  as the reference DFlash code does): our draft logits equal the float64 drafter fed HF's own
  hidden states."""
  target_dir = os.path.join(FIXTURES, "qwen3_gqa")
  target = dj.load_target(target_dir, dtype="float32")
  ref = np.load(os.path.join(target_dir, "reference.npz"))
  last = target.config.num_layers - 1
  path = write_drafter(str(tmp_path), target.config, num_layers=2, block_size=6, mask_token_id=7,
                       target_layer_ids=(0, last))
  drafter = dj.load_drafter(path, target)
  prompt = [int(t) for t in ref["input_ids"][0]]
  taps = np.concatenate([ref["hidden_states"][i + 1][0] for i in (0, last)], -1)
  bonus = int(np.argmax(ref["logits"][0, -1]))
  want = _np_drafter(path, target_dir, np.asarray(taps, np.float64), bonus, drafter.config.layers)
  got = np.asarray(dj.draft_logits(target, drafter, prompt))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_incremental_context_equals_from_scratch(pair):
  """Context committed in pieces (as decoding does) drafts exactly like context built at once."""
  target, drafter, _ = pair
  cfg, dp = drafter.config, drafter.params
  taps, _ = _taps(target, list(range(3, 20)), cfg.target_layer_ids)
  taps = jnp.asarray(taps, jnp.float32)[None]
  dl = cfg.layers

  def build(pieces):
    cache = decoder.init_cache(dl.num_layers, 1, dl.num_kv_heads, 32, dl.head_dim, jnp.float32)
    start = 0
    for n in pieces:
      pos = jnp.arange(start, start + 8)[None]
      rows = jnp.pad(taps[:, start:start + n], ((0, 0), (0, 8 - n), (0, 0)))
      k, v = cfg.context(dp, rows, pos)
      cache = decoder.commit(cache, k, v, jnp.arange(8)[None], jnp.array([n]))
      start += n
    return cfg.draft(dp, target.params, cache, jnp.array([11]))

  np.testing.assert_allclose(build([8, 8, 1]), build([1, 3, 5, 8]), rtol=1e-5, atol=1e-5)
  assert not np.allclose(build([8, 8, 1]), build([8, 8]))  # the context matters
