"""Default run: the tiny model bundled with the repo (`make demo`).

Override from the command line, e.g. --config.max_new_tokens=64 --config.target=/path/to/Qwen3-8B.
"""

import os

import ml_collections

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_config():
  c = ml_collections.ConfigDict()
  c.target = os.environ.get("DDTREE_TARGET", os.path.join(REPO, "tests/fixtures/hf/qwen3_gqa"))
  c.drafter = os.environ.get("DDTREE_DRAFTER", "")   # empty: AR only
  c.dtype = "float32"
  c.methods = "ar"                                   # comma list of ar, chain, ddtree
  c.budgets = "8,32"                                 # ddtree budgets
  c.prompts = ("def is_palindrome(s):", "def fib(n):", "import os\n")
  c.max_new_tokens = 32
  c.temperature = 0.0
  c.attention = ""                                   # "" = pallas on GPU, xla on CPU
  return c
