"""DFlash drafter forward vs an independent float64 NumPy implementation (real checkpoint format)."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dj
from ddtree_jax.checkpoints import export
from ddtree_jax.models import decoder
from ddtree_jax.checkpoints.dflash import drafter_layers_config
from ddtree_jax.checkpoints.hf import read_checkpoint_tensors
from conftest import FIXTURES
from helpers import assert_accepted, oracle_drafter, write_drafter


@pytest.fixture(scope="module")
def target():
  return dj.load_target(os.path.join(FIXTURES, "qwen3_gqa"), dtype="float32")


@pytest.fixture(scope="module")
def pair(target, tmp_path_factory):
  path = write_drafter(str(tmp_path_factory.mktemp("d")), target.config, num_layers=2,
                       block_size=6, mask_token_id=7, target_layer_ids=(1, 0))
  return target, dj.load_drafter(path, target), path


def _taps(target, prompt, layer_ids):
  t = len(prompt)
  cache = decoder.init_cache(target.config.num_layers, 1, target.config.num_kv_heads, 0,
                           target.config.head_dim, jnp.float32)
  hidden, _, taps = decoder.forward(target.params, target.config, jnp.asarray([prompt]),
                                     jnp.arange(t)[None], cache,
                                     decoder.causal_mask(jnp.array([t]), t), layer_ids)
  bonus = int(jnp.argmax(decoder.lm_head(target.params, hidden[0, -1])))
  return np.asarray(taps[0], np.float64), bonus


def _np_rope(path, d, scaled=True):
  """(inv_freq [d/2], factor on cos / sin) of the drafter config.json in `path`, float64, from
  the published formulas as transformers 4.57 (the reference's pin) applies them: llama3's three
  wavelength bands; YaRN's ramp over the dims between the correction dims of beta_fast and
  beta_slow rotations in original_max_position_embeddings (floored / ceiled), 0 keeping a
  frequency, 1 dividing it by factor, and 0.1 m ln(factor) + 1 on cos / sin (m = 1, or the
  mscale / mscale_all_dim ratio). scaled=False: the same rope_theta, unscaled."""
  with open(os.path.join(path, "config.json")) as f:
    c = json.load(f)
  r = {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}
  theta = r.get("rope_theta", c.get("rope_theta"))
  base = [theta ** (-2.0 * i / d) for i in range(d // 2)]
  kind = r.get("rope_type", r.get("type", "default"))
  if kind == "default" or not scaled:
    return np.array(base), 1.0
  s, old = r["factor"], r["original_max_position_embeddings"]
  if kind == "llama3":
    lo, hi = r["low_freq_factor"], r["high_freq_factor"]
    out = []
    for f in base:
      wavelength = 2 * np.pi / f
      if wavelength < old / hi:
        out.append(f)
      elif wavelength > old / lo:
        out.append(f / s)
      else:
        a = (old / wavelength - lo) / (hi - lo)
        out.append((1 - a) * f / s + a * f)
    return np.array(out), 1.0
  assert kind == "yarn", kind
  at = lambda rotations: d * np.log(old / (2 * np.pi * rotations)) / (2 * np.log(theta))
  first = max(np.floor(at(r.get("beta_fast") or 32)), 0)
  last = min(np.ceil(at(r.get("beta_slow") or 1)), d - 1)
  out = []
  for i, f in enumerate(base):
    ramp = min(max((i - first) / max(last - first, 1e-3), 0.0), 1.0)
    out.append(f * (1 - ramp) + f / s * ramp)
  m = lambda k: 1.0 if s <= 1 else 0.1 * k * np.log(s) + 1
  att = r.get("attention_factor")
  if att is None:
    both = r.get("mscale") and r.get("mscale_all_dim")
    att = m(r["mscale"]) / m(r["mscale_all_dim"]) if both else m(1)
  return np.array(out), att


def _np_drafter(path, target_dir, taps, bonus, cfg, rope=None, windows=(None, None)):
  """Float64 DFlash forward from the raw safetensors (PyTorch [out, in] layout); rope (inv_freq,
  factor on cos / sin) for context and block rows alike, None: plain at cfg.rope_theta; windows:
  per layer W (keys more than W - 1 positions from the query masked, flash-attention's
  symmetric window) or None."""
  w = {k: np.asarray(v, np.float64) for k, v in read_checkpoint_tensors(path).items()}
  tw = {k: np.asarray(v, np.float64) for k, v in read_checkpoint_tensors(target_dir).items()}
  eps, heads, kvh, hd = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  inv, att = rope or (1.0 / cfg.rope_theta ** (np.arange(0, hd, 2) / hd), 1.0)

  def norm(x, g):
    return g * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)

  def rotate(x, pos):  # x [T, h, D]
    ang = np.concatenate([pos[:, None] * inv] * 2, -1)[:, None]
    rot = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * att * np.cos(ang) + rot * att * np.sin(ang)

  p, bs = taps.shape[0], 6
  ctx = norm(taps @ w["fc.weight"].T, w["hidden_norm.weight"])
  x = tw["model.embed_tokens.weight"][[bonus] + [7] * (bs - 1)]
  pc, pb = np.arange(p, dtype=np.float64), np.arange(p, p + bs, dtype=np.float64)
  for l in range(2):
    a = f"layers.{l}."
    h = norm(x, w[a + "input_layernorm.weight"])
    proj = lambda m, name, n: (m @ w[a + f"self_attn.{name}_proj.weight"].T).reshape(len(m), n, hd)
    q = rotate(norm(proj(h, "q", heads), w[a + "self_attn.q_norm.weight"]), pb)
    k = np.concatenate([rotate(norm(proj(ctx, "k", kvh), w[a + "self_attn.k_norm.weight"]), pc),
                        rotate(norm(proj(h, "k", kvh), w[a + "self_attn.k_norm.weight"]), pb)])
    v = np.concatenate([proj(ctx, "v", kvh), proj(h, "v", kvh)])
    rep = heads // kvh
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
    if windows[l] is not None:
      far = np.abs(pb[:, None] - np.concatenate([pc, pb])[None, :]) > windows[l] - 1
      s = np.where(far[None], -np.inf, s)
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


@pytest.mark.parametrize("use,window,types,want", [
    (True, 4, ["sliding_attention", "full_attention"], (4, None)),
    (True, 9, ["full_attention", "sliding_attention"], (None, 9)),
    (False, 4, ["sliding_attention", "sliding_attention"], (None, None)),  # off: no window
])
def test_sliding_window_layers_match_float64_numpy(target, tmp_path, use, window, types, want):
  """z-lab's sliding_attention drafter layers, read as transformers' Qwen3Config reads them
  (the window only with use_sliding_window), each block query seeing the keys within W - 1
  positions: the float64 oracle with those windows, and (with a window) not the full one."""
  over = {"use_sliding_window": use, "sliding_window": window, "layer_types": types}
  path = write_drafter(str(tmp_path / "d"), target.config, num_layers=2, block_size=6,
                       mask_token_id=7, target_layer_ids=(1, 0), config_overrides=over)
  drafter = dj.load_drafter(path, target)
  assert tuple(drafter.config.layers.window(i) for i in range(2)) == want
  prompt = list(np.random.default_rng(3).integers(2, 256, 23))
  taps, bonus = _taps(target, prompt, drafter.config.target_layer_ids)
  args = (path, os.path.join(FIXTURES, "qwen3_gqa"), taps, bonus, drafter.config.layers)
  ref = _np_drafter(*args, windows=want)
  got = np.asarray(dj.draft_logits(target, drafter, prompt))
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
  if any(want):
    assert not np.allclose(got, _np_drafter(*args), atol=1e-2 * np.abs(ref).max())


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
      cache = decoder.commit(cache, decoder.Pending(k, v), jnp.arange(8)[None], jnp.array([n]))
      start += n
    return cfg.draft(dp, target.params, cache, jnp.array([11]))

  np.testing.assert_allclose(build([8, 8, 1]), build([1, 3, 5, 8]), rtol=1e-5, atol=1e-5)
  assert not np.allclose(build([8, 8, 1]), build([8, 8]))  # the context matters


# --------------------------------------------------------------------------------------------
# The drafter's own RoPE: z-lab's Kimi drafters run YaRN in their Qwen3 layers (Kimi-K2.5-DFlash:
# rope_theta 5e4, factor 64 over 4096 positions, beta 32 / 1, mscale = mscale_all_dim = 1). Here
# 64 original positions and prompts past them; at head_dim 32 and rope_theta 1e4 beta 32 / 1
# ramp YaRN over dims 0..5 of 16, so kept, blended and divided frequencies all occur.

_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
_ROPES = {
    # Kimi-K2.5-DFlash's layout: with mscale = mscale_all_dim their ratio, 1, is on cos / sin
    "yarn_kimi": {"rope_scaling": {**_YARN, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                   "mscale_all_dim": 1.0}},
    # transformers 5's layout (rope_theta inside), 0.1 ln 4 + 1 on cos / sin
    "yarn_params": {"rope_parameters": {**_YARN, "rope_theta": 5e4}},
    # an explicit attention_factor wins over mscale / mscale_all_dim
    "yarn_attention_factor": {"rope_scaling": {**_YARN, "beta_fast": 16.0, "mscale": 1.0,
                                               "mscale_all_dim": 1.0, "attention_factor": 1.4}},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
}


@pytest.mark.parametrize("name", list(_ROPES))
def test_own_rope_draft_logits_match_float64_numpy(target, tmp_path, name):
  """The drafter's RoPE is its own config's (inv_freq and the factor on cos / sin, context and
  block rows alike): its draft logits equal the float64 drafter with that RoPE, and plain RoPE
  (or YaRN without its factor) would have drafted materially different logits."""
  path = write_drafter(str(tmp_path), target.config, num_layers=2, block_size=6, mask_token_id=7,
                       target_layer_ids=(1, 0), rope=_ROPES[name])
  drafter = dj.load_drafter(path, target)
  lc = drafter.config.layers
  assert lc.rope_type == _ROPES[name][next(iter(_ROPES[name]))]["rope_type"]
  prompt = list(np.random.default_rng(7).integers(2, 256, 70))  # positions 0..75 > 64
  taps, bonus = _taps(target, prompt, drafter.config.target_layer_ids)
  draft = lambda rope: _np_drafter(path, os.path.join(FIXTURES, "qwen3_gqa"), taps, bonus, lc,
                                   rope)
  inv, att = _np_rope(path, lc.head_dim)
  want = draft((inv, att))
  got = np.asarray(dj.draft_logits(target, drafter, prompt))
  scale = np.abs(want).max()
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale)
  assert np.abs(draft(_np_rope(path, lc.head_dim, scaled=False)) - want).max() > 0.05 * scale
  if att != 1.0:
    assert np.abs(draft((inv, 1.0)) - want).max() > 0.05 * scale


def test_kimi_drafter_rope_reads_as_the_reference():
  """Kimi-K2.5-DFlash's config.json fields (as z-lab publish them) give YaRN with 1 on cos / sin
  (transformers' mscale / mscale_all_dim ratio); an explicit attention_factor replaces it; a yarn
  without original_max_position_embeddings takes max_position_embeddings, as transformers."""
  kimi = {"model_type": "qwen3", "hidden_size": 7168, "intermediate_size": 18432,
          "num_hidden_layers": 6, "num_attention_heads": 64, "num_key_value_heads": 8,
          "head_dim": 128, "vocab_size": 163840, "max_position_embeddings": 262144,
          "rope_theta": 50000.0,
          "rope_scaling": {"rope_type": "yarn", "factor": 64.0, "mscale": 1.0,
                           "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                           "beta_fast": 32.0, "beta_slow": 1.0}}
  lc = drafter_layers_config(kimi)
  assert (lc.rope_type, lc.rope_theta, lc.rope_attention_factor) == ("yarn", 5e4, 1.0)
  assert dict(lc.rope_scaling)["factor"] == 64.0
  legacy = {**kimi, "rope_scaling": {**kimi["rope_scaling"], "attention_factor": 1.4158883}}
  assert drafter_layers_config(legacy).rope_attention_factor == pytest.approx(1.4158883)
  bare = {**kimi, "rope_scaling": {"rope_type": "yarn", "factor": 64.0}}
  lc = drafter_layers_config(bare)
  assert dict(lc.rope_scaling)["original_max_position_embeddings"] == 262144
  assert lc.rope_attention_factor == pytest.approx(0.1 * np.log(64.0) + 1)


@pytest.mark.parametrize("rope,match", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "unsupported rope_type 'dynamic'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "unsupported rope_type 'linear'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0],
                          "long_factor": [1.0]}}, "unsupported rope_type 'longrope'"),
    ({"rope_scaling": {**_YARN, "truncate": False}}, "truncate=false"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "missing fields"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_unsupported_drafter_rope_is_refused(target, tmp_path, rope, match):
  path = write_drafter(str(tmp_path), target.config, rope=rope)
  with pytest.raises(ValueError, match=match):
    dj.load_drafter(path, target)


# A prompt past the 64 original positions, a short one and one that crosses them while decoding.
_LOOP_PROMPTS = [list(range(3, 75)), [42, 7, 9], [200, 1, 0, 3] * 13]
_LOOP_NEW = 24


@pytest.fixture(scope="module")
def yarn_loop(target, tmp_path_factory):
  """A block-8 YaRN drafter (0.1 ln 4 + 1 on cos / sin) and AR's tokens of _LOOP_PROMPTS."""
  path = write_drafter(str(tmp_path_factory.mktemp("yarn")), target.config, block_size=8,
                       rope={"rope_scaling": _YARN})
  ar = dj.generate(target, _LOOP_PROMPTS, max_new_tokens=_LOOP_NEW, stop_token_ids=()).tokens
  return dj.load_drafter(path, target), ar


@pytest.mark.parametrize("method,budget", [("chain", None), ("ddtree", 4), ("ddtree", 16)])
def test_yarn_drafter_decodes_losslessly(target, yarn_loop, method, budget):
  """The YaRN drafter's own forward in the loop (context rows and blocks), giving every logit
  but the oracle's two picks (`over_real`): drafts get accepted and the tokens are AR's."""
  drafter, ar = yarn_loop
  over = oracle_drafter(drafter, _LOOP_PROMPTS, ar, over_real=True)
  res = dj.generate(target, _LOOP_PROMPTS, method=method, drafter=over, budget=budget,
                    max_new_tokens=_LOOP_NEW, stop_token_ids=())
  assert res.tokens == ar
  assert_accepted(over, _LOOP_PROMPTS, res, method, budget)


@pytest.mark.parametrize("name", ["yarn_attention_factor", "llama3"])
def test_export_writes_the_drafters_own_rope(target, tmp_path, name):
  """save_drafter_hf's directory loads back with the same RoPE (type and every scaling field)."""
  path = write_drafter(str(tmp_path / "a"), target.config, rope=_ROPES[name])
  drafter = dj.load_drafter(path, target)
  again = dj.load_drafter(export.save_drafter_hf(str(tmp_path / "b"), drafter.params,
                                                 drafter.config, target.config.num_layers,
                                                 dtype="float32"), target)
  assert again.config.layers.rope_type == drafter.config.layers.rope_type != "default"
  assert again.config.layers.rope_scaling == drafter.config.layers.rope_scaling
