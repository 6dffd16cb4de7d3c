"""Chat templates: a checkpoint's own (tokenizer_config.json's `chat_template`, rendered in jinja2's
sandbox, never as code), or a plain default. The server renders requests' messages with it; drafter
training renders a corpus's conversations with it, so the drafter sees the prompts the target
will serve."""

from __future__ import annotations

import json
import os

import jinja2.sandbox

CHAT_ROLES = ("system", "user", "assistant", "tool")
# Used when a checkpoint's tokenizer_config.json has no chat_template.
DEFAULT_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def load_chat_template(path: str | None) -> tuple[str, dict[str, str]]:
  """(template, special tokens) from `path`/tokenizer_config.json, or the default template."""
  file = os.path.join(path, "tokenizer_config.json") if path else ""
  if not file or not os.path.exists(file):
    return DEFAULT_CHAT_TEMPLATE, {}
  with open(file) as f:
    cfg = json.load(f)
  template = cfg.get("chat_template") or DEFAULT_CHAT_TEMPLATE
  if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
    template = next((t["template"] for t in template if t.get("name") == "default"),
                    template[0]["template"])
  tokens = {k: v if isinstance(v, str) else (v or {}).get("content", "")
            for k, v in cfg.items() if k in ("bos_token", "eos_token")}
  return template, tokens


def has_chat_template(path: str | None) -> bool:
  """Whether `path`/tokenizer_config.json carries a chat template of its own."""
  file = os.path.join(path, "tokenizer_config.json") if path else ""
  if not file or not os.path.exists(file):
    return False
  with open(file) as f:
    return bool(json.load(f).get("chat_template"))


def compile_template(text: str):
  """A jinja2 template of `text` in the immutable sandbox (what a checkpoint's template may do)."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  return env.from_string(text)
