"""experiments/quality.py: held-out perplexity and the function-body parse check."""

import math
import os

import numpy as np

import ddtree_jax as dj
from conftest import FIXTURES
from experiments import quality

DOC = '''import os


def first(a, b=2):
    """Docstring."""
    return a + b


class K:
    def method(self,
               x):
        if x:
            return 1
        return 0

    def one_liner(self): return 3
'''


def test_signatures_are_the_def_lines_through_the_colon():
  sigs = dict(quality.signatures([DOC, "def broken(:\n"], 10))
  assert set(sigs) == {"def first(a, b=2):", "    def method(self,\n               x):"}
  assert sigs["    def method(self,\n               x):"] == 4


def test_the_body_ends_where_the_indentation_does():
  sig = "    def method(self, x):"
  completion = "\n        if x:\n            return 1\n\n        return 0\n    def other(self):\n"
  body = quality.cut_body(completion, 4, hit_limit=False)
  assert body == "\n        if x:\n            return 1\n\n        return 0\n"
  assert quality.body_parses(sig, body)
  cut = quality.cut_body("\n        y = [1,\n             2", 4, hit_limit=True)
  assert cut == "\n        y = [1,\n" and not quality.body_parses(sig, cut)
  assert not quality.body_parses(sig, quality.cut_body("\n        return (1 +", 4, True))
  assert not quality.body_parses(sig, "\n\n")            # no statement
  assert not quality.body_parses(sig, "\n        return ]\n")


def test_perplexity_matches_a_direct_computation():
  target = dj.load_target(os.path.join(FIXTURES, "qwen3_gqa"), dtype="float32")
  text = "def f(x):\n    return x + 1\n" * 8
  got = quality.perplexity(target, [text], window=32)
  ids = target.tokenizer.encode(text).ids
  nats = 0.0
  for s in range(0, len(ids) - 1, 32):
    chunk = ids[s:s + 32]
    if len(chunk) < 2:
      continue
    logits = np.asarray(dj.forward_logits(target, [chunk])[0], np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nats -= sum(logp[i, chunk[i + 1]] for i in range(len(chunk) - 1))
  assert math.isclose(got["nats"], nats, rel_tol=1e-6)
  assert math.isclose(got["bits_per_byte"], nats / math.log(2) / len(text.encode()), rel_tol=1e-6)
  assert got["ppl"] == math.exp(got["nats"] / got["tokens"])


def test_distinct_line_share_scores_repetition_low():
  assert quality.distinct_line_share(["a = 1\nb = 2\n\n", "x\n"]) == 1.0
  assert quality.distinct_line_share(["pass\n" * 10]) == 0.1
  assert quality.distinct_line_share(["a\n  a\nb\n"]) == 2 / 3
  assert quality.distinct_line_share(["", "\n\n"]) == 0.0


def test_compression_ratio_flags_repetition():
  code = open(quality.__file__).read()[:1500]
  assert 1.5 < quality.compression_ratio([code]) < 4
  assert quality.compression_ratio(["self." * 300]) > 20
  assert quality.compression_ratio([""]) == 0.0
