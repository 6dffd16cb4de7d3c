"""Target model parity with Hugging Face transformers (fixtures made by make_hf_reference.py)."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dj
from ddtree_jax import model
from conftest import FIXTURES

MODELS = ["qwen3_gqa", "qwen3_tied", "llama3_scaled", "qwen3_sharded"]


def _load(name):
  return dj.load_target(os.path.join(FIXTURES, name), dtype="float32"), np.load(
      os.path.join(FIXTURES, name, "reference.npz"))


def _close(a, b, rel=1e-4):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape
  assert np.max(np.abs(a - b)) <= rel * np.max(np.abs(b)), np.max(np.abs(a - b))


@pytest.mark.parametrize("name", MODELS)
def test_forward_logits_match_hf(name):
  target, ref = _load(name)
  _close(dj.forward_logits(target, ref["input_ids"]), ref["logits"])


@pytest.mark.parametrize("name", ["qwen3_gqa", "llama3_scaled"])
def test_taps_are_residual_layer_outputs(name):
  target, ref = _load(name)
  ids = jnp.asarray(ref["input_ids"])
  b, t = ids.shape
  cache = model.init_cache(target.config.num_layers, b, target.config.num_kv_heads, 0,
                           target.config.head_dim, jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  layers = tuple(range(target.config.num_layers))
  _, _, _, taps = model.forward(target.params, target.config, ids, pos, cache,
                                model.causal_mask(jnp.full((b,), t), t), layers)
  h = target.config.hidden_size
  for i in layers:
    _close(taps[..., i * h:(i + 1) * h], ref["layer_outputs"][i])


@pytest.mark.parametrize("name", MODELS)
def test_prefill_then_cached_decode_logits_match_hf(name):
  """Prompt prefill, then one cached step per HF greedy token: logits equal HF's per step."""
  target, ref = _load(name)
  cfg, params = target.config, target.params
  prompt, greedy = ref["prompt"], ref["greedy"]
  cache = model.init_cache(cfg.num_layers, 1, cfg.num_kv_heads, 64, cfg.head_dim, jnp.float32)
  t = len(prompt)
  ids = jnp.asarray(prompt)[None]
  pos = jnp.arange(t)[None]
  hidden, nk, nv, _ = model.forward(params, cfg, ids, pos, cache,
                                    model.causal_mask(jnp.array([t]), t))
  cache = model.commit(cache, nk, nv, pos, jnp.array([t]))
  got = [model.lm_head(params, hidden[0, -1])]
  for tok in greedy[:-1]:
    hidden, nk, nv, _ = model.forward(params, cfg, jnp.array([[tok]]), cache.lens[:, None],
                                      cache, jnp.ones((1, 1, 1), bool))
    cache = model.commit(cache, nk, nv, jnp.zeros((1, 1), jnp.int32), jnp.array([1]))
    got.append(model.lm_head(params, hidden[0, 0]))
  _close(jnp.stack(got), ref["decode_logits"])


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_matches_hf(name):
  target, ref = _load(name)
  res = dj.generate(target, [ref["prompt"].tolist()], max_new_tokens=16, stop_token_ids=())
  assert res.tokens[0] == ref["greedy"].tolist()
  assert res.stats["steps"] == 15 and res.stats["tau"] == 1.0


def test_config_parsing_both_rope_formats():
  top, _ = _load("qwen3_gqa")
  nested, _ = _load("qwen3_tied")
  llama, _ = _load("llama3_scaled")
  assert top.config.rope_theta == 10000.0 and nested.config.rope_theta == 1e6
  assert nested.config.tie_word_embeddings and nested.params.lm_head is None
  assert top.config.head_dim == 32 != top.config.hidden_size // top.config.num_heads
  assert dict(llama.config.rope_scaling)["factor"] == 8.0 and not llama.config.qk_norm
  assert top.config.eos_token_ids == (1,)
  assert top.tokenizer is not None


def test_gemm_bench_forms_compute_the_same_layer(tmp_path):
  """experiments/bench_gemm.py times model.py's projections against the layout model.py used
  before (stacked k/v, gate/up axis first): both must be the same layer, or the table is moot."""
  import json, os, sys
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments"))
  import bench_gemm
  rng = np.random.default_rng(0)
  d, nq, nkv, dh, f, t = 32, 4, 2, 8, 48, 5
  w = lambda *s: jnp.asarray(rng.normal(size=s) * s[0] ** -0.5, jnp.float32)
  layer = model.LayerParams(input_norm=w(d) + 1, wq=w(d, nq, dh), wkv=w(d, 2, nkv, dh),
                            wo=w(nq, dh, d), q_norm=w(dh) + 1, k_norm=w(dh) + 1,
                            post_norm=w(d) + 1, w_gate_up=w(d, 2, f), w_down=w(f, d))
  x = w(1, t, d)
  cfg = bench_gemm.layer_config(d, f, nq, nkv, dh)
  cos, sin = model.rope_tables(cfg, jnp.arange(t)[None], jnp.float32)
  new = bench_gemm.model_layer_step(x, layer, cos, sin, cfg=cfg, form="model")
  old = bench_gemm.model_layer_step(x, layer, cos, sin, cfg=cfg, form="sbt")
  np.testing.assert_allclose(np.asarray(new), np.asarray(old), rtol=1e-5, atol=1e-5)
  # the Pallas skinny-GEMM form (interpret mode here) computes the flat layer
  flat = [w(d, 3 * d), w(d, d), w(d, 2 * f), w(f, d)]
  xs = w(t, d)
  np.testing.assert_allclose(np.asarray(bench_gemm.pallas_layer_step(xs, *flat)),
                             np.asarray(bench_gemm.layer_step(xs, *flat)), rtol=1e-5, atol=1e-5)
  # its split-K and transposed-weight variants (the --sweep configurations) too
  for m, k, n in ((1, 256, 256), (5, 512, 256)):
    xm, wm = w(m, k), w(k, n)
    configs = bench_gemm.sweep_configs(k, n, min_programs=1)
    assert {c["splits"] for c in configs} > {1} and {c["transposed"] for c in configs} == {False, True}
    assert {c["swap"] for c in configs} == {False, True}
    for c in configs:
      got = bench_gemm.skinny_matmul(xm, wm.T if c["transposed"] else wm, **c)
      np.testing.assert_allclose(np.asarray(got), np.asarray(xm @ wm), rtol=1e-5, atol=1e-5)
  # int8 weights are cast in the kernel (--sweep --int8), plain and swapped
  xi, wi = w(5, 256), jnp.asarray(rng.integers(-127, 128, size=(256, 128)), jnp.int8)
  for swap in (False, True):
    got = bench_gemm.skinny_matmul(xi, wi, block_n=64, swap=swap)
    np.testing.assert_allclose(np.asarray(got), np.asarray(xi @ wi.astype(jnp.float32)),
                               rtol=1e-5, atol=2e-3)  # |entries| up to ~1e3
  # int8 x int8 (--sweep --w8a8): K-major weight, exact int32 sums, split-K and swapped too
  qx = jnp.asarray(rng.integers(-127, 128, size=(5, 512)), jnp.int8)
  qw = jnp.asarray(rng.integers(-127, 128, size=(256, 512)), jnp.int8)  # [N, K]
  want = np.asarray(qx, np.int64) @ np.asarray(qw, np.int64).T
  configs = bench_gemm.sweep_configs(512, 256, min_programs=1, variants="int8t,int8swap")
  assert {c["splits"] for c in configs} > {1} and {c["swap"] for c in configs} == {False, True}
  for c in configs:
    got = bench_gemm.skinny_matmul(qx, qw, **c)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), want)
  with pytest.raises(ValueError, match="int8t"):
    bench_gemm.parse_args(["--sweep", "--w8a8", "--variants=plain"])
  out = tmp_path / "gemm.jsonl"
  bench_gemm.main(["--smoke", "--forms=flat,model,sbt,pallas", f"--json_out={out}"])
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  want = {(m, form) for m in (1, 5) for form in ("flat", "model", "sbt", "pallas")}
  assert {(r["rows"], r["form"]) for r in rows} == want
  assert all(r["us"] > 0 for r in rows)
  sweep = tmp_path / "sweep.jsonl"
  bench_gemm.main(["--smoke", "--sweep", f"--json_out={sweep}"])
  rows = [json.loads(line) for line in sweep.read_text().splitlines()]
  assert {r["gemm"] for r in rows} == {"qkv", "o", "gate_up", "down"}
  assert {r["impl"] for r in rows} == {"xla", "pallas"} and all(r["us"] > 0 for r in rows)
  rows = bench_gemm.main(["--smoke", "--formats=bf16,w8,w8a8,w8a8t,fp8", "--gemms=o"])
  err = {r["format"]: max(x["err"] for x in rows if x["format"] == r["format"]) for r in rows}
  assert err["bf16"] < 1e-2 and err["w8"] < 3e-2 and err["w8a8"] < 3e-2 and err["fp8"] < 1e-1
  assert err["w8a8t"] == err["w8a8"]  # the same numbers, stored K-major
