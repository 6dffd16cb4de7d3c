"""Prompts for training a drafter from a user's corpus (`read_prompts`): JSONL records or plain text,
conversations rendered with the target's chat template, so that the drafter learns on the prompts
the target will serve. The responses are the target's own (experiments/train_drafter.py
regenerates them): a drafter must imitate its target, not the corpus.

A JSONL line is one object: {"messages": [{"role", "content"}, ...]} (OpenAI style; trailing
assistant turns are dropped, the target writes its own), {"conversations": [{"from", "value"},
...]} (ShareGPT style), {"prompt": "..."} (one user turn) or {"text": "..."} (raw text the target
continues, no template). Any other file is plain text: documents separated by blank lines, each
a raw prompt.
"""

from __future__ import annotations

import json
import os

from ddtree_jax.chat import CHAT_ROLES, compile_template

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}


class CorpusError(ValueError):
  """A corpus that yields no prompt, or one that cannot be read."""


def read_records(path: str) -> list:
  """The records of a corpus file: JSON objects of a .jsonl / .json lines file, else the
  blank-line-separated documents of a text file."""
  if not os.path.isfile(path):
    raise CorpusError(f"corpus {path!r}: no such file")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  if not path.endswith((".jsonl", ".json")):
    return [d.strip() for d in text.split("\n\n") if d.strip()]
  records = []
  for n, line in enumerate(text.splitlines(), 1):
    if line.strip():
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError as e:
        raise CorpusError(f"corpus {path!r} line {n}: not JSON ({e.msg})") from None
  return records


def messages_of(record) -> list[dict] | None:
  """A record's conversation up to its last non-assistant turn ([] when it has none), or None
  when the record is no conversation."""
  if isinstance(record, dict) and isinstance(record.get("messages"), list):
    turns = [(m.get("role"), m.get("content")) for m in record["messages"] if isinstance(m, dict)]
  elif isinstance(record, dict) and isinstance(record.get("conversations"), list):
    turns = [(SHAREGPT_ROLES.get(m.get("from")), m.get("value"))
             for m in record["conversations"] if isinstance(m, dict)]
  elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
    turns = [("user", record["prompt"])]
  else:
    return None
  turns = [(r, c) for r, c in turns if r in CHAT_ROLES and isinstance(c, str)]
  while turns and turns[-1][0] == "assistant":
    turns.pop()
  if not any(r == "user" for r, _ in turns):
    return []
  return [{"role": r, "content": c} for r, c in turns]


def read_prompts(path: str, tokenizer, template: str | None, special: dict | None = None,
                 max_len: int = 512) -> list[list[int]]:
  """Token ids of every usable prompt of the corpus at `path`: conversations rendered with
  `template` (a chat template; None: the target has none, so a conversation's turns are joined
  as plain text), raw texts as they are, both encoded by `tokenizer` (a `tokenizers`
  Tokenizer); a raw text longer than max_len tokens is cut to its first max_len, a rendered
  conversation that long is left out (cutting it would cut its template). CorpusError when none
  is usable, saying why the records were not."""
  records = read_records(path)
  render = None if template is None else compile_template(template)
  prompts, unusable, too_long = [], 0, 0
  for record in records:
    messages = messages_of(record)
    raw = record if isinstance(record, str) else (
        record.get("text") if isinstance(record, dict) and messages is None else None)
    if messages:
      if render is None:
        text = "\n\n".join(m["content"] for m in messages) + "\n\n"
      else:
        text = render.render(messages=messages, add_generation_prompt=True, **(special or {}))
      ids = tokenizer.encode(text, add_special_tokens=render is None).ids
      if len(ids) > max_len:
        too_long += 1
        continue
    elif isinstance(raw, str) and raw.strip():
      ids = tokenizer.encode(raw).ids[:max_len]
    else:
      unusable += 1
      continue
    if ids:
      prompts.append(ids)
    else:
      unusable += 1
  if not prompts:
    raise CorpusError(
        f"corpus {path!r} has no usable prompt: {len(records)} records, {unusable} with no user "
        f"turn, prompt or text, {too_long} conversations longer than {max_len} tokens (records: "
        "JSONL objects with messages, conversations, prompt or text, or blank-line-separated "
        "text)")
  return prompts
