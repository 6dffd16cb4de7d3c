"""End to end: the Pallas kernel (interpret mode on CPU) gives the engine the same tokens as XLA."""

import os

import pytest

import ddtree_jax as dj
from conftest import FIXTURES
from helpers import assert_accepted, oracle_drafter, write_drafter

PROMPTS = [[3, 17, 99, 4, 250, 31, 8], [42], [9, 8, 7, 6, 5]]
M = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  target = dj.load_target(os.path.join(FIXTURES, "qwen3_gqa"), dtype="float32")
  drafter = dj.load_drafter(write_drafter(str(tmp_path_factory.mktemp("d")), target.config,
                                          block_size=6), target)
  ar = dj.generate(target, PROMPTS, max_new_tokens=M, stop_token_ids=(), attention="xla").tokens
  return target, oracle_drafter(drafter, PROMPTS, ar, corruption=0.3), ar


@pytest.mark.parametrize("method,budget", [("ar", None), ("chain", None), ("ddtree", 8)])
def test_pallas_engine_matches_xla(setup, method, budget):
  target, drafter, ar = setup
  run = lambda attn: dj.generate(target, PROMPTS, method=method, drafter=drafter, budget=budget,
                                 max_new_tokens=M, stop_token_ids=(), attention=attn)
  pallas, xla = run("pallas"), run("xla")
  assert pallas.tokens == xla.tokens == ar
  assert pallas.stats["acceptance_lengths"] == xla.stats["acceptance_lengths"]
  if method != "ar":
    assert_accepted(drafter, PROMPTS, pallas, method, budget)
