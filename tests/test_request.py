"""The one request schema (`request.GenerateOptions`): `generate`'s keywords, the scripts' config
defaults, the server's JSON fields and the slot engine's settings are its fields and defaults, so
a field or default changed in one place only fails here."""

import dataclasses
import inspect
import os

import jax
import numpy as np
import pytest

import ddtree_jax as dj
from conftest import FIXTURES
from ddtree_jax import engine
from ddtree_jax.request import SLOT_FIELDS, GenerateOptions, RequestError, default_attention
from ddtree_jax.serving import server, slots
from ddtree_jax.speculative.sampling import seed_key_data
from experiments import serve, workflow

FIELDS = {f.name: f for f in dataclasses.fields(GenerateOptions)}


def _default(field: dataclasses.Field):
  return inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default


def test_generate_keywords_are_the_options_with_their_defaults():
  params = inspect.signature(dj.generate).parameters
  keywords = {n: p.default for n, p in params.items()
              if p.kind is inspect.Parameter.KEYWORD_ONLY and n != "drafter"}
  assert keywords == {n: _default(f) for n, f in FIELDS.items()}
  assert "drafter" in params


def test_config_defaults_are_the_options_defaults():
  """configs/default.py spells None as "" or 0; a run's options differ from the defaults only in
  what the run sets (method, budget) and the config's own max_new_tokens."""
  cfg = workflow.load_config("configs/default.py")
  for method, budget in (("ar", None), ("chain", None), ("ddtree", 8)):
    got = workflow.generate_options(cfg, method, budget)
    assert got == GenerateOptions(max_new_tokens=cfg.max_new_tokens, method=method,
                                  budget=budget)
    kwargs = workflow.generate_kwargs(cfg, method, budget, None)
    assert set(kwargs) == set(inspect.signature(dj.generate).parameters) - {"target", "prompts"}


def test_serve_config_defaults_are_slot_config_defaults():
  """configs/serve.py's serve.* are SlotConfig's defaults (and method "ar" without a drafter)
  but its capacity, which fits the model's positions (at most 4096) with the prompt buckets
  below it: the bundled pair's 256 positions give 256 rows and buckets 16 and 64."""
  cfg = workflow.load_config("configs/serve.py")
  assert serve.slot_config(cfg, 32768) == slots.SlotConfig(method=cfg.serve.method,
                                                           capacity=4096)
  small = serve.slot_config(cfg, 256)
  assert small.capacity == 256 and small.prompt_buckets == (16, 64)
  cfg.serve.capacity = 512  # as set: kept, and its buckets as given
  assert serve.slot_config(cfg, 256) == slots.SlotConfig(method=cfg.serve.method, capacity=512)
  assert serve.model_name(cfg) == "ddtree-jax-default"


def test_the_server_reads_the_per_request_fields():
  """Each SLOT_FIELDS option is read from its JSON field; an empty body gives the options'
  defaults but the server's own: max_tokens, no stop ids unless named, a random seed."""
  opts = server.request_options({})
  assert opts.max_new_tokens == server.DEFAULT_MAX_TOKENS and opts.stop_token_ids == ()
  assert opts.seed != server.request_options({}).seed
  same = {"max_new_tokens", "stop_token_ids", "seed"}
  assert all(getattr(opts, n) == _default(f) for n, f in FIELDS.items() if n not in same)
  body = dict(max_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=11, stop_token_ids=[2])
  opts = server.request_options(body)
  assert {n: getattr(opts, n) for n in SLOT_FIELDS} == dict(
      max_new_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=11, stop_token_ids=[2])
  assert server.request_options({"top_k": -1}).top_k is None
  assert server.request_options({"top_k": 0, "seed": None}).top_k is None


def test_one_attention_rule_and_one_loop_config():
  opts = GenerateOptions(max_new_tokens=8, method="ddtree", budget=4, temperature=0.0, top_k=5,
                         stop_token_ids=(1,))
  lc = opts.loop_config(None)
  assert lc.kernels.attention == default_attention() and lc.top_k is None  # greedy: no filter
  assert (lc.method, lc.budget, lc.max_new_tokens, lc.stop_ids) == ("ddtree", 4, 8, (1,))
  served = slots.SlotConfig(method="ddtree", budget=16, capacity=512).options.loop_config(None)
  assert served.kernels.attention == default_attention() and served.max_new_tokens == 512


@pytest.fixture(scope="module")
def target():
  return dj.load_target(os.path.join(FIXTURES, "qwen3_gqa"), dtype="float32")


def test_any_64_bit_seed_keys_as_the_slot_engine_does(target):
  """A seed is one 64-bit integer everywhere: `generate` keys its draws as the slot engine
  keys a request (`seed_key_data`); a seed outside 64 bits is refused, naming the range."""
  for seed in (-1, 2**64 - 1):
    args, _, _ = engine._prepare(  # pylint: disable=protected-access
        target, [[1, 2]], GenerateOptions(max_new_tokens=2, seed=seed), None)
    np.testing.assert_array_equal(jax.random.key_data(args[4]), seed_key_data(seed))
  with pytest.raises(RequestError, match=r"seed must be an integer in \[-9223372036854775808"):
    dj.generate(target, [[1, 2]], max_new_tokens=2, seed=2**64)
  with pytest.raises(RequestError) as e:
    dj.generate(target, [[1, 2]], max_new_tokens=2, attention="")
  assert e.value.field == "attention"



def test_first_mistakes_are_named(target):
  """A budget spelled otherwise than 'auto' names both valid forms; a missing max_new_tokens
  says it is required; a temperature above MAX_TEMPERATURE is refused offline as served."""
  with pytest.raises(RequestError, match=r"budget must be an integer in \[1, 1024\] or 'auto', "
                                         r"got 'Auto'"):
    GenerateOptions(max_new_tokens=2, method="ddtree", budget="Auto").check_values()
  with pytest.raises(RequestError, match="max_new_tokens is required") as e:
    dj.generate(target, [[1, 2]])
  assert e.value.field == "max_new_tokens"
  with pytest.raises(RequestError, match=r"temperature must be in \[0.0, 2.0\], got 2.5"):
    dj.generate(target, [[1, 2]], max_new_tokens=2, temperature=2.5)


def test_stats_name_no_budget_for_methods_without_one(target):
  """stats["budget"] is None for AR (and chain), as the scripts' JSON rows write it."""
  assert dj.generate(target, [[1, 2]], max_new_tokens=2).stats["budget"] is None
