"""Quality measures of a code LM on held-out files (the bundled pair's evaluation,
eval_default.py): perplexity and bits per byte, the share of greedy function bodies that
parse, and two repetition measures of completions: the share of distinct lines and how well
the text compresses (degenerate repetition scores low on the first and high on the second).

Bits per byte compare models with different tokenizers; perplexity is per token of the model's
own tokenizer. A function body "parses" when `ast.parse` accepts the signature plus the greedy
completion cut where the function ends (the first non-blank line indented no deeper than the
`def`); a completion still inside the function at the token limit loses its last, possibly cut,
line first.
"""

from __future__ import annotations

import ast
import math
import textwrap
import zlib

import numpy as np

import ddtree_jax as dj


def perplexity(target, docs: list[str], window: int | None = None, batch: int = 16) -> dict:
  """Over documents [text]: each tokenized, cut into windows of the model's positions (or
  `window`), every token after a window's first scored. Returns tokens, bytes, nats, ppl,
  bits_per_byte."""
  tok = target.tokenizer
  window = window or target.config.max_position_embeddings
  rows, nbytes = [], 0
  for text in docs:
    ids = tok.encode(text).ids
    nbytes += len(text.encode("utf-8"))
    for s in range(0, max(len(ids) - 1, 0), window):
      chunk = ids[s:s + window]
      if len(chunk) >= 2:
        rows.append(chunk)
  nats, count = 0.0, 0
  for i in range(0, len(rows), batch):
    part = rows[i:i + batch]
    t = max(len(r) for r in part)
    ids = np.zeros((len(part), t), np.int32)
    for j, r in enumerate(part):
      ids[j, :len(r)] = r
    logits = np.asarray(dj.forward_logits(target, ids), np.float64)
    peak = logits.max(-1, keepdims=True)
    logp = logits - peak - np.log(np.exp(logits - peak).sum(-1, keepdims=True))
    for j, r in enumerate(part):
      nats -= float(np.take_along_axis(logp[j, :len(r) - 1], np.asarray(r[1:])[:, None],
                                       axis=-1).sum())
      count += len(r) - 1
  return {"tokens": count, "bytes": nbytes, "nats": nats,
          "ppl": math.exp(nats / count) if count else float("nan"),
          "bits_per_byte": nats / math.log(2) / nbytes if nbytes else float("nan")}


def signatures(docs: list[str], n: int, seed: int = 0) -> list[tuple[str, int]]:
  """`n` function signatures from the documents, in a seeded random order: (the `def` lines
  through the colon, without the final newline, which the model writes itself: a prompt that
  ends in "\n" splits the newline from the body's indentation, a token boundary BPE models
  rarely see in code; the def's indentation). Decorators are left out; a def whose body starts
  on its own last line is skipped."""
  found = []
  for text in docs:
    try:
      tree = ast.parse(text)
    except SyntaxError:
      continue
    lines = text.splitlines(keepends=True)
    for node in ast.walk(tree):
      if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
        continue
      first, body = node.lineno - 1, node.body[0].lineno - 1
      if body <= first or body - first > 6:
        continue
      sig = "".join(lines[first:body])
      if not sig.rstrip().endswith(":"):  # a comment or docstring-only line between
        continue
      found.append((sig.rstrip("\n"), node.col_offset))
  order = np.random.default_rng(seed).permutation(len(found))
  return [found[i] for i in order[:n]]


def cut_body(completion: str, indent: int, hit_limit: bool) -> str:
  """The lines of `completion` (which continues the signature's line) that belong to the
  function: up to the first non-blank line indented no deeper than the def (or the end; without
  the last line when `hit_limit`)."""
  out = []
  lines = completion.splitlines(keepends=True)
  for i, line in enumerate(lines):
    if line.strip() and len(line) - len(line.lstrip()) <= indent:
      return "".join(out)
    out.append(line)
    if hit_limit and i == len(lines) - 1:
      out.pop()
  return "".join(out)


def body_parses(signature: str, body: str) -> bool:
  """Does ast.parse accept the dedented function, with a body of at least one statement?"""
  try:
    tree = ast.parse(textwrap.dedent(signature + body))
  except (SyntaxError, ValueError):
    return False
  fn = tree.body[0] if tree.body else None
  return isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(fn.body) >= 1


def parse_rate(target, docs: list[str], n: int = 100, max_new_tokens: int = 128,
               seed: int = 0, batch: int = 25) -> dict:
  """Greedy completions of `n` held-out signatures: {"n", "parsed", "rate", "examples"}."""
  tok = target.tokenizer
  sigs = signatures(docs, n, seed)
  ok, examples = [], []
  for i in range(0, len(sigs), batch):
    part = sigs[i:i + batch]
    res = dj.generate(target, [tok.encode(s).ids for s, _ in part],
                      max_new_tokens=max_new_tokens)
    for (sig, indent), out in zip(part, res.tokens):
      eos_hit = bool(out) and out[-1] in target.config.eos_token_ids
      text = tok.decode([t for t in out if t not in target.config.eos_token_ids])
      body = cut_body(text, indent, hit_limit=len(out) >= max_new_tokens and not eos_hit)
      ok.append(body_parses(sig, body))
      if len(examples) < 5:
        examples.append({"signature": sig, "body": body, "parses": ok[-1]})
  return {"n": len(ok), "parsed": int(sum(ok)), "rate": float(np.mean(ok)) if ok else 0.0,
          "examples": examples}


def distinct_line_share(texts: list[str]) -> float:
  """Mean over the texts with a non-blank line of (distinct stripped non-blank lines) / (non-blank
  lines): 1.0 when no line repeats, near 0 for one line written over and over."""
  shares = []
  for text in texts:
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    if lines:
      shares.append(len(set(lines)) / len(lines))
  return float(np.mean(shares)) if shares else 0.0


def compression_ratio(texts: list[str]) -> float:
  """Mean over the non-empty texts of len(text) / len(zlib(text)) in bytes: near 2-3 for
  source code, far higher for one token written over and over."""
  ratios = [len(t.encode()) / len(zlib.compress(t.encode(), 9)) for t in texts if t]
  return float(np.mean(ratios)) if ratios else 0.0
