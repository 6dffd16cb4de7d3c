"""The decode loop is one XLA program: no host transfers or callbacks per step. Programs compiled
ahead of time are the ones generate runs, and a second process loads them from the persistent
compilation cache."""

import contextlib
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import ddtree_jax as dj
from ddtree_jax.speculative import decode
from conftest import FIXTURES
from helpers import write_drafter

HOST_OPS = ("infeed", "outfeed", "send(", "recv(", "callback", "host_compute")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# jax reports every XLA compile, also one served from the persistent cache, as this event (named
# jax._src.dispatch.BACKEND_COMPILE_EVENT in jax 0.11); a rename would make the counts below
# zero, so each test first checks that its own compiles are seen.
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
ENGINE_PROGRAMS = ("jit(prefill)", "jit(decode_loop)")


@contextlib.contextmanager
def compiled_programs():
  """Yields the list of the names of the programs XLA compiles inside the block (counted by
  events, not timed: a time threshold passes a fast recompile and fails a slow machine). jax's
  in-memory caches can rebuild a program the engine dropped without an XLA compile, so the tests
  also count the engine's own programs (engine._PROGRAMS)."""
  names = []
  listener = lambda event, secs, fun_name="", **kw: (
      names.append(fun_name) if event == BACKEND_COMPILE else None)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


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
  """AOT precompile of a list of budgets; generate then reuses them (compiles nothing); the
  persistent cache fills."""
  from ddtree_jax import engine
  target = dj.load_target(os.path.join(FIXTURES, "qwen3_gqa"), dtype="float32")
  d = dj.load_drafter(write_drafter(str(tmp_path / "d"), target.config), target)
  cache_dir = str(tmp_path / "xla_cache")
  with restored_compilation_cache():
    engine.enable_compilation_cache(cache_dir)
    before = len(engine._PROGRAMS)  # pylint: disable=protected-access
    with compiled_programs() as names:
      secs = engine.precompile(target, batch=2, prompt_len=5, max_new_tokens=9, drafter=d,
                               methods=("chain", "ddtree"), budgets=(3, 9), stop_token_ids=())
    assert set(secs) == {"chain", "ddtree/3", "ddtree/9"}
    assert [n for n in names if n in ENGINE_PROGRAMS] == list(ENGINE_PROGRAMS) * 3
    assert len(engine._PROGRAMS) == before + 3  # pylint: disable=protected-access
    with compiled_programs() as names:
      res = dj.generate(target, [[1, 2, 3], [4, 5, 6, 7, 8]], method="ddtree", drafter=d,
                        budget=9, max_new_tokens=9, stop_token_ids=())
    assert names == [] and len(engine._PROGRAMS) == before + 3  # pylint: disable=protected-access
    assert len(res.tokens[1]) == 9
    assert os.listdir(cache_dir)


def test_a_second_generate_call_of_the_same_shapes_compiles_nothing(tmp_path):
  """In one process, a second call with the same shapes and options (the same prompts, other
  prompts of the same padded length, a target and drafter loaded again) runs the programs of
  the first: no compile, the program table as it was, compile_seconds near 0, the same tokens."""
  from ddtree_jax import engine
  path = os.path.join(FIXTURES, "qwen3_gqa")
  target = dj.load_target(path, dtype="float32")
  d_dir = write_drafter(str(tmp_path / "d"), target.config)
  kw = dict(method="ddtree", budget=5, max_new_tokens=9, stop_token_ids=())
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
  first = dj.generate(target, prompts, drafter=dj.load_drafter(d_dir, target), **kw)
  before = len(engine._PROGRAMS)  # pylint: disable=protected-access
  again = dj.load_target(path, dtype="float32")
  with compiled_programs() as names:
    same = dj.generate(target, prompts, drafter=dj.load_drafter(d_dir, target), **kw)
    reloaded = dj.generate(again, prompts, drafter=dj.load_drafter(d_dir, again), **kw)
    other = dj.generate(target, [[9, 8, 7, 6], [3, 2]], drafter=dj.load_drafter(d_dir, target),
                        **kw)
  assert names == [] and len(engine._PROGRAMS) == before  # pylint: disable=protected-access
  assert same.tokens == reloaded.tokens == first.tokens and len(other.tokens[0]) == 9
  assert max(r.stats["compile_seconds"] for r in (same, reloaded, other)) < 0.1


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
  from ddtree_jax import engine
  before = len(engine._PROGRAMS)  # pylint: disable=protected-access
  with compiled_programs() as names:
    secs = dj.compile_many(target, [(prompts, kw) for kw in kws], threads=2)
  assert len(secs) == 3
  assert sorted(n for n in names if n in ENGINE_PROGRAMS) == sorted(ENGINE_PROGRAMS * 3)
  assert len(engine._PROGRAMS) == before + 3  # pylint: disable=protected-access
  with compiled_programs() as names:
    outs = [dj.generate(target, prompts, **kw) for kw in kws]
    dj.compile_only(target, prompts, **kws[2])  # cached: nothing to compile
  assert names == [] and len(engine._PROGRAMS) == before + 3  # pylint: disable=protected-access
  assert outs[1].tokens == outs[0].tokens == outs[2].tokens
  assert [len(t) for t in outs[0].tokens] == [7, 7]


def test_stage_programs_compile_ahead_and_time(tmp_path):
  """profiling.compile_stages AOT-compiles the four stages on abstract shapes (per-program compile
  seconds); stage_seconds runs them on a real prefill state and does not recompile."""
  from ddtree_jax.tools import profiling
  target = dj.load_target(os.path.join(FIXTURES, "qwen3_gqa"), dtype="float32")
  d = dj.load_drafter(write_drafter(str(tmp_path), target.config), target)
  lc = decode.LoopConfig(method="ddtree", max_new_tokens=16, num_drafts=7, budget=8)
  st = dict(tcfg=target.config, dcfg=d.config, lc=lc)
  args = (target.params, d.params, jnp.zeros((2, 16), jnp.int32), jnp.array([3, 5], jnp.int32),
          jax.random.key(0))
  shape = jax.eval_shape(lambda *a: decode.prefill(*a, capacity=64, **st), *args)
  secs = {}
  with compiled_programs() as names:
    progs = profiling.compile_stages(target.params, target.config, d.params, d.config, lc, shape,
                                     seconds=secs)
  assert set(progs) == set(secs) == {"draft", "tree", "verify", "accept_commit"}
  assert names.count("jit(<lambda>)") == 4  # one compile per stage
  assert all(s > 0 for s in secs.values())
  state = decode.prefill(*args, capacity=64, **st)
  with compiled_programs() as names:
    out = profiling.stage_seconds(target.params, target.config, d.params, d.config, lc, state,
                                  repeats=2, programs=progs)
  assert names == []  # it ran the programs it was given
  assert set(out) == set(progs) and all(v > 0 for v in out.values())


# Run twice with one cache directory: each program's persistent-cache outcome, in compile order
# (the cache's hit / miss event comes inside the compile event it belongs to).
_CACHED_GENERATE = """
import json, sys
import jax
import ddtree_jax as dj
from ddtree_jax import engine
engine.enable_compilation_cache(sys.argv[2])
seen, programs = [], []
def on_event(event, **kw):
  if event in ("/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"):
    seen.append(event.rsplit("_", 1)[1])
def on_duration(event, secs, fun_name="", **kw):
  if event == "%s":
    programs.append([fun_name] + seen)
    seen.clear()
jax.monitoring.register_event_listener(on_event)
jax.monitoring.register_event_duration_secs_listener(on_duration)
target = dj.load_target(sys.argv[1], dtype="float32")
res = dj.generate(target, [[1, 2, 3], [4, 5]], max_new_tokens=4, stop_token_ids=())
print(json.dumps({"tokens": res.tokens, "programs": programs}))
""" % BACKEND_COMPILE


def test_a_second_process_loads_generate_from_the_persistent_cache(tmp_path):
  """A fresh process with the same cache directory compiles nothing: prefill and the decode loop
  come from the cache that the first process wrote, and give the same tokens. Both processes
  get this one's environment (its XLA_FLAGS are part of the cache key)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  run = lambda: json.loads(subprocess.run(
      [sys.executable, "-c", _CACHED_GENERATE, os.path.join(FIXTURES, "qwen3_gqa"),
       str(tmp_path / "xla_cache")], cwd=REPO, env=env, capture_output=True, text=True,
      timeout=300, check=True).stdout.strip().splitlines()[-1])
  first, second = run(), run()
  outcome = lambda r: {p[0]: p[1:] for p in r["programs"] if p[0] in ENGINE_PROGRAMS}
  assert outcome(first) == {p: ["misses"] for p in ENGINE_PROGRAMS}  # compiled, then written
  assert outcome(second) == {p: ["hits"] for p in ENGINE_PROGRAMS}
  assert not [p for p in second["programs"] if "misses" in p]  # nothing else compiled either
  assert second["tokens"] == first["tokens"] and [len(t) for t in first["tokens"]] == [4, 4]
