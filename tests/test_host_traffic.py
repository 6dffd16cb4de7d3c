"""The decode loop is one XLA program: no host transfers or callbacks per step."""

import contextlib
import os

import jax
import jax.numpy as jnp
import pytest

import ddtree_jax as dj
from ddtree_jax import decode
from conftest import FIXTURES
from helpers import write_drafter

HOST_OPS = ("infeed", "outfeed", "send(", "recv(", "callback", "host_compute")


@contextlib.contextmanager
def restored_compilation_cache():
  """Puts the process's persistent-cache settings back afterwards (the cache off if it was)."""
  from ddtree_jax import engine  # pylint: disable=import-outside-toplevel
  before = (jax.config.jax_compilation_cache_dir,
            jax.config.jax_persistent_cache_min_compile_time_secs)
  try:
    yield
  finally:
    if before[0]:
      engine.enable_compilation_cache(*before)
    else:
      jax.config.update("jax_compilation_cache_dir", None)


@pytest.mark.parametrize("method,budget", [("ar", 0), ("chain", 0), ("ddtree", 16)])
def test_decode_loop_has_no_host_round_trips(tmp_path, method, budget):
  target = dj.load_target(os.path.join(FIXTURES, "qwen3_gqa"), dtype="float32")
  d = None if method == "ar" else dj.load_drafter(write_drafter(str(tmp_path), target.config),
                                                  target)
  lc = decode.LoopConfig(method=method, max_new_tokens=16, num_drafts=7 if d else 0, budget=budget)
  st = dict(tcfg=target.config, dcfg=d.config if d else None, lc=lc)
  args = (target.params, d.params if d else None, jnp.zeros((2, 16), jnp.int32),
          jnp.array([3, 5], jnp.int32), jax.random.key(0))
  state = jax.eval_shape(lambda *a: decode.prefill(*a, capacity=64, **st), *args)
  hlo = decode.decode_loop.lower(args[0], args[1], state, **st).compile().as_text()
  assert "while" in hlo
  found = [op for op in HOST_OPS if op in hlo.lower()]
  assert not found, found


def test_precompile_and_persistent_cache(tmp_path):
  """AOT precompile of a list of budgets; generate then reuses them; the persistent cache fills."""
  from ddtree_jax import engine
  target = dj.load_target(os.path.join(FIXTURES, "qwen3_gqa"), dtype="float32")
  d = dj.load_drafter(write_drafter(str(tmp_path / "d"), target.config), target)
  cache_dir = str(tmp_path / "xla_cache")
  with restored_compilation_cache():
    engine.enable_compilation_cache(cache_dir)
    secs = engine.precompile(target, batch=2, prompt_len=5, max_new_tokens=9, drafter=d,
                             methods=("chain", "ddtree"), budgets=(3, 9), stop_token_ids=())
    assert set(secs) == {"chain", "ddtree/3", "ddtree/9"}
    res = dj.generate(target, [[1, 2, 3], [4, 5, 6, 7, 8]], method="ddtree", drafter=d, budget=9,
                      max_new_tokens=9, stop_token_ids=())
    assert res.stats["compile_seconds"] < 0.05
    assert os.listdir(cache_dir)


def test_the_compilation_cache_moves_to_a_new_directory(tmp_path):
  """enable_compilation_cache after the cache was opened elsewhere writes to the new place (JAX
  opens its cache once; the engine resets it)."""
  from ddtree_jax import engine
  with restored_compilation_cache():
    for name, n in (("a", 3), ("b", 5)):
      engine.enable_compilation_cache(str(tmp_path / name))
      jax.jit(lambda x: x * n + 1)(jnp.arange(n, dtype=jnp.float32)).block_until_ready()
      assert os.listdir(tmp_path / name), name


def test_compile_many_in_threads_then_generate_reuses(tmp_path):
  """Programs compiled two at a time in threads are the ones generate then runs (no recompile),
  for ragged prompts and exactly generate's keyword arguments; results stay lossless."""
  target = dj.load_target(os.path.join(FIXTURES, "qwen3_gqa"), dtype="float32")
  d = dj.load_drafter(write_drafter(str(tmp_path / "d"), target.config), target)
  prompts = [[5, 6, 7], [1, 2, 3, 4, 9, 8, 7]]
  kws = [dict(method="ar", max_new_tokens=7, stop_token_ids=()),
         dict(method="chain", drafter=d, max_new_tokens=7, stop_token_ids=()),
         dict(method="ddtree", drafter=d, budget=5, max_new_tokens=7, stop_token_ids=())]
  secs = dj.compile_many(target, [(prompts, kw) for kw in kws], threads=2)
  assert len(secs) == 3 and all(s > 0 for s in secs)
  outs = [dj.generate(target, prompts, **kw) for kw in kws]
  assert all(o.stats["compile_seconds"] < 0.05 for o in outs)
  assert outs[1].tokens == outs[0].tokens == outs[2].tokens
  assert dj.compile_only(target, prompts, **kws[2]) < 0.05  # cached: nothing to compile


def test_stage_programs_compile_ahead_and_time(tmp_path):
  """profiling.compile_stages AOT-compiles the four stages on abstract shapes (per-program compile
  seconds); stage_seconds runs them on a real prefill state and does not recompile."""
  from ddtree_jax import profiling
  target = dj.load_target(os.path.join(FIXTURES, "qwen3_gqa"), dtype="float32")
  d = dj.load_drafter(write_drafter(str(tmp_path), target.config), target)
  lc = decode.LoopConfig(method="ddtree", max_new_tokens=16, num_drafts=7, budget=8)
  st = dict(tcfg=target.config, dcfg=d.config, lc=lc)
  args = (target.params, d.params, jnp.zeros((2, 16), jnp.int32), jnp.array([3, 5], jnp.int32),
          jax.random.key(0))
  shape = jax.eval_shape(lambda *a: decode.prefill(*a, capacity=64, **st), *args)
  secs = {}
  progs = profiling.compile_stages(target.params, target.config, d.params, d.config, lc, shape,
                                   seconds=secs)
  assert set(progs) == set(secs) == {"draft", "tree", "verify", "accept_commit"}
  assert all(s > 0 for s in secs.values())
  state = decode.prefill(*args, capacity=64, **st)
  out = profiling.stage_seconds(target.params, target.config, d.params, d.config, lc, state,
                                repeats=2, programs=progs)
  assert set(out) == set(progs) and all(v > 0 for v in out.values())
