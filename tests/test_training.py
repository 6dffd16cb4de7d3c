"""Training of the bundled default pair, on CPU with tiny settings: target loss + exact resume,
drafter loss, HF / z-lab export round trips, and training forward == decode-time drafter."""

import dataclasses
import json
import functools
import importlib.util
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dj
from ddtree_jax.training import data
from ddtree_jax.checkpoints import export as hf_export
from ddtree_jax.models import decoder
from ddtree_jax.training import loop as train_loop
from ddtree_jax.training import losses as training
from ddtree_jax.models import drafter as drafter_lib
from ddtree_jax.models.config import ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 32


def _config(name, preset="smoke"):
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "configs", f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(preset)


def _tc(name, **over):
  tc = _config(name).train
  tc.update(time_budget_s=0.0, log_every=1, progress_bar=False, **over)
  return tc


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A tokenizer trained on the first 3 train files of the stdlib (a few KB)."""
  return data.prepare_corpus(str(tmp_path_factory.mktemp("corpus")), vocab_size=300, max_files=3)


def _tiny_cfg(tok, tie=True):
  return ModelConfig(model_type="qwen3", vocab_size=300, hidden_size=32, intermediate_size=64,
                     num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                     tie_word_embeddings=tie, eos_token_ids=(tok.token_to_id(data.EOS),),
                     max_position_embeddings=SEQ)


def _train_target(workdir, corpus, **over):
  tok, train_tokens, _ = corpus
  cfg = _tiny_cfg(tok)
  params = decoder.init_params(cfg, jax.random.key(0), jnp.float32)
  tc = _tc("train_target", num_steps=8, save_every=4, eval_every=0, lr=1e-2, batch_size=4,
           keep_best=False, **over)
  return train_loop.train(
      name="target", workdir=str(workdir), params=params,
      loss_fn=functools.partial(training.target_loss, cfg=cfg, compute_dtype=jnp.float32),
      frozen=None, eval_fn=None, tc=tc,
      batch_fn=lambda s: {"tokens": data.window_batch(train_tokens, 4, SEQ + 1, 0, s)})


@pytest.fixture(scope="module")
def target(corpus, tmp_path_factory):
  params, summary = _train_target(tmp_path_factory.mktemp("target"), corpus)
  tok = corpus[0]
  return dj.Target(params=params, config=_tiny_cfg(tok), tokenizer=tok), summary


def test_corpus_adds_the_dependencies_sources(tmp_path):
  """Packages join the corpus under site-packages/<name>/, split by the same path hash, and the
  stdlib part (its split included) is unchanged by them."""
  assert data.resolve_packages("deps") == list(data.DEPENDENCIES)
  assert data.resolve_packages("absl, ,tqdm") == ["absl", "tqdm"]
  every = data.resolve_packages("all")
  assert {"absl", "jax", "numpy", "tqdm"} <= set(every) and "ddtree_jax" not in every
  assert len(every) == len(set(every))
  assert data.resolve_packages("deps,all")[:3] == ["jax", "jaxlib", "ml_dtypes"]
  with pytest.raises(ValueError, match="'no_such_pkg' is not installed"):
    data.sources(packages=["no_such_pkg"])
  absl_files = data.list_files(data.package_dir("absl"), "site-packages/absl/")
  assert absl_files and all(f.startswith("site-packages/absl/") and "/tests/" not in f
                            for f in absl_files)
  assert not any(f.endswith("_gen.py") for f in data.list_files(data.package_dir("jaxlib")))
  plain = data.read_split("train", max_files=2)
  more = data.read_split("train", max_files=2, packages=["absl"])
  assert more[:len(plain)] == plain and all(r.startswith("site-packages/absl/")
                                            for r, _ in more[len(plain):])
  tok, train, _ = data.prepare_corpus(str(tmp_path), 300, max_files=2, packages="absl")
  assert train.dtype == np.int32 and train.max() < 300
  info = json.load(open(tmp_path / "data" / "corpus.json"))
  assert info["settings"]["packages"] == ["absl"] and info["package_versions"]["absl"] != "unknown"
  assert np.load(tmp_path / "data" / "train.npy").dtype == np.uint16  # half the bytes
  with pytest.raises(ValueError, match="was made with"):
    data.prepare_corpus(str(tmp_path), 300, max_files=2, packages="")
  # a tokenizer brought without its caches (the target's, from another machine) is kept, not
  # retrained: one trained on the stdlib alone encodes the corpus with absl's sources
  plain, _, _ = data.prepare_corpus(str(tmp_path / "plain"), 300, max_files=2, packages="")
  assert plain.get_vocab() != tok.get_vocab()
  for name in ("given", "wrong"):
    (tmp_path / name).mkdir()
    (tmp_path / name / "tokenizer.json").write_bytes(
        (tmp_path / "plain" / "tokenizer.json").read_bytes())
  tok2, train2, _ = data.prepare_corpus(str(tmp_path / "given"), 300, max_files=2,
                                        packages="absl")
  assert tok2.get_vocab() == plain.get_vocab()
  assert len(train2) != len(train) and train2.max() < 300
  assert json.load(open(tmp_path / "given" / "data" / "corpus.json"))["tokenizer_given"]
  with pytest.raises(ValueError, match="not vocab_size 301"):
    data.prepare_corpus(str(tmp_path / "wrong"), 301, max_files=2, packages="absl")


def test_corpus_split_and_tokenizer(corpus):
  tok, train_tokens, heldout_tokens = corpus
  files = data.list_files()
  assert files and all(f.endswith(".py") and not f.startswith(("test/", "idlelib/")) for f in files)
  assert data.split_of("json/decoder.py") == data.split_of("json/decoder.py")
  held = [f for f in files if data.split_of(f) == "heldout"]
  assert 0 < len(held) < 0.1 * len(files)
  assert tok.token_to_id(data.EOS) == 0 and tok.token_to_id(data.MASK) == 1
  assert len(train_tokens) > 1000 and len(heldout_tokens) > 100
  assert 1 not in set(train_tokens.tolist())                 # MASK never occurs in text
  text = "    def f(self, x):\n        return x  # ünïcode\n"
  assert tok.decode(tok.encode(text).ids) == text
  a = data.window_batch(train_tokens, 4, SEQ + 1, 0, 7)
  np.testing.assert_array_equal(a, data.window_batch(train_tokens, 4, SEQ + 1, 0, 7))
  assert not np.array_equal(a, data.window_batch(train_tokens, 4, SEQ + 1, 0, 8))


def test_target_loss_decreases_and_resume_is_exact(corpus, target, tmp_path):
  _, full = target
  losses = [r["loss"] for r in full["history"]]
  assert [r["step"] for r in full["history"]] == list(range(1, 9))
  assert losses[-1] < losses[0] - 0.3
  _, part = _train_target(tmp_path, corpus, stop_at_step=4)       # "interrupted" after step 4
  assert part["steps"] == 4 and not part["finished"]
  _, resumed = _train_target(tmp_path, corpus)                    # same workdir: resumes at 4
  assert resumed["steps"] == 8 and resumed["finished"]
  np.testing.assert_allclose([r["loss"] for r in resumed["history"]], losses, rtol=1e-6)


def test_target_export_round_trip(target, tmp_path):
  tgt, _ = target
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 300, (2, 11)), jnp.int32)
  ref = dj.forward_logits(tgt, tokens)
  path = hf_export.save_target_hf(str(tmp_path / "f32"), tgt.params, tgt.config, tgt.tokenizer,
                                   dtype="float32")
  loaded = dj.load_target(path, dtype="float32")
  assert loaded.config == tgt.config
  assert loaded.tokenizer.to_str() == tgt.tokenizer.to_str()
  np.testing.assert_array_equal(np.asarray(dj.forward_logits(loaded, tokens)), np.asarray(ref))
  # untied lm_head, bfloat16 file: every tensor is the bf16 rounding of ours
  cfg = dataclasses.replace(tgt.config, tie_word_embeddings=False)
  params = decoder.init_params(cfg, jax.random.key(3), jnp.float32, std=0.3)
  path = hf_export.save_target_hf(str(tmp_path / "bf16"), params, cfg, dtype="bfloat16")
  loaded = dj.load_target(path, dtype="bfloat16", fuse_qkv=False)  # init_params' layout
  chex.assert_trees_all_equal(loaded.params, jax.tree.map(lambda b: b.astype(jnp.bfloat16), params))


@pytest.fixture(scope="module")
def drafter(target, tmp_path_factory):
  """A 1-layer drafter trained for 10 steps on the tiny target's greedy continuations."""
  tgt, _ = target
  tok = tgt.tokenizer
  train_tokens = data.encode_documents(tok, [t for _, t in data.read_split("train", max_files=3)])
  prompts = data.prompt_windows(train_tokens, 6, 4, 8, seed=0)
  res = dj.generate(tgt, [p.tolist() for p in prompts], method="ar", max_new_tokens=20,
                    stop_token_ids=())
  seqs = np.zeros((6, 28), np.int32)
  lens = np.zeros((6,), np.int32)
  for i, (p, out) in enumerate(zip(prompts, res.tokens)):
    s = np.concatenate([p, out])
    seqs[i, :len(s)], lens[i] = s, len(s)
  plens = np.array([len(p) for p in prompts], np.int32)
  layers = dataclasses.replace(tgt.config, num_layers=1, tie_word_embeddings=False,
                               eos_token_ids=())
  dcfg = drafter_lib.DrafterConfig(layers=layers, block_size=4,
                                   mask_token_id=tok.token_to_id(data.MASK),
                                   target_layer_ids=(0, 2))
  tc = _tc("train_drafter", num_steps=10, save_every=10, eval_every=0, lr=1e-2, batch_size=3,
           num_anchors=12, keep_best=False)
  loss_fn = functools.partial(training.drafter_loss, dcfg=dcfg, tcfg=tgt.config, gamma=4.0,
                              compute_dtype=jnp.float32)
  batch_fn = lambda s: data.drafter_batch(seqs, lens, plens, 3, 12, 0, s)
  params, summary = train_loop.train(
      name="drafter", workdir=str(tmp_path_factory.mktemp("drafter")),
      params=training.init_drafter_params(dcfg, jax.random.key(1), std=0.1), loss_fn=loss_fn,
      frozen=tgt.params, batch_fn=batch_fn, eval_fn=None, tc=tc)
  return dj.Drafter(params=params, config=dcfg), summary, seqs, lens, plens


def test_drafter_loss_decreases(drafter):
  _, summary, *_ = drafter
  losses = [r["loss"] for r in summary["history"]]
  assert len(losses) == 10 and all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < losses[0] - 0.3


def test_anchor_sampling():
  a, ok = data.sample_anchors(5, 12, 8, seed=0, epoch=0, index=3)
  assert ok.sum() == 6 and set(a[ok].tolist()) == set(range(5, 11)) and not a[~ok].any()
  b, _ = data.sample_anchors(20, 200, 8, seed=0, epoch=1, index=3)
  c, _ = data.sample_anchors(20, 200, 8, seed=0, epoch=2, index=3)
  assert (b >= 20).all() and (b <= 198).all() and not np.array_equal(b, c)   # fresh per epoch


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg"))
def _decode_time_logits(tparams, dparams, tokens, a, *, tcfg, dcfg):
  """drafter.draft_logits for the block anchored at a, set up as decode does it: a prefill-style
  causal forward, context K/V of its first a rows committed to the drafter cache, bonus x_a."""
  s = tokens.shape[0]
  _, taps = training.target_hidden(tparams, tcfg, tokens[None], dcfg.target_layer_ids)
  k, v = drafter_lib.context_kv(dparams, dcfg, taps, jnp.arange(s)[None])
  lc = dcfg.layers
  cache = decoder.init_cache(lc.num_layers, 1, lc.num_kv_heads, s, lc.head_dim, jnp.float32)
  cache = decoder.commit(cache, decoder.Pending(k, v), jnp.arange(s)[None], jnp.reshape(a, (1,)))
  return drafter_lib.draft_logits(dparams, dcfg, tparams, cache, tokens[a][None])[0]


def _draft(tgt, dft, tokens, a):
  return np.asarray(_decode_time_logits(tgt.params, dft.params, tokens, jnp.int32(a),
                                        tcfg=tgt.config, dcfg=dft.config))


def test_training_forward_equals_draft_logits(target, drafter, tmp_path):
  tgt, _ = target
  dft, _, seqs, lens, _ = drafter
  tokens = jnp.asarray(seqs[1, :lens[1]])
  anchors = np.array([1, 5, 9, int(lens[1]) - 4])
  @jax.jit
  def train_forward(tparams, dparams, tokens, anchors):
    _, taps = training.target_hidden(tparams, tgt.config, tokens, dft.config.target_layer_ids)
    return training.drafter_block_logits(dparams, dft.config, tparams, taps, tokens, anchors)

  got = train_forward(tgt.params, dft.params, tokens[None], jnp.asarray(anchors[None], jnp.int32))[0]
  for i, a in enumerate(anchors):
    np.testing.assert_allclose(np.asarray(got[i]), _draft(tgt, dft, tokens, a), rtol=1e-5,
                               atol=1e-5)
  # z-lab export round trip: same params, same decode-time logits, loadable by load_drafter
  path = hf_export.save_drafter_hf(str(tmp_path / "d"), dft.params, dft.config,
                                    tgt.config.num_layers, dtype="float32")
  loaded = dj.load_drafter(path, tgt)
  assert loaded.config == dft.config
  chex.assert_trees_all_equal(loaded.params, dft.params)
  np.testing.assert_array_equal(_draft(tgt, loaded, tokens, 9), _draft(tgt, dft, tokens, 9))


def test_simulate_chain():
  # anchors 3..9 of a 11-token sequence; runs: at 3 -> 2 correct (commit 3), at 6 -> 0, at 7 -> 1
  anchors = np.array([[3, 4, 5, 6, 7, 8, 9, 0]])
  ok = np.array([[1, 1, 1, 1, 1, 1, 1, 0]], bool)
  runs = np.array([[2, 9, 9, 0, 1, 9, 0, 0]])
  assert training.simulate_chain(runs, anchors, ok, np.array([11])) == (3 + 1 + 2 + 1, 4)
