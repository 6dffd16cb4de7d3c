"""An OpenAI-compatible HTTP server over a `slots.SlotEngine` (FastAPI + uvicorn).

  POST /v1/completions        prompt (text or token ids), max_tokens, stop, stop_token_ids,
                              stream, temperature, top_p, top_k, seed
  POST /v1/chat/completions   messages rendered with the checkpoint's chat template (sandboxed
                              Jinja, the Hugging Face convention), the same options
  GET  /v1/models, /health, /metrics (Prometheus text)

A request's options are `request.GenerateOptions`' per-request fields (`request.SLOT_FIELDS`,
max_new_tokens spelled max_tokens), checked by `GenerateOptions.check` as `engine.generate`'s are,
with the server's limits. Temperature 0 (also when absent) is greedy; above 0 a request samples
(top_p; top_k -1 or 0 is off) with its own seed (absent: a random one): same seed, same tokens,
whatever shares the batch, and those of offline `generate` with that seed. Only the stop ids and
strings a request names end it. A body field neither endpoint reads (`KNOWN_FIELDS`) is logged
at WARNING and ignored, or answered 400 under `strict_fields`. `usage` counts prompt and
completion tokens; the extension field `ddtree.acceptance_lengths` lists the tokens each decode
step committed for the request; a stream sends them as each step commits them. Bad
input is answered 400 with the field named (a `request.RequestError`), a full queue 429; the
server keeps serving either way. A client that disconnects mid-stream frees its slot.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import secrets
import time
import uuid
from typing import Any

import fastapi
from fastapi import responses
import jinja2
import prometheus_client

from ddtree_jax.chat import CHAT_ROLES, DEFAULT_CHAT_TEMPLATE, compile_template
from ddtree_jax.request import SLOT_FIELDS, GenerateOptions, RequestError
from ddtree_jax.serving import slots as slots_lib

DEFAULT_MAX_TOKENS = 16  # the OpenAI API's, for a request without max_tokens
JSON_NAMES = {"max_new_tokens": "max_tokens", "prompts": "prompt"}  # option -> its JSON field
# The body fields each endpoint reads, by JSON name; any other is unknown (`unknown_fields`).
_SHARED_FIELDS = ("model", "stop", "n", "stream", "stream_options",
                  *(JSON_NAMES.get(f, f) for f in SLOT_FIELDS))
KNOWN_FIELDS = {"completions": frozenset(_SHARED_FIELDS + ("prompt",)),
                "chat": frozenset(_SHARED_FIELDS + ("messages",))}

_LOG = logging.getLogger(__name__)


def request_options(body: dict) -> GenerateOptions:
  """The GenerateOptions of a request body's SLOT_FIELDS (JSON null: the default), unchecked;
  max_tokens absent: DEFAULT_MAX_TOKENS, seed absent: a random one, top_k -1 or 0: off, no stop
  ids unless named."""
  given = {f: body[JSON_NAMES.get(f, f)] for f in SLOT_FIELDS
           if body.get(JSON_NAMES.get(f, f)) is not None}
  if type(given.get("top_k")) is int and given["top_k"] in (-1, 0):  # (a bool is no top_k)
    given["top_k"] = None
  return GenerateOptions(**{"max_new_tokens": DEFAULT_MAX_TOKENS, "stop_token_ids": (),
                            "seed": secrets.randbits(64), **given})


def unknown_fields(body: dict, endpoint: str, strict: bool) -> list[str]:
  """The body's fields `endpoint` ("completions" or "chat") does not read, sorted: a
  RequestError naming them when `strict`, else logged once at WARNING and returned."""
  unknown = sorted(set(body) - KNOWN_FIELDS[endpoint])
  if unknown and strict:
    raise RequestError(f"unknown field(s) {unknown}; this endpoint reads "
                       f"{sorted(KNOWN_FIELDS[endpoint])}", ", ".join(unknown))
  if unknown:
    _LOG.warning("ignoring unknown field(s) %s", unknown)
  return unknown


def json_error(e: RequestError) -> RequestError:
  """`e` with the request's JSON name of its field (max_tokens for max_new_tokens)."""
  name = JSON_NAMES.get(e.field)
  return e if name is None else RequestError(str(e).replace(e.field, name), name)


class _Metrics:
  """The Prometheus series of one server (its own registry)."""

  def __init__(self, engine: slots_lib.SlotEngine):
    self.registry = prometheus_client.CollectorRegistry()
    r = self.registry
    self.queue = prometheus_client.Gauge("ddtree_queue_depth", "requests waiting", registry=r)
    self.active = prometheus_client.Gauge("ddtree_active_slots", "slots decoding", registry=r)
    self.requests = prometheus_client.Counter("ddtree_requests", "requests finished",
                                              ["finish_reason"], registry=r)
    self.tokens = prometheus_client.Counter("ddtree_generated_tokens", "tokens sent", registry=r)
    self.rate = prometheus_client.Gauge("ddtree_tokens_per_second",
                                        "tokens sent per second over the last minute", registry=r)
    self.acceptance = prometheus_client.Histogram(
        "ddtree_acceptance_length", "tokens committed per decode step",
        buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32), registry=r)
    self.budget_steps = prometheus_client.Gauge(
        "ddtree_budget_steps", "decode steps that chose each budget (budget=auto; 0 = AR)",
        ["budget"], registry=r)
    self.engine, self.window = engine, collections.deque()  # (time, tokens), the last minute

  def _trim(self, now: float) -> None:
    while self.window and now - self.window[0][0] >= 60:
      self.window.popleft()

  def sent(self, n: int) -> None:
    self.tokens.inc(n)
    now = time.monotonic()
    self._trim(now)
    self.window.append((now, n))

  def render(self) -> bytes:
    m = self.engine.metrics()
    self.queue.set(m["queue_depth"])
    self.active.set(m["active_slots"])
    for key, steps in m.items():
      if key.startswith("steps_budget_"):
        self.budget_steps.labels(budget=key[len("steps_budget_"):]).set(steps)
    now = time.monotonic()
    self._trim(now)
    span = now - self.window[0][0] if len(self.window) > 1 else 0.0
    self.rate.set(sum(k for _, k in self.window) / span if span > 0 else 0.0)
    return prometheus_client.generate_latest(self.registry)


def make_app(engine: slots_lib.SlotEngine, tokenizer, model_name: str,
             chat_template: str = DEFAULT_CHAT_TEMPLATE,
             special_tokens: dict[str, str] | None = None,
             strict_fields: bool = False) -> fastapi.FastAPI:
  """The FastAPI app serving `engine` as model `model_name`; tokenizer: a `tokenizers`
  Tokenizer (None: token-id prompts only, empty texts; `usage` counts the tokens either way);
  strict_fields: answer a body with unknown fields 400 instead of ignoring them."""
  app = fastapi.FastAPI(title="ddtree-jax")
  metrics = _Metrics(engine)
  template = compile_template(chat_template)
  special = special_tokens or {}

  @app.exception_handler(RequestError)
  async def bad_request(_, e: RequestError):
    return responses.JSONResponse(status_code=400, content={"error": {
        "message": str(e), "type": "invalid_request_error", "param": e.field}})

  def encode(text: str) -> list[int]:
    if tokenizer is None:
      raise RequestError("this model has no tokenizer: send token ids", "prompt")
    return tokenizer.encode(text).ids

  def decode(ids: list[int]) -> str:  # ids the tokenizer does not know (a random target's) add ""
    if tokenizer is None:
      return ""
    return tokenizer.decode([i for i in ids if tokenizer.id_to_token(i) is not None])

  async def parse(request: fastapi.Request, endpoint: str) -> dict[str, Any]:
    try:
      body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise RequestError(f"malformed JSON: {e}", "body") from None
    if not isinstance(body, dict):
      raise RequestError("the body must be a JSON object", "body")
    unknown_fields(body, endpoint, strict_fields)
    if body.get("model", model_name) != model_name:
      raise RequestError(f"unknown model {body.get('model')!r}; this server has {model_name!r}",
                         "model")
    return body

  def options(body):
    """(the request's options, its stop strings, whether it streams)."""
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
      raise RequestError("stop must be a string or a list of non-empty strings", "stop")
    n = body.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n != 1):
      raise RequestError("n must be 1: one choice per request (send one request per sample, "
                         "each with its own seed)", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
      raise RequestError("stream must be true or false", "stream")
    return request_options(body), stop, stream

  async def run(prompt_ids, opts, stop, stream):
    """Submits the request (`stream`: its tokens are sent per decode step); yields (text delta,
    token count, finish_reason, the request) as chunks come."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    emit = lambda toks, reason: loop.call_soon_threadsafe(queue.put_nowait, (toks, reason))
    try:
      req = engine.submit(prompt_ids, opts, emit, stream=stream)
    except RequestError as e:
      raise json_error(e) from None
    except slots_lib.QueueFull as e:
      raise fastapi.HTTPException(status_code=429, detail=str(e)) from None
    ids, text, finished = [], "", False
    try:
      while not finished:
        toks, reason = await queue.get()
        ids += toks
        full = decode(ids)
        hit = next((full.index(s) for s in stop if s in full), None)
        if hit is not None:
          full, reason = full[:hit], "stop"
          req.cancel()
        delta, text = full[len(text):], full
        metrics.sent(len(toks))
        finished = reason is not None
        yield delta, len(toks), reason, req
    finally:
      if not finished:
        req.cancel()  # the client went away: the slot is freed at the next chunk
      else:
        metrics.requests.labels(finish_reason=reason).inc()
        for a in req.acceptance:
          metrics.acceptance.observe(a)

  def envelope(kind, rid, created):
    return {"id": rid, "object": kind, "created": created, "model": model_name}

  async def respond(prompt_ids, body, chat: bool):
    opts, stop, stream = options(body)
    rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
    gen = run(prompt_ids, opts, stop, stream)
    first = await gen.__anext__()  # a bad request raises here, before any byte is sent

    def usage(n):
      return {"prompt_tokens": len(prompt_ids), "completion_tokens": n,
              "total_tokens": len(prompt_ids) + n}

    if not stream:
      text, n, reason, req = first
      async for delta, k, reason, req in gen:
        text, n = text + delta, n + k
      choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                 "finish_reason": reason} if chat else
                {"index": 0, "text": text, "logprobs": None, "finish_reason": reason})
      return {**envelope("chat.completion" if chat else "text_completion", rid, created),
              "choices": [choice], "usage": usage(n),
              "ddtree": {"acceptance_lengths": req.acceptance}}

    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    async def events():
      n, kind = 0, "chat.completion.chunk" if chat else "text_completion"
      async def chunks():
        yield first
        async for item in gen:
          yield item
      started = False
      async for delta, k, reason, req in chunks():
        n += k
        if chat:
          d = {"content": delta} if started else {"role": "assistant", "content": delta}
          choice = {"index": 0, "delta": d, "finish_reason": reason}
        else:
          choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}
        started = True
        event = {**envelope(kind, rid, created), "choices": [choice]}
        if reason is not None:
          event["ddtree"] = {"acceptance_lengths": req.acceptance}
        yield f"data: {json.dumps(event)}\n\n"
      if include_usage:
        yield f"data: {json.dumps({**envelope(kind, rid, created), 'choices': [], 'usage': usage(n)})}\n\n"
      yield "data: [DONE]\n\n"
    return responses.StreamingResponse(events(), media_type="text/event-stream")

  @app.post("/v1/completions")
  async def completions(request: fastapi.Request):
    body = await parse(request, "completions")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
      prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
      ids = encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in prompt):
      ids = prompt
    else:
      raise RequestError("prompt must be a string or a list of token ids (one prompt)", "prompt")
    if not ids:
      raise RequestError("prompt is empty", "prompt")
    return await respond(ids, body, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: fastapi.Request):
    body = await parse(request, "chat")
    messages = body.get("messages")
    if (not isinstance(messages, list) or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                   and isinstance(m.get("content"), str) for m in messages)):
      raise RequestError("messages must be a non-empty list of {role, content} objects with "
                         "string content", "messages")
    unknown = sorted({m["role"] for m in messages} - set(CHAT_ROLES))
    if unknown:
      raise RequestError(f"unknown role(s) {unknown}; roles are {list(CHAT_ROLES)}", "messages")
    try:
      text = template.render(messages=messages, add_generation_prompt=True, **special)
    except jinja2.TemplateError as e:
      raise RequestError(f"the chat template failed: {e}", "messages") from None
    return await respond(encode(text), body, chat=True)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                        "owned_by": "ddtree-jax"}]}

  @app.get("/health")
  async def health():
    return {"status": "ok", **engine.metrics()}

  @app.get("/metrics")
  async def prometheus():
    return responses.Response(metrics.render(), media_type=prometheus_client.CONTENT_TYPE_LATEST)

  return app
