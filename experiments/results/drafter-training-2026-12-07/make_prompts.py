"""Prompts for retraining the bundled drafter: windows of the stdlib's train split (the split the
shipped pair was trained on), each starting at a line, as {"text": ...} records."""
import json, sys
import numpy as np
from ddtree_jax.training import data
docs = [t for _, t in data.read_split("train")]
g = np.random.default_rng(0)
out = []
while len(out) < int(sys.argv[2]):
  text = docs[g.integers(len(docs))]
  lines = text.splitlines(keepends=True)
  if len(lines) < 4:
    continue
  i = g.integers(len(lines) - 2)
  chars = int(g.integers(48, 320))  # ~16-96 tokens of this BPE
  w = "".join(lines[i:])[:chars]
  if w.strip():
    out.append(json.dumps({"text": w}))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
print(len(out), "prompts from", len(docs), "train files")
