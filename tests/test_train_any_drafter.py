"""Training a DFlash drafter for any target this engine loads (experiments/train_drafter.py
`:any`, ddtree_jax/training/drafter_recipe.py, corpus.py): prompts from a user's corpus, the
target's own continuations, one step that lowers the loss for every family, an end-to-end run
whose exported drafter loads and keeps generation lossless, and bad input named."""

import functools
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

import ddtree_jax as dj
from configs import train_drafter as train_config
from ddtree_jax.training import corpus, drafter_recipe as recipe
from ddtree_jax.training import data, loop as train_loop, losses
from helpers import assert_close_rel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "fixtures", "hf")
WORDS = ("def return if else for in while import class self print value list dict key item "
         "open read write name path data true false none and or not").split()


def word_tokenizer():
  """A whitespace word-level tokenizer of ~40 ids (every fixture's vocabulary holds 256)."""
  vocab = {t: i for i, t in enumerate(["<unk>", "<|mask|>", "<|u|>", "<|a|>", *WORDS])}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
  return tok


def checkpoint(tmp_path, name: str, template: str | None = None) -> str:
  """A copy of fixture `name` with the word tokenizer (and a chat template when given)."""
  path = str(tmp_path / name)
  shutil.copytree(os.path.join(FIXTURES, name), path,
                  ignore=shutil.ignore_patterns("reference.npz", "tokenizer.json"))
  word_tokenizer().save(os.path.join(path, "tokenizer.json"))
  if template is not None:
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
      json.dump({"chat_template": template}, f)
  return path


def write_corpus(path, n: int = 12) -> str:
  rng = np.random.default_rng(0)
  with open(path, "w") as f:
    for i in range(n):
      text = " ".join(rng.choice(WORDS, 6 + i % 5))
      f.write(json.dumps({"messages": [{"role": "user", "content": text},
                                       {"role": "assistant", "content": "not kept"}]}) + "\n")
  return str(path)


def config(target: str, data_path: str, workdir: str, **drafter):
  cfg = train_config.get_config("smoke")
  cfg.target, cfg.data, cfg.workdir = target, data_path, workdir
  cfg.regen.update(num_sequences=8, heldout_sequences=2, prompt_max=24, new_tokens=16,
                   batch_size=4)
  cfg.drafter.update(**drafter)
  return cfg


def test_corpus_records_become_prompts(tmp_path):
  tok = word_tokenizer()
  path = tmp_path / "c.jsonl"
  records = [
      {"messages": [{"role": "system", "content": "self"}, {"role": "user", "content": "def value"},
                    {"role": "assistant", "content": "return value"}]},
      {"conversations": [{"from": "human", "value": "open path"}, {"from": "gpt", "value": "x"}]},
      {"prompt": "print name"},
      {"text": "import data for item in list"},
      {"messages": [{"role": "assistant", "content": "no user turn"}]},
      {"other": 1},
  ]
  path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
  template = "{% for m in messages %}<|{{ m['role'][0] }}|> {{ m['content'] }} {% endfor %}<|a|>"
  got = [tok.decode(p) for p in corpus.read_prompts(str(path), tok, template)]
  assert got == ["<unk> self <|u|> def value <|a|>", "<|u|> open path <|a|>",
                 "<|u|> print name <|a|>", "import data for item in list"]
  plain = [tok.decode(p) for p in corpus.read_prompts(str(path), tok, None)]
  assert plain[0] == "self def value"  # no template: the turns' text, assistant's last turn cut
  text = tmp_path / "c.txt"
  text.write_text("def value\nreturn value\n\n\nclass name\n")
  assert [tok.decode(p) for p in corpus.read_prompts(str(text), tok, None, max_len=3)] == [
      "def value return", "class name"]
  short = [tok.decode(p) for p in corpus.read_prompts(str(path), tok, template, max_len=5)]
  assert short == got[1:3] + ["import data for item in"]  # a long conversation left out, a text cut


def test_bad_input_is_named(tmp_path):
  tok = word_tokenizer()
  empty = tmp_path / "empty.jsonl"
  empty.write_text(json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n")
  with pytest.raises(corpus.CorpusError, match="no usable prompt: 1 records, 1 with no user"):
    corpus.read_prompts(str(empty), tok, None)
  bad = tmp_path / "bad.jsonl"
  bad.write_text("{not json\n")
  with pytest.raises(corpus.CorpusError, match="line 1: not JSON"):
    corpus.read_prompts(str(bad), tok, None)
  with pytest.raises(corpus.CorpusError, match="no such file"):
    corpus.read_prompts(str(tmp_path / "missing.txt"), tok, None)
  target = dj.load_target(checkpoint(tmp_path, "qwen3_gqa"), dtype="float32")
  d = train_config.get_config("smoke").drafter
  with pytest.raises(ValueError, match=r"target_layer_ids \[5\] lie outside the target's layers "
                                       r"0..1"):
    recipe.drafter_config(dict_of(d, target_layer_ids="0,5"), target.config, tok)
  with pytest.raises(ValueError, match="block_size must be >= 2"):
    recipe.drafter_config(dict_of(d, block_size=1), target.config, tok)
  with pytest.raises(ValueError, match="mask_token_id 999 is outside the vocabulary"):
    recipe.drafter_config(dict_of(d, mask_token_id=999), target.config, tok)
  no_data = config(target.path, "", str(tmp_path / "w"))
  with pytest.raises(ValueError, match="config.data"):
    recipe.load_data(no_data)


def dict_of(d, **kw):
  d = d.copy_and_resolve_references()
  d.update(**kw)
  return d


@pytest.mark.parametrize("name", ["qwen3_gqa", "qwen3_moe_sparse_step", "dsv3_plain",
                                  "qwen3_5_text"])
def test_one_step_lowers_the_loss_for_every_family(tmp_path, name):
  """Dense, MoE, latent attention and Gated DeltaNet targets: the target's continuations of a
  user's prompts, a drafter of its width tapping its layers, one step that lowers the loss."""
  cfg = config(checkpoint(tmp_path, name), write_corpus(tmp_path / "c.jsonl"),
               str(tmp_path / "w"), num_layers=1, block_size=4)
  target, frozen, tok, train_set, held_set, held, _ = recipe.load_data(cfg)
  assert len(train_set["tokens"]) == 8 and len(held) == 2
  assert np.all(train_set["lens"] > train_set["prompt_lens"])  # the target wrote a continuation
  dcfg = recipe.drafter_config(cfg.drafter, target.config, tok)
  assert dcfg.layers.hidden_size == target.config.hidden_size
  params = losses.init_drafter_params(dcfg, jax.random.key(0), 0.02, final_norm=frozen.final_norm)
  loss_fn = functools.partial(losses.drafter_loss, dcfg=dcfg, tcfg=target.config, gamma=4.0,
                              compute_dtype=jnp.float32)
  batch = {k: jnp.asarray(v) for k, v in data.drafter_batch(
      train_set["tokens"], train_set["lens"], train_set["prompt_lens"], 4, 8, 0, 0).items()}
  tx = train_loop.make_optimizer(1.0, 0.9, 0.95, 0.0)
  step = train_loop.make_step(loss_fn, tx)
  before = float(loss_fn(params, frozen, batch)[0])
  state, _, _ = step({"params": params, "opt_state": tx.init(params)}, frozen, batch, 1e-2)
  after = float(loss_fn(state["params"], frozen, batch)[0])
  assert np.isfinite(before) and after < before - 1e-3, (before, after)


@pytest.mark.parametrize("name", ["qwen3_gqa", "qwen3_5_text"])
def test_captured_features_are_the_targets_and_train_as_a_forward_does(tmp_path, name):
  """regen.capture: the features kept from the forwards that generated each sequence equal a
  forward over the whole sequence, and the loss on them equals the loss through the target."""
  cfg = config(checkpoint(tmp_path, name), write_corpus(tmp_path / "c.jsonl"),
               str(tmp_path / "w"), num_layers=1, block_size=4)
  cfg.regen.capture = True
  target, frozen, tok, train_set, _, _, _ = recipe.load_data(cfg)
  assert frozen.layers == []  # training runs no target layer
  dcfg = recipe.drafter_config(cfg.drafter, target.config, tok)
  feats = train_set["features"]
  for row in range(3):
    n = int(train_set["lens"][row])
    _, taps = losses.target_hidden(target.params, target.config,
                                   jnp.asarray(train_set["tokens"][row:row + 1, :n]),
                                   dcfg.target_layer_ids)
    assert_close_rel(feats[row, :n - 1], taps[0, :n - 1], rel=1e-5)  # float32 sums reordered
  b = data.drafter_batch(train_set["tokens"], train_set["lens"], train_set["prompt_lens"], 4, 8,
                         0, 0)
  rows = b.pop("rows")
  batch = {k: jnp.asarray(v) for k, v in b.items()}
  params = losses.init_drafter_params(dcfg, jax.random.key(0), 0.02, final_norm=frozen.final_norm)
  loss_fn = functools.partial(losses.drafter_loss, dcfg=dcfg, tcfg=target.config, gamma=4.0,
                              compute_dtype=jnp.float32)
  online = float(loss_fn(params, target.params, batch)[0])
  offline = float(loss_fn(params, frozen, dict(batch, features=recipe.feature_rows(feats, rows)))[0])
  assert offline == pytest.approx(online, rel=1e-5)


@pytest.mark.parametrize("capture,mesh", [(False, ()), (True, ("--mesh_dp=2", "--mesh_tp=2"))])
def test_the_script_trains_a_drafter_that_loads_and_stays_lossless(tmp_path, capture, mesh):
  """End to end, on one device and on a 2 x 2 mesh of CPU devices (batch over dp, weights over
  tp), from the target's features captured at regeneration or recomputed every step."""
  target_path = checkpoint(tmp_path, "qwen3_gqa", template="{% for m in messages %}<|u|> "
                           "{{ m['content'] }} {% endfor %}<|a|>")
  data_path = write_corpus(tmp_path / "c.jsonl")
  workdir = str(tmp_path / "w")
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.train_drafter", "--config=configs/train_drafter.py:smoke",
       f"--config.target={target_path}", f"--config.data={data_path}",
       f"--config.workdir={workdir}", "--config.regen.num_sequences=8",
       "--config.regen.heldout_sequences=2", "--config.regen.prompt_max=24",
       "--config.regen.new_tokens=16", "--config.regen.batch_size=4",
       "--config.train.num_steps=6", "--config.train.save_every=3",
       "--config.train.eval_every=3", "--config.eval.each_eval=True",
       f"--config.regen.capture={capture}", *mesh],
      cwd=REPO, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  assert summary["steps"] == 6 and summary["heldout_chain_tau"] >= 1.0
  assert summary["heldout_ddtree4_tau"] >= 1.0 and summary["heldout_ddtree8_tau"] >= 1.0
  with open(os.path.join(workdir, "drafter", "metrics.json")) as f:
    evals = json.load(f)["evals"]
  assert [e["step"] for e in evals] == [0, 3, 6] and all("ddtree8_tau" in e for e in evals)
  assert os.path.getsize(os.path.join(workdir, "drafter", "loss.png")) > 0
  target = dj.load_target(target_path, dtype="float32")
  drafter = dj.load_drafter(summary["export"], target, dtype="float32")
  prompts = [[4, 5, 6, 7], [8, 9]]
  ar = dj.generate(target, prompts, max_new_tokens=12, stop_token_ids=()).tokens
  for method, budget in (("chain", None), ("ddtree", 8)):
    assert dj.generate(target, prompts, method=method, budget=budget, drafter=drafter,
                       max_new_tokens=12, stop_token_ids=()).tokens == ar


def test_a_killed_run_resumes_to_the_same_parameters(tmp_path):
  """Training from captured features, stopped after 2 of 4 steps and run again in the same
  workdir, ends with the parameters of a run that was never stopped (bitwise on CPU)."""
  cfg = config(checkpoint(tmp_path, "qwen3_moe_sparse_step"), write_corpus(tmp_path / "c.jsonl"),
               str(tmp_path / "w"), num_layers=1, block_size=4)
  cfg.regen.capture = True
  target, frozen, tok, train_set, _, _, _ = recipe.load_data(cfg)
  dcfg = recipe.drafter_config(cfg.drafter, target.config, tok)
  loss_fn = functools.partial(losses.drafter_loss, dcfg=dcfg, tcfg=target.config, gamma=4.0,
                              compute_dtype=jnp.float32)

  steps = []

  def batch_fn(step):
    steps.append(step)
    b = data.drafter_batch(train_set["tokens"], train_set["lens"], train_set["prompt_lens"], 4,
                           8, 0, step)
    rows = b.pop("rows")
    return dict({k: jnp.asarray(v) for k, v in b.items()},
                features=jnp.asarray(recipe.feature_rows(train_set["features"], rows)))

  def run(workdir, **over):
    tc = cfg.train.copy_and_resolve_references()
    tc.update(num_steps=4, save_every=2, eval_every=0, log_every=1, progress_bar=False, **over)
    params = losses.init_drafter_params(dcfg, jax.random.key(0), 0.02,
                                        final_norm=frozen.final_norm)
    return train_loop.train(name="drafter", workdir=workdir, params=params, loss_fn=loss_fn,
                            frozen=frozen, batch_fn=batch_fn, eval_fn=None, tc=tc)[0]

  whole = run(str(tmp_path / "whole"))
  run(str(tmp_path / "cut"), stop_at_step=2)
  del steps[:]
  resumed = run(str(tmp_path / "cut"))
  assert steps == [2, 3]  # it went on from the checkpoint, not from the start
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
