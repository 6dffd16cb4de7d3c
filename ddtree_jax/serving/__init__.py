"""Serving: the slot engine, its device programs and the OpenAI-compatible server."""
