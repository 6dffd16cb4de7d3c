"""The slot engine's scheduling (`slots.py`, `slot_programs.py`): a request's tokens are offline
`generate`'s whatever the chunk lengths, the pipelining and the requests beside it; a cancelled
request frees its slot; bad settings name their field. The HTTP server: tests/test_server.py."""

import random
import threading

import numpy as np
import pytest

import ddtree_jax as dj
from ddtree_jax import engine as engine_lib
from ddtree_jax.request import GenerateOptions
from ddtree_jax.serving import programs as slot_programs
from ddtree_jax.serving import slots
from ddtree_jax.speculative import decode


@pytest.mark.parametrize("kw,field", [
    (dict(chunk_steps=0), "chunk_steps"), (dict(slots=1.5), "slots"),
    (dict(chunk_steps=8, max_chunk_steps=4), "max_chunk_steps"),
    (dict(capacity=64, prompt_buckets=(16,), max_chunk_steps=65), "max_chunk_steps"),
    (dict(stream_steps=0), "stream_steps"), (dict(stream_steps=33), "stream_steps"),
    (dict(pipeline="yes"), "pipeline"), (dict(method="beam"), "method"),
    (dict(refill_wait=1.5), "refill_wait"), (dict(refill_wait=True), "refill_wait"),
    (dict(prompt_buckets=(64, 16)), "prompt_buckets")])
def test_bad_settings_name_the_field(kw, field):
  with pytest.raises(ValueError, match=f"SlotConfig.{field} must"):
    slots.SlotConfig(**kw)


def test_the_default_settings_are_valid():
  c = slots.SlotConfig()
  assert c.prompt_buckets[-1] < c.capacity and not c.pipeline


def test_a_chunk_row_reads_back_as_its_fields():
  """`Chunk.of` reads the chunk program's row layout: start, end, steps, max_steps acceptance
  counts, max_steps chosen budgets, then the window of new tokens (only end - start of them are
  the slot's)."""
  row = np.asarray([5, 9, 2, 3, 1, 0, 0, 16, 0, 0, 0, 11, 12, 13, 14, 99, 99], np.int32)
  got = slot_programs.Chunk.of(row, max_steps=4)
  assert (got.start, got.end, got.steps) == (5, 9, 2)
  assert got.accepted == [3, 1] and got.tokens == [11, 12, 13, 14] and got.chosen == [16, 0]
  assert got.acceptance(sent=5, max_tokens=9) == [3, 1]
  assert got.acceptance(sent=5, max_tokens=7) == [3]  # the second step is past the end
  assert slot_programs.Chunk(0, 2, 3, [1, 0, 1], [7, 8]).acceptance(0, 9) == [1, 1]


@pytest.fixture(scope="module")
def mixed():
  """The bundled pair; 7 requests of different prompts and lengths with their offline outputs
  (greedy DDTree equals AR: tests/test_decode.py; AR in one batch is the cheaper reference)."""
  target, drafter = dj.load_default(dtype="float32")
  rng = random.Random(0)
  prompts = [[rng.randrange(2, 250) for _ in range(rng.randrange(1, 40))] for _ in range(7)]
  limits = [5, 17, 1, 30, 12, 40, 9]
  full = dj.generate(target, prompts, max_new_tokens=max(limits), stop_token_ids=()).tokens
  want = [list(w[:n]) for w, n in zip(full, limits)]
  stops = [()] * 7
  stops[3] = (want[3][6],)  # request 3 ends on device at its first stop id
  want[3] = want[3][:want[3].index(want[3][6]) + 1]
  return target, drafter, prompts, limits, stops, want


def _run(engine, jobs, got, at_once: bool):
  """Submits jobs (prompt, max_tokens, stop ids, cancel at the first token) all at once (queued
  before it starts the engine) or one at a time (to a started engine); returns when every request
  ended and every slot is free."""
  done = [threading.Event() for _ in jobs]
  reqs = []

  def emit(i):
    def call(toks, reason):
      got[i].extend(toks)
      if jobs[i][3]:
        reqs[i].cancel()
      if reason:
        done[i].set()
    return call

  def wait(i):
    for _ in range(6000):
      if done[i].is_set() or jobs[i][3] and reqs[i].slot is not None and engine.metrics()[
          "active_slots"] == 0:
        return
      threading.Event().wait(0.05)
    raise TimeoutError(f"request {i}")
  for i, (prompt, n, stops, _) in enumerate(jobs):
    reqs.append(engine.submit(prompt, GenerateOptions(max_new_tokens=n, stop_token_ids=stops),
                              emit(i)))
    if not at_once:
      wait(i)
  if at_once:
    engine.start()
  for i in range(len(jobs)):
    wait(i)
  assert not any(done[i].is_set() for i, job in enumerate(jobs) if job[3])


# One compiled chunk (max_chunk_steps 16) serves every row: the step count is an argument.
@pytest.mark.parametrize("chunk_steps,pipeline", [(3, False), (1, True), (16, True)])
def test_outputs_are_offline_generate_whatever_the_chunks_and_pipelining(mixed, chunk_steps,
                                                                         pipeline):
  """A burst of more requests than slots, of different lengths, limits and stop ids, one
  cancelled at its first token; then requests one at a time (alone: chunks of up to 16 steps,
  pipelined), another one cancelled. Every other output is the offline one (requests share the
  batch and take slots others freed), the cancelled ones get nothing more, every slot ends free.
  Chunks of 3, 1 or 16 steps (16 for a request alone), pipelined or not."""
  target, drafter, prompts, limits, stops, want = mixed
  engine = slots.SlotEngine(target, drafter, slots.SlotConfig(
      method="ddtree", budget=8, slots=2, capacity=160, chunk_steps=chunk_steps,
      max_chunk_steps=16, pipeline=pipeline, prompt_buckets=(16, 64)))
  burst = [(p, n, s, i == 5) for i, (p, n, s) in enumerate(zip(prompts, limits, stops))]
  lone = [burst[i][:3] + (i == 1,) for i in (0, 3, 6, 4, 5, 1, 6)]
  got = [[] for _ in burst + lone]
  try:
    _run(engine, burst, got, at_once=True)
    m = engine.metrics()
    assert m["alone_chunks"] == 0 and m["active_slots"] == 0 and m["finished"] == 7
    assert m["refill_s"] > 0  # (a chunk ended requests, slots were free, none came back)
    _run(engine, lone, got[len(burst):], at_once=False)
  finally:
    engine.stop()
  m = engine.metrics()
  assert m["active_slots"] == 0 and m["finished"] == m["prefilled"] == 14
  assert m["alone_chunks"] > 0 and m["steps"] > 0
  want_all = want + [want[i] for i in (0, 3, 6, 4, 5, 1, 6)]
  for k, job in enumerate(burst + lone):
    if job[3]:  # cancelled at its first token
      assert got[k] == want_all[k][:1]
      got[k] = want_all[k]
  assert got == want_all


def test_a_chunk_in_flight_never_feeds_the_next_request_in_its_slot(mixed):
  """The pipelining hazard, step by step on the engine's own loop parts: chunks are dispatched
  for requests A and C, then the next ones; A is cancelled as the first chunk is read (its slot
  freed), B takes the slot while the second chunk still computes A's row. That row is A's, so B
  gets none of it: B's and C's tokens are offline generate's, A's stop at what it had."""
  target, drafter, prompts, limits, _, want = mixed
  engine = slots.SlotEngine(target, drafter, slots.SlotConfig(
      method="ddtree", budget=8, slots=2, capacity=160, chunk_steps=3, max_chunk_steps=16,
      prompt_buckets=(16, 64)))
  got = {k: [] for k in "abc"}
  done = {k: threading.Event() for k in "bc"}

  def emit(k):
    return lambda toks, reason: (got[k].extend(toks), reason and done[k].set())
  options = lambda n: GenerateOptions(max_new_tokens=n, stop_token_ids=())
  # pylint: disable=protected-access
  a = engine.submit(prompts[5], options(limits[5]), emit("a"))
  engine.submit(prompts[6], options(limits[6]), emit("c"))
  engine._send_firsts(engine._admit())
  first = engine._launch()  # (two requests: chunks of 3 steps)
  second = engine._launch()  # in flight, with A's row
  a.cancel()
  engine._finish(first)
  assert engine.metrics()["active_slots"] == 1 and len(got["a"]) == 1
  b = engine.submit(prompts[1], options(limits[1]), emit("b"))
  engine._send_firsts(engine._admit())
  assert b.slot == a.slot == 0
  engine._finish(second)
  assert got["b"] == want[1][:1]  # nothing from A's row
  engine.start()
  assert all(d.wait(120) for d in done.values())
  engine.stop()
  assert got == {"a": want[5][:1], "b": want[1], "c": want[6]}


def test_budget_auto_serves_offline_tokens_and_counts_its_choices(mixed):
  """budget="auto" in the slot engine: a burst of requests then lone ones get the offline
  tokens; each step's choice (made for the slots decoding then) is counted in the metrics."""
  target, drafter, prompts, limits, stops, want = mixed
  engine = slots.SlotEngine(target, drafter, slots.SlotConfig(
      method="ddtree", budget="auto", budgets=(0, 4, 16), budget_costs=(1.0, 1.4, 2.2), slots=2,
      capacity=160, chunk_steps=4, max_chunk_steps=16, prompt_buckets=(16, 64)))
  jobs = [(p, n, s, False) for p, n, s in zip(prompts, limits, stops)]
  got = [[] for _ in jobs]
  try:
    _run(engine, jobs[:4], got[:4], at_once=True)
    _run(engine, jobs[4:], got[4:], at_once=False)
  finally:
    engine.stop()
  assert got == want
  m = engine.metrics()
  chosen = {k: v for k, v in m.items() if k.startswith("steps_budget_")}
  assert sum(chosen.values()) == m["steps"] and len(chosen) > 1, m


def test_auto_backing_off_keeps_each_slots_drafter_context(mixed):
  """budget="auto" backing off (AR far cheaper than a tree) holds each undrafted step's features;
  a request that takes a freed slot drops the old request's held rows. After two requests, one
  ended and a third in its slot, each busy slot's drafter cache (its held rows committed) equals
  one prefill over that slot's committed tokens."""
  target, drafter, prompts, _, _, _ = mixed
  engine = slots.SlotEngine(target, drafter, slots.SlotConfig(
      method="ddtree", budget="auto", budgets=(0, 4, 16), budget_costs=(1e-3, 1.0, 1.0),
      slots=2, capacity=160, chunk_steps=3, max_chunk_steps=16, prompt_buckets=(16, 64)))
  got = {k: [] for k in "abc"}
  emit = lambda k: lambda toks, reason: got[k].extend(toks)
  options = lambda n: GenerateOptions(max_new_tokens=n, stop_token_ids=())
  # pylint: disable=protected-access
  engine.submit(prompts[3], options(4), emit("a"))
  b = engine.submit(prompts[5], options(40), emit("b"))
  engine._send_firsts(engine._admit())
  for _ in range(3):  # a ends within its first chunks, its slot keeps what it held
    engine._finish(engine._launch())
  c = engine.submit(prompts[0], options(40), emit("c"))
  engine._send_firsts(engine._admit())
  for _ in range(3):
    engine._finish(engine._launch())
  state = engine.state
  assert state.auto.holds and int(state.auto.held.max()) > 0  # undrafted steps held features
  state = decode._commit_held(engine.dparams, engine.dcfg, state)
  lens = np.asarray(state.cache.lens)
  np.testing.assert_array_equal(np.asarray(state.draft_cache.lens), lens)
  for req, key in ((b, "b"), (c, "c")):
    n = int(lens[req.slot])
    committed = (list(req.prompt) + got[key])[:n]
    whole, _ = engine_lib.prefill_state(target, [committed], method="chain", drafter=drafter,
                                        max_new_tokens=2, stop_token_ids=(), cache_capacity=160)
    for have, want in ((state.draft_cache.k, whole.draft_cache.k),
                       (state.draft_cache.v, whole.draft_cache.v)):
      np.testing.assert_allclose(np.asarray(have[:, req.slot, :, :n]),
                                 np.asarray(want[:, 0, :, :n]), rtol=1e-4, atol=1e-5)
