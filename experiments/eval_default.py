"""Evaluates a target + DFlash drafter pair (default: the bundled one) on held-out stdlib prompts.

  python -m experiments.eval_default [--model_dir=ddtree_jax/default_model] [--batch_size=1]

Prompts: `num_prompts` windows of `prompt_min`..`prompt_max` tokens that start at a line of the
held-out stdlib files (ddtree_jax/training/data.py split). Runs AR, chain and DDTree at each budget at T=0,
checks that every method's output equals AR's token for token (float32: asserted; otherwise counted),
prints a table (tau, tokens/s, speed-up vs AR) and writes a JSON.
"""

import json
import os
import time

from absl import app
from absl import flags

import numpy as np

import ddtree_jax as dj
from ddtree_jax import engine
from ddtree_jax.training import data
from ddtree_jax.checkpoints import files
from ddtree_jax.models import drafter as drafter_lib
from experiments import quality as quality_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DIR = flags.DEFINE_string("model_dir", os.path.join(REPO, "ddtree_jax", "default_model"),
                           "folder with target/ and drafter/ (HF + z-lab formats)")
_DTYPE = flags.DEFINE_string("dtype", "float32", "float32 (outputs must match AR) or bfloat16")
_N = flags.DEFINE_integer("num_prompts", 16, "held-out prompts")
_PMIN = flags.DEFINE_integer("prompt_min", 64, "shortest prompt (tokens)")
_PMAX = flags.DEFINE_integer("prompt_max", 128, "longest prompt (tokens)")
_NEW = flags.DEFINE_integer("max_new_tokens", 128, "tokens generated per prompt")
_BUDGETS = flags.DEFINE_string("budgets", "8,16,32,64", "DDTree budgets")
_BATCH = flags.DEFINE_integer("batch_size", 1, "prompts per generate call (1: latency setting)")
_ATTN = flags.DEFINE_string("attention", "", "xla | pallas | '' (engine default)")
_SEED = flags.DEFINE_integer("seed", 0, "prompt sampling seed")
_OUT = flags.DEFINE_string("out", "out/eval_default.json", "JSON results")
_INT8 = flags.DEFINE_bool("drafter_int8", False, "int8 (W8A8) drafter (drafter.quantize_int8)")
_VOCAB = flags.DEFINE_integer("draft_vocab_frequent", 0, "draft over the N most frequent tokens "
                              "of the train split only (drafter.restrict_vocab); 0 = all")
_SHOW = flags.DEFINE_integer("show", 1, "print this many prompts with their continuation")
_PPL = flags.DEFINE_bool("perplexity", True, "held-out perplexity and bits per byte")
_SIGS = flags.DEFINE_integer("signatures", 100, "held-out function signatures whose greedy body "
                             "must parse (0 = skip)")
_PACKAGES = flags.DEFINE_string("packages", "deps", "held-out files of these packages' sources "
                                "too (comma list, 'deps' = data.DEPENDENCIES; '' = stdlib only)")
_SPEED = flags.DEFINE_bool("decode", True, "AR / chain / DDTree decoding (tau, tok/s)")


def heldout_prompts(tokenizer, n, lo, hi, seed):
  """n prompts from held-out files, each starting at a line start, lengths uniform in [lo, hi]."""
  docs = [t for _, t in data.read_split("heldout")]
  if not docs:
    raise ValueError("no held-out stdlib files found")
  rng = np.random.default_rng(seed)
  prompts = []
  while len(prompts) < n:
    text = docs[len(prompts) % len(docs)]
    lines = text.splitlines(keepends=True)
    start = int(rng.integers(0, max(len(lines) - 20, 1)))
    ids = tokenizer.encode("".join(lines[start:])).ids
    length = int(rng.integers(lo, hi + 1))
    if len(ids) >= length:
      prompts.append(ids[:length])
    elif len(docs) == 1 and start == 0:
      raise ValueError("held-out text is too short for the prompt length")
  return prompts


def run(target, drafter, prompts, method, budget):
  kw = dict(method=method, max_new_tokens=_NEW.value, temperature=0.0, stop_token_ids=None,
            drafter=drafter if method != "ar" else None, budget=budget,
            attention=_ATTN.value or None)
  tokens, steps_tau, new, seconds, compile_s = [], [], 0, 0.0, 0.0
  for i in range(0, len(prompts), _BATCH.value):
    res = dj.generate(target, prompts[i:i + _BATCH.value], **kw)
    tokens += res.tokens
    steps_tau += [a for seq in res.stats["acceptance_lengths"] for a in seq]
    new += sum(len(t) - 1 for t in res.tokens)         # tokens emitted by the decode loop
    seconds += res.stats["decode_seconds"]
    compile_s += res.stats["compile_seconds"]
  return tokens, {"method": method, "budget": budget,
                  "tau": float(np.mean(steps_tau)) if steps_tau else 0.0,
                  "tokens_per_second": new / seconds if seconds else 0.0,
                  "decode_seconds": seconds, "compile_seconds": compile_s}


engine.define_compilation_cache_flags()


def main(_):
  engine.compilation_cache_from_flags()
  t0 = time.perf_counter()
  if os.path.dirname(_OUT.value):
    os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
  target = dj.load_target(os.path.join(_DIR.value, "target"), dtype=_DTYPE.value)
  tok = target.tokenizer
  vocab = None
  if _VOCAB.value:
    train = data.encode_documents(tok, [t for _, t in data.read_split("train")])
    vocab = drafter_lib.frequent_tokens(train, _VOCAB.value, target.config.vocab_size)
    print(f"draft vocab: the {len(vocab)} most frequent of {target.config.vocab_size} ids cover "
          f"{np.isin(train, vocab).mean():.1%} of the {len(train)} train-split tokens")
  drafter = dj.load_drafter(os.path.join(_DIR.value, "drafter"), target, int8=_INT8.value,
                            draft_vocab=vocab)
  quality = {}
  stdlib_docs = [t for _, t in data.read_split("heldout")]
  packages = data.resolve_packages(_PACKAGES.value)
  dep_docs = [t for _, t in data.read_split("heldout", packages=packages)][len(stdlib_docs):]
  if _PPL.value:
    quality["perplexity_stdlib"] = quality_lib.perplexity(target, stdlib_docs)
    if dep_docs:
      quality["perplexity_packages"] = quality_lib.perplexity(target, dep_docs)
    for k in ("perplexity_stdlib", "perplexity_packages"):
      if k in quality:
        print(f"{k}: ppl {quality[k]['ppl']:.3f} over {quality[k]['tokens']} tokens, "
              f"{quality[k]['bits_per_byte']:.4f} bits/byte", flush=True)
  if _SIGS.value:
    quality["signatures"] = quality_lib.parse_rate(target, stdlib_docs + dep_docs, _SIGS.value,
                                                   seed=_SEED.value)
    q = quality["signatures"]
    print(f"signatures: {q['parsed']} of {q['n']} greedy bodies parse ({q['rate']:.0%})",
          flush=True)
    for ex in q["examples"][:_SHOW.value]:
      print(f"--- {'parses' if ex['parses'] else 'does not parse'}\n{ex['signature']}{ex['body']}"
            "---")
  if not _SPEED.value:
    files.write_json(_OUT.value, {"model_dir": _DIR.value, "quality": quality}, indent=1)
    return
  prompts = heldout_prompts(tok, _N.value, _PMIN.value, _PMAX.value, _SEED.value)
  runs = [("ar", None), ("chain", None)] + [("ddtree", int(b)) for b in _BUDGETS.value.split(",")
                                            if b.strip()]
  results, reference = [], None
  for method, budget in runs:
    outs, stats = run(target, drafter, prompts, method, budget)
    if reference is None:
      reference = outs
    diff = [i for i, (a, b) in enumerate(zip(outs, reference)) if a != b]
    stats["mismatched_prompts"] = diff
    results.append(stats)
    name = method if budget is None else f"{method}/B={budget}"
    print(f"{name}: tau {stats['tau']:.2f}, {stats['tokens_per_second']:.1f} tok/s, "
          f"{len(diff)} outputs differ from AR", flush=True)
  for p, out in list(zip(prompts, reference))[:_SHOW.value]:
    print(f"--- prompt ({len(p)} tokens)\n{tok.decode(p)}\n--- continuation (AR = every method)\n"
          f"{tok.decode(out)}\n---")
  texts = [tok.decode(o) for o in reference]
  quality["distinct_lines"] = quality_lib.distinct_line_share(texts)
  quality["compression_ratio"] = quality_lib.compression_ratio(texts)
  print(f"completions: {quality['distinct_lines']:.0%} distinct lines, compress "
        f"{quality['compression_ratio']:.1f}x (zlib)")
  base = results[0]["tokens_per_second"] or 1.0
  print(f"\n{'method':<14}{'tau':>7}{'tok/s':>10}{'speed-up':>10}{'same':>6}")
  for r in results:
    r["speedup_vs_ar"] = r["tokens_per_second"] / base
    name = r["method"] if r["budget"] is None else f"{r['method']}/B={r['budget']}"
    print(f"{name:<14}{r['tau']:>7.2f}{r['tokens_per_second']:>10.1f}{r['speedup_vs_ar']:>9.2f}x"
          f"{str(not r['mismatched_prompts']):>6}")
  chain = next(r["tau"] for r in results if r["method"] == "chain")
  b32 = next((r["tau"] for r in results if r["budget"] == 32), None)
  summary = {"model_dir": _DIR.value, "dtype": _DTYPE.value, "num_prompts": len(prompts),
             "prompt_tokens": [len(p) for p in prompts], "max_new_tokens": _NEW.value,
             "batch_size": _BATCH.value, "attention": _ATTN.value or "default",
             "drafter_int8": _INT8.value, "draft_vocab": _VOCAB.value or None,
             "chain_tau": chain, "ddtree32_over_chain_tau": (b32 / chain) if b32 and chain else None,
             "seconds": time.perf_counter() - t0, "quality": quality, "results": results}
  files.write_json(_OUT.value, summary, indent=1)
  print(json.dumps({k: v for k, v in summary.items()
                    if k not in ("results", "prompt_tokens", "quality")}))
  bad = [r for r in results if r["mismatched_prompts"]]
  if bad and _DTYPE.value == "float32":
    raise SystemExit(f"outputs differ from AR in float32: {[(r['method'], r['budget']) for r in bad]}")


if __name__ == "__main__":
  app.run(main)
