"""The bundled default pair loads with the real-checkpoint loaders, decodes losslessly, and the
demo (`make demo` = python -m experiments.generate) runs end to end on it."""

import json
import os
import subprocess
import sys

import ddtree_jax as dj

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_default_pair_is_shipped_and_lossless():
  target, drafter = dj.load_default()
  tok = target.tokenizer
  assert tok is not None and tok.token_to_id("<|mask|>") == drafter.config.mask_token_id
  assert drafter.config.block_size == 16
  prompts = [tok.encode("def is_palindrome(s):\n").ids, tok.encode("import os\n\n\ndef ").ids]
  run = lambda **kw: dj.generate(target, prompts, max_new_tokens=24, stop_token_ids=(), **kw)
  ar = run()
  for kw in (dict(method="chain"), dict(method="ddtree", budget=16)):
    res = run(drafter=drafter, **kw)
    assert res.tokens == ar.tokens, kw
    assert res.stats["tau"] > 1.0  # the trained drafter gets accepted


def test_demo_runs_and_ends_with_json():
  out = subprocess.run(
      [sys.executable, "-m", "experiments.generate", "--config=configs/default.py",
       "--config.max_new_tokens=8", "--config.budgets=8"],
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  last = json.loads(out.stdout.strip().splitlines()[-1])
  methods = {(r["method"], r["budget"]) for r in last["results"]}
  assert methods == {("ar", None), ("chain", None), ("ddtree", 8)}
  for r in last["results"]:
    assert r["tau"] >= 1.0 and r["tokens_per_second"] > 0
  assert "is_palindrome" in out.stdout
