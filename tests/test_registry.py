"""The package's structure: no import cycle, no import hidden inside a function, and a model family
added from outside the engine (a registry entry defined here) loads and decodes."""

import ast
import dataclasses
import json
import os
import pathlib

import jax
import numpy as np
import pytest

import ddtree_jax as dj
from ddtree_jax.checkpoints.safetensors_io import read_safetensors, write_safetensors
from ddtree_jax.checkpoints.tensor_reader import Stacked
from ddtree_jax.models import qwen3, registry
from ddtree_jax.models.config import decoder_config
from ddtree_jax.models.decoder import LayerParams, Params
from ddtree_jax.models.family import Family
from tests.helpers import write_target

PACKAGE = pathlib.Path(dj.__file__).parent


def _modules():
  """{module name: parsed source} of every module of the package."""
  out = {}
  for path in PACKAGE.rglob("*.py"):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    out[name] = (path, ast.parse(path.read_text()))
  return out


def _imported(module: str, is_package: bool, node, modules) -> list[str]:
  """The package modules an import statement loads (for `from a import b`, a.b when it is a
  module, else a)."""
  if isinstance(node, ast.Import):
    return [a.name for a in node.names if a.name in modules]
  base = node.module or ""
  if node.level:
    parent = module.split(".") if is_package else module.split(".")[:-1]
    base = ".".join(parent[:len(parent) - node.level + 1] + ([base] if base else []))
  return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
          if f"{base}.{a.name}" in modules or base in modules]


def _top_imports(tree):
  """The import statements a module runs as it loads: at its top level, and inside top-level
  if / try / with blocks (a `TYPE_CHECKING` import is a cycle for readers and tools too)."""
  for node in tree.body:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      yield node
    elif isinstance(node, (ast.If, ast.Try, ast.With)):
      yield from (n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))


def _graph():
  """Module -> the package modules it imports at its top level, plus its parent subpackages
  (importing a.b.c runs a/b/__init__ first); and the imports placed inside functions, as
  (module, function, imported). The top package's __init__, the public API, runs first too, but
  it only gathers names: a module that imported a name from it would show as an edge to it."""
  modules = _modules()
  edges, inner = {}, []
  for name, (path, tree) in modules.items():
    is_package = path.name == "__init__.py"
    deps = set()
    for node in _top_imports(tree):
      deps.update(_imported(name, is_package, node, modules))
    parts = name.split(".")
    deps.update(".".join(parts[:i]) for i in range(2, len(parts)))
    edges[name] = deps - {name}
    for fn in ast.walk(tree):
      if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for node in ast.walk(fn):
          if isinstance(node, (ast.Import, ast.ImportFrom)):
            inner += [(name, fn.name, m) for m in _imported(name, is_package, node, modules)]
  return edges, inner


def _cycle(edges):
  """One import cycle as a list of modules, or None."""
  state, stack = {}, []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for d in sorted(edges.get(m, ())):
      if state.get(d) == "open":
        return stack[stack.index(d):] + [d]
      if d not in state and (found := visit(d)):
        return found
    stack.pop()
    state[m] = "done"
    return None
  return next((c for m in sorted(edges) if m not in state and (c := visit(m))), None)


def test_the_package_has_no_import_cycle_and_no_import_inside_a_function():
  edges, inner = _graph()
  assert len(edges) > 40 and "ddtree_jax.models.decoder" in edges["ddtree_jax.speculative.decode"]
  assert _cycle(edges) is None, f"import cycle: {' -> '.join(_cycle(edges))}"
  assert not inner, f"imports of package modules inside functions: {inner}"


def test_the_cycle_finder_finds_cycles():
  """The check above fails when it should: a planted cycle, through a parent package."""
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"p": {"p.x"}, "p.x": {"p"}}) == ["p", "p.x", "p"]
  assert _cycle({"a": {"b"}, "b": set()}) is None
  guarded = ast.parse("import os\nif TYPE_CHECKING:\n  from a import b\ndef f():\n  import c\n")
  assert [getattr(n, "module", None) for n in _top_imports(guarded)] == [None, "a"]


# A toy family: the Qwen3 architecture under the names of Meta's original Llama checkpoints
# (tok_embeddings, attention.wq, feed_forward.w1 / w2 / w3, output) and a config.json of its own
# field names. Everything it needs is defined here.
TOY_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight",
             "model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}
TOY_LAYER_NAMES = {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
                   "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
                   "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
                   "self_attn.q_norm": "attention.q_norm", "self_attn.k_norm": "attention.k_norm",
                   "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
                   "mlp.up_proj": "feed_forward.w3"}
TOY_FIELDS = {"dim": "hidden_size", "ffn_dim": "intermediate_size", "n_layers": "num_hidden_layers",
              "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
              "head_dim": "head_dim", "vocab_size": "vocab_size", "norm_eps": "rms_norm_eps",
              "rope_theta": "rope_theta", "max_seq_len": "max_position_embeddings",
              "eos_token_id": "eos_token_id"}


def _toy_config(raw, source):
  hf = {hf_name: raw[name] for name, hf_name in TOY_FIELDS.items() if name in raw}
  return decoder_config({"model_type": raw["model_type"], **hf}, source, qk_norm=True)


def _toy_params(r, cfg, raw, fuse_qkv=False):
  h, n, k, d, i = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.intermediate_size)

  def layer(l):
    p = f"layers.{l}."
    return LayerParams(
        input_norm=r.get(p + "attention_norm.weight", (h,)),
        wq=r.linear(p + "attention.wq.weight", n * d, h, (n, d)),
        wkv=Stacked([r.linear(p + "attention.wk.weight", k * d, h, (k, d)),
                     r.linear(p + "attention.wv.weight", k * d, h, (k, d))], axis=1),
        wo=r.get(p + "attention.wo.weight", (h, n * d), lambda t: t.T.reshape(n, d, h)),
        q_norm=r.get(p + "attention.q_norm.weight", (d,)),
        k_norm=r.get(p + "attention.k_norm.weight", (d,)),
        post_norm=r.get(p + "ffn_norm.weight", (h,)),
        w_gate_up=Stacked([r.linear(p + "feed_forward.w1.weight", i, h),
                           r.linear(p + "feed_forward.w3.weight", i, h)], axis=1),
        w_down=r.linear(p + "feed_forward.w2.weight", h, i))
  return Params(embed=r.get("tok_embeddings.weight", (cfg.vocab_size, h)),
                layers=[layer(l) for l in range(cfg.num_layers)],
                final_norm=r.get("norm.weight", (h,)),
                lm_head=r.linear("output.weight", cfg.vocab_size, h))


TOY = Family(model_types=("toy_llama_layout",), config=_toy_config, params=_toy_params)


@pytest.fixture
def toy_family():
  registry.register(TOY)
  yield TOY
  registry.unregister(TOY)


def _write_toy(hf_dir, toy_dir):
  """The Qwen3 checkpoint in hf_dir renamed into the toy family's layout."""
  renamed = {}
  for name, t in read_safetensors(os.path.join(hf_dir, "model.safetensors")).items():
    if name in TOY_NAMES:
      new = TOY_NAMES[name]
    else:
      layer, rest = name.removeprefix("model.layers.").split(".", 1)
      kind, suffix = rest.rsplit(".", 1)
      new = f"layers.{layer}.{TOY_LAYER_NAMES[kind]}.{suffix}"
    renamed[new] = np.asarray(t)
  os.makedirs(toy_dir)
  write_safetensors(os.path.join(toy_dir, "model.safetensors"), renamed)
  with open(os.path.join(hf_dir, "config.json")) as f:
    hf = json.load(f)
  toy = {"model_type": "toy_llama_layout"} | {name: hf[hf_name]
                                              for name, hf_name in TOY_FIELDS.items()}
  with open(os.path.join(toy_dir, "config.json"), "w") as f:
    json.dump(toy, f)


def test_a_family_registered_outside_the_engine_loads_and_decodes(tmp_path, toy_family):
  hf_dir, toy_dir = str(tmp_path / "qwen3"), str(tmp_path / "toy")
  write_target(hf_dir, heads=4, kv_heads=2, hidden=32, head_dim=8, inter=64, vocab=97)
  _write_toy(hf_dir, toy_dir)
  ref = dj.load_target(hf_dir, "float32", fuse_qkv=False)  # (the toy family never fuses)
  toy = dj.load_target(toy_dir, "float32")
  assert toy.config.model_type == "toy_llama_layout"
  assert toy.config == dataclasses.replace(ref.config, model_type="toy_llama_layout")
  for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(toy.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  prompts = [[3, 17, 40, 2], [11]]
  want = dj.generate(ref, prompts, max_new_tokens=6, method="ar")
  got = dj.generate(toy, prompts, max_new_tokens=6, method="ar")
  assert got.tokens == want.tokens and sum(map(len, got.tokens)) > 2


def test_an_unregistered_family_is_refused_by_name(tmp_path, toy_family):
  hf_dir, toy_dir = str(tmp_path / "qwen3"), str(tmp_path / "toy")
  write_target(hf_dir, heads=4, kv_heads=2, hidden=32, head_dim=8, inter=64, vocab=97)
  _write_toy(hf_dir, toy_dir)
  registry.unregister(TOY)
  with pytest.raises(ValueError, match="unsupported model_type 'toy_llama_layout'"):
    dj.load_target(toy_dir, "float32")
  registry.register(TOY)
  with pytest.raises(ValueError, match=r"\['qwen3'\] already registered"):
    registry.register(Family(("qwen3",), config=qwen3.QWEN3.config, params=qwen3.params))
