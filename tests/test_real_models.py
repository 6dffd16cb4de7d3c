"""README's "Run a real model": its memory figures are what the engine's own layouts give for the
published configs (weights counted from `decoder.init_params`' shapes, caches from
`ModelConfig.cache_layout`), and its command is one the scripts accept."""

import dataclasses
import os
import re
import shlex

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.models import decoder
from ddtree_jax.models.config import ModelConfig
from experiments import workflow
from experiments.perf import harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The published targets' config.json fields that shape their weights and caches.
TARGETS = {
    "Qwen/Qwen3-4B": ModelConfig(
        model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "Qwen/Qwen3-8B": harness.target_config(shape="qwen3-8b"),
    "meta-llama/Llama-3.1-8B-Instruct": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=False),
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": dataclasses.replace(
        harness.target_config(shape="qwen3-30b-a3b"), intermediate_size=5472),
}
GIB, MIB = 2 ** 30, 2 ** 20


def _section() -> str:
  with open(os.path.join(REPO, "README.md")) as f:
    text = f.read()
  return text[text.index("## Run a real model"):text.index("## Install")]


def _bytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _weights(cfg: ModelConfig, experts: str = "float") -> int:
  return _bytes(jax.eval_shape(lambda: decoder.init_params(cfg, jax.random.key(0), jnp.bfloat16,
                                                           experts=experts)))


def _kv_per_1k(cfg: ModelConfig) -> int:
  """Bytes of K/V (or latent) rows per 1024 tokens of one sequence, bf16, attention layers only."""
  heads, k, v = cfg.cache_layout
  return len(cfg.attention_layers) * heads * (k + v) * 2 * 1024


@pytest.mark.parametrize("hub_id", sorted(TARGETS))
def test_the_memory_table_is_the_engines_layout_of_each_config(hub_id):
  """A row: bf16 weights of target + a 5-layer drafter of its width (GiB), K/V per 1k tokens of
  target + drafter (MiB)."""
  cfg = TARGETS[hub_id]
  dcfg = harness.drafter_config(cfg)
  drafter = _bytes(jax.eval_shape(lambda: harness.random_drafter_params(cfg, dcfg,
                                                                        jax.random.key(1))))
  d = dcfg.layers
  draft_kv = d.num_layers * d.num_kv_heads * d.head_dim * 2 * 2 * 1024
  row = (f"| `{hub_id}` |", f"| {_weights(cfg) / GIB:.1f} + {drafter / GIB:.1f} GiB | "
         f"{_kv_per_1k(cfg) / MIB:.0f} + {draft_kv / MIB:.0f} MiB |")
  line = next(l for l in _section().splitlines() if l.startswith(row[0]))
  assert line.endswith(row[1]), (line, row)


def test_the_hybrid_and_kimi_figures_are_the_engines_layout_of_their_shapes():
  text = " ".join(_section().split())
  hybrid = harness.target_config(shape="qwen3.5-9b")
  assert f"{_weights(hybrid) / GIB:.1f} GiB of text-model weights" in text
  assert f"= {_kv_per_1k(hybrid) / MIB:.0f} MiB per 1k tokens" in text
  assert f"a {harness.recurrent_bytes(hybrid) / 2 / MIB:.0f} MiB recurrent state" in text
  kimi = harness.target_config(shape="kimi-k2.6")
  assert f"= {_kv_per_1k(kimi) / MIB:.0f} MiB per 1k tokens" in text
  assert f"about {_weights(kimi, experts='int4') / GIB:.0f} GiB of weights" in text


def test_the_run_command_is_one_the_scripts_accept(tmp_path):
  """The section's experiments.generate command, its /models folders made here (a config.json
  each): the config loads and plans AR, chain and DDTree at its budgets."""
  block = re.search(r"```sh\n(python -m experiments\.generate .*?)```", _section(), re.S).group(1)
  args = shlex.split(block.replace("\\\n", " ").replace("/models/", f"{tmp_path}/"))
  spec = next(a.split("=", 1)[1] for a in args if a.startswith("--config="))
  overrides = dict(a[len("--config."):].split("=", 1) for a in args if a.startswith("--config."))
  for key in ("target", "drafter"):
    os.makedirs(overrides[key])
    open(os.path.join(overrides[key], "config.json"), "w").close()
  plan = workflow.validate(workflow.load_config(spec, overrides))
  assert plan.runs == (("ar", None), ("chain", None), ("ddtree", 32), ("ddtree", 64))
