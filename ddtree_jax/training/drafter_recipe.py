"""The parts of training a DFlash drafter that are neither its loss nor the loop
(experiments/train_drafter.py runs them): the drafter's config from the target's, the training
data (prompts from the bundled corpus or a user's, the target's own continuations of them, cached
as .npy), and a trained drafter's held-out chain / DDTree tau by generation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import ddtree_jax as dj
from ddtree_jax import chat
from ddtree_jax.checkpoints import files
from ddtree_jax.models.config import ModelConfig
from ddtree_jax.models.drafter import DrafterConfig, default_target_layer_ids
from ddtree_jax.models.registry import config_from_hf
from ddtree_jax.request import GenerateOptions
from ddtree_jax.training import capture, corpus, data


def tap_layers(d, tc: ModelConfig) -> tuple[int, ...]:
  """The target layers the drafter taps: d.target_layer_ids, or the DFlash rule."""
  ids = (tuple(int(x) for x in str(d.target_layer_ids).split(",") if x.strip())
         or default_target_layer_ids(tc.num_layers, d.num_layers))
  bad = [i for i in ids if not 0 <= i < tc.num_layers]
  if bad:
    raise ValueError(f"drafter.target_layer_ids {bad} lie outside the target's layers "
                     f"0..{tc.num_layers - 1}")
  return ids


def drafter_config(d, tc: ModelConfig, tokenizer) -> DrafterConfig:
  """The drafter's config from `d` (configs/train_drafter.py's `drafter`) and the target's
  config: Qwen3-style layers of the target's width (heads, head size and MLP the target's unless
  d sets them), d's block size, tap layers (the DFlash rule when unset) and mask token (the
  tokenizer's <|mask|> when d.mask_token_id < 0)."""
  ids = tap_layers(d, tc)
  if d.block_size < 2:
    raise ValueError(f"drafter.block_size must be >= 2 (the bonus and a draft), got {d.block_size}")
  mask = d.mask_token_id if d.mask_token_id >= 0 else (
      tokenizer.token_to_id(data.MASK) if tokenizer is not None else None)
  if mask is None:
    raise ValueError(f"the target's tokenizer has no {data.MASK} token: set drafter.mask_token_id "
                     "(the id the block's draft positions take, e.g. a reserved token)")
  if not 0 <= mask < tc.vocab_size:
    raise ValueError(f"drafter.mask_token_id {mask} is outside the vocabulary "
                     f"0..{tc.vocab_size - 1}")
  heads = d.num_heads or tc.num_heads
  layers = config_from_hf({
      "model_type": "qwen3", "vocab_size": tc.vocab_size, "hidden_size": tc.hidden_size,
      "intermediate_size": d.intermediate_size or tc.intermediate_size,
      "num_hidden_layers": d.num_layers, "num_attention_heads": heads,
      "num_key_value_heads": d.num_kv_heads or min(tc.num_kv_heads or heads, heads),
      "head_dim": d.head_dim or tc.head_dim or tc.hidden_size // heads,
      "rms_norm_eps": tc.rms_norm_eps, "rope_theta": tc.rope_theta,
      "max_position_embeddings": tc.max_position_embeddings})
  return DrafterConfig(layers=layers, block_size=d.block_size, mask_token_id=mask,
                       target_layer_ids=ids)


def _regen_paths(workdir, split):
  d = os.path.join(workdir, "regen")
  return {k: os.path.join(d, f"{split}_{k}.npy") for k in ("tokens", "lens", "prompt_lens")}


def _features_paths(workdir, split):
  d = os.path.join(workdir, "regen")
  return os.path.join(d, f"{split}_features.npy"), os.path.join(d, f"{split}_features.json")


def regenerate(r, workdir: str, target, prompts, split: str, seed: int, budget_s: float = 0.0,
               stop_token_ids=(), capture_layers: tuple[int, ...] = ()):
  """The target's continuations of `prompts` (int32 arrays) with r (configs/train_drafter.py's
  `regen`): r.new_tokens each, greedy or sampled at r.temperature, cut at stop_token_ids (None:
  the target's own). Cached as .npy under workdir/regen (tokens [N, S] right-padded with EOS,
  lens [N], prompt_lens [N]). With capture_layers, the same forwards' features at those layers
  too (`capture.generate_with_features`), streamed batch by batch into
  workdir/regen/{split}_features.npy [N, S, D] (bfloat16 stored as its uint16 bits; the .json
  beside it says so). With budget_s > 0, stops after the batch that would end past the budget
  (at least one batch) and keeps the sequences made so far."""
  paths = _regen_paths(workdir, split)
  fpath, fmeta = _features_paths(workdir, split)
  if all(os.path.exists(p) for p in paths.values()) and (
      not capture_layers or os.path.exists(fmeta)):
    out = {k: np.load(p) for k, p in paths.items()}
    if capture_layers:
      out["features"] = open_features(workdir, split, capture_layers)
    return out
  count = len(prompts)
  width = max(len(p) for p in prompts) + r.new_tokens
  eos = target.config.eos_token_ids[0] if target.config.eos_token_ids else 0
  tokens = np.full((count, width), eos, np.int32)
  lens = np.zeros((count,), np.int32)
  plens = np.array([len(p) for p in prompts], np.int32)
  features = None
  if capture_layers:
    os.makedirs(os.path.dirname(fpath), exist_ok=True)
    stored = np.uint16 if target.dtype == jnp.bfloat16 else np.float32
    features = np.lib.format.open_memmap(
        fpath + ".partial", mode="w+", dtype=stored,
        shape=(count, width, len(capture_layers) * target.config.hidden_size))
  t0 = t_batch = time.perf_counter()
  for i in range(0, count, r.batch_size):
    chunk = prompts[i:i + r.batch_size]
    pad = r.batch_size - len(chunk)             # one batch shape: one compiled program
    batch = [p.tolist() for p in chunk] + [chunk[0].tolist()] * pad
    options = dict(max_new_tokens=r.new_tokens, stop_token_ids=stop_token_ids,
                   attention=r.attention, temperature=r.temperature, seed=seed + i)
    with jax.default_matmul_precision(r.matmul_precision):
      if capture_layers:
        outs, feats = capture.generate_with_features(target, batch, capture_layers,
                                                     GenerateOptions(**options))
      else:
        outs = dj.generate(target, batch, method="ar", **options).tokens
    for j, (p, out) in enumerate(zip(chunk, outs)):
      seq = np.concatenate([p, np.asarray(out, np.int32)])
      tokens[i + j, :len(seq)] = seq
      lens[i + j] = len(seq)
      if capture_layers:
        f = feats[j]
        features[i + j, :len(f)] = f.view(np.uint16) if stored == np.uint16 else f
    done = min(i + r.batch_size, count)
    elapsed, last = time.perf_counter() - t0, time.perf_counter() - t_batch
    t_batch = time.perf_counter()
    print(f"[regen {split}] {done}/{count} sequences ({elapsed:.1f} s)", flush=True)
    if budget_s and i and done < count and elapsed + last > budget_s:   # i > 0: past the compile
      print(f"[regen {split}] stopping at {done} sequences: the {budget_s:.0f} s budget",
            flush=True)
      tokens, lens, plens = tokens[:done], lens[:done], plens[:done]
      break
  os.makedirs(os.path.dirname(paths["tokens"]), exist_ok=True)
  out = {"tokens": tokens, "lens": lens, "prompt_lens": plens}
  for k, p in paths.items():
    files.save_npy(p, out[k])
  if capture_layers:
    features.flush()
    del features
    os.replace(fpath + ".partial", fpath)
    files.write_json(fmeta, {"dtype": "bfloat16" if stored == np.uint16 else "float32",
                             "layer_ids": list(capture_layers), "rows": len(tokens)})
    out["features"] = open_features(workdir, split, capture_layers)
  return out


def open_features(workdir: str, split: str, layer_ids) -> np.ndarray:
  """The captured features of a split, memory-mapped ([N, S, D], as stored); ValueError when
  they were captured at other layers than `layer_ids`."""
  fpath, fmeta = _features_paths(workdir, split)
  with open(fmeta) as f:
    meta = json.load(f)
  if tuple(meta["layer_ids"]) != tuple(layer_ids):
    raise ValueError(f"{fpath} holds features of layers {meta['layer_ids']}, not the drafter's "
                     f"{list(layer_ids)}: remove {os.path.dirname(fpath)} to capture them again")
  return np.load(fpath, mmap_mode="r")[:meta["rows"]]


def feature_rows(features: np.ndarray, rows) -> np.ndarray:
  """The features of `rows`, read into memory (bfloat16 from its stored bits)."""
  x = np.ascontiguousarray(features[np.asarray(rows)])
  return x.view(jnp.bfloat16) if x.dtype == np.uint16 else x


def split_prompts(prompts, heldout: int, seed: int):
  """(train, held-out) prompts: `heldout` of them chosen at random and kept apart (at least one
  left for training)."""
  order = np.random.default_rng(seed).permutation(len(prompts))
  k = min(heldout, len(prompts) - 1)
  return [prompts[i] for i in order[k:]], [prompts[i] for i in order[:k]]


def load_data(cfg, mesh=None, rules=None):
  """What training needs (configs/train_drafter.py's config): (target, the frozen target params,
  tokenizer, train set, held-out set, held-out prompts, regeneration seconds), of the bundled
  workdir (cfg.target "") or of the checkpoint cfg.target and the corpus cfg.data. With
  regen.capture the sets hold the target's features ("features", memory-mapped) and the frozen
  params only its embedding and lm_head (training runs no target layer). The target is laid out
  on `mesh` by `rules` when given (its continuations are generated there)."""
  r = cfg.regen
  if cfg.target:
    target = dj.load_target(cfg.target, dtype=r.dtype, mesh=mesh, rules=rules)
    if target.tokenizer is None:
      raise ValueError(f"{cfg.target}: no tokenizer.json; drafter training reads text prompts")
    if not cfg.data:
      raise ValueError("config.data: the corpus file of prompts (JSONL or text) is not set")
    template, special = (chat.load_chat_template(cfg.target) if chat.has_chat_template(cfg.target)
                         else (None, {}))
    prompts = corpus.read_prompts(cfg.data, target.tokenizer, template, special, r.prompt_max)
    train, held = split_prompts([np.asarray(p, np.int32) for p in prompts],
                                r.heldout_sequences, cfg.seed)
    train, tok, stop, source = train[:r.num_sequences], target.tokenizer, None, cfg.target
  else:
    with open(os.path.join(cfg.workdir, "data", "corpus.json")) as f:
      settings = json.load(f)["settings"]
    tok, train_tokens, heldout_tokens = data.prepare_corpus(cfg.workdir, **settings)
    source = os.path.join(cfg.workdir, "target", "hf")
    target = dj.load_target(source, dtype=r.dtype, mesh=mesh, rules=rules)
    train = data.prompt_windows(train_tokens, r.num_sequences, r.prompt_min, r.prompt_max,
                                cfg.seed)
    held = data.prompt_windows(heldout_tokens, r.heldout_sequences, r.prompt_min, r.prompt_max,
                               cfg.seed + 1)
    stop = ()  # the bundled target's continuations run past its end-of-text, as it was trained
  layers = tap_layers(cfg.drafter, target.config) if r.capture else ()
  t0 = time.perf_counter()
  train_set = regenerate(r, cfg.workdir, target, train, "train", cfg.seed, r.time_budget_s, stop,
                         layers)
  held_set = regenerate(r, cfg.workdir, target, held, "heldout", cfg.seed + 1, 0.0, stop, layers)
  seconds = time.perf_counter() - t0
  frozen = (target.params if target.dtype == jnp.dtype(cfg.train.target_dtype)
            else dj.load_target(source, dtype=cfg.train.target_dtype, mesh=mesh,
                                rules=rules).params)
  if r.capture:  # training reads the captured features: of the target it needs the vocabulary
    frozen = dataclasses.replace(frozen, layers=[])
  return target, frozen, tok, train_set, held_set, held, seconds


def heldout_tau(target, drafter, prompts, budgets, new_tokens: int, batch: int) -> dict:
  """{chain_tau, ddtree<B>_tau for B in budgets}: tokens per step of `drafter` when generating
  new_tokens after each held-out prompt (int arrays), `batch` at a time."""
  out = {}
  for method, budget in [("chain", None)] + [("ddtree", b) for b in budgets]:
    steps = tokens = 0
    for i in range(0, len(prompts), batch):
      res = dj.generate(target, [p.tolist() for p in prompts[i:i + batch]], method=method,
                        budget=budget, drafter=drafter, max_new_tokens=new_tokens,
                        stop_token_ids=())
      lens = res.stats["acceptance_lengths"]
      steps, tokens = steps + sum(map(len, lens)), tokens + sum(map(sum, lens))
    out["chain_tau" if budget is None else f"ddtree{budget}_tau"] = tokens / max(steps, 1)
  return out
