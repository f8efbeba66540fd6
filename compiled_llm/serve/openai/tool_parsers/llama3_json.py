"""Llama 3.1's JSON tool calls: an answer that is ``{"name": ..., "parameters": {...}}`` (or
several, separated by ``;``), optionally after ``<|python_tag|>``. An answer that starts
otherwise, or does not parse whole, is content; so a streamed answer that starts like a call
is held until it ends."""

from __future__ import annotations

import json

from compiled_llm.serve.openai.tool_parsers.base import Item, ToolCall, partial_prefix_at_end

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser:
    arguments_key = "parameters"
    calls_per_span = None  # {...}; {...}

    def call_spans(self, text: str) -> list[tuple[int, int | None]]:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            return [(len(text) - len(body) + len(PYTHON_TAG), None)]
        return [(len(text) - len(body), None)] if body.startswith("{") else []

    def parse(self, text: str, final: bool) -> tuple[list[Item], int]:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        elif not body.startswith("{"):
            could_be_tag = body and partial_prefix_at_end(body, PYTHON_TAG) == 0
            if not final and (not body or could_be_tag):
                return [], 0
            return [text], len(text)
        if not final:
            return [], 0
        calls = _calls(body)
        return (calls if calls is not None else [text]), len(text)


def _calls(body: str) -> list[Item] | None:
    """The calls of ``{...}; {...}``, None unless all of it is calls."""
    decoder = json.JSONDecoder()
    calls: list[Item] = []
    pos = 0
    while True:
        try:
            _, end = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        call = ToolCall.from_json(body[pos:end], arguments_key="parameters")
        if call is None:
            return None
        calls.append(call)
        rest = body[end:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        pos = len(body) - len(rest[1:].lstrip())
