"""What every tool-call format shares: a parsed call, and what a parser does.

A parser splits a text into items, each a piece of content (``str``) or a ``ToolCall``, and
says how much of the text is decided: the rest may still become a call (a partial
``<tool_call>`` tag, a call not yet closed). With ``final`` the whole text is decided. A call
whose JSON does not parse stays content, as in vLLM. A parser also says where calls' JSON starts,
so that a stream can send a call while it is being written (``stream.py``)."""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, Protocol

from compiled_llm.serve.openai.tool_parsers.json_spans import ObjectScanner


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON text, as the OpenAI API carries it

    @staticmethod
    def from_json(body: str, arguments_key: str = "arguments") -> ToolCall | None:
        """``{"name": ..., "<arguments_key>": {...}}`` as a call, None when it is not one. Arguments
        that are an object keep the model's own text (what a stream sends piece by piece)."""
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        key = arguments_key if arguments_key in obj else "arguments"
        args = obj.get(key, {})
        if isinstance(args, str):  # some models write the arguments as a JSON string already
            try:
                args = json.loads(args)
            except ValueError:
                return None
            return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
        if isinstance(args, (dict, list)) and key in obj:
            scanner = ObjectScanner(depth=1, max_objects=1)
            scanner.feed(body)
            return ToolCall(obj["name"], scanner.value_text(scanner.objects[0].members[key]))
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))

    def openai(self, id: str | None = None) -> dict[str, Any]:
        return {"id": id or new_tool_call_id(), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


Item = str | ToolCall


class ToolParser(Protocol):
    # the key of a call's arguments ("arguments" is read too)
    arguments_key: str
    # how many calls' JSON objects one span of call_spans holds (None: any number)
    calls_per_span: int | None

    def parse(self, text: str, final: bool) -> tuple[list[Item], int]:
        """The items of ``text[:decided]``, and ``decided``."""

    def call_spans(self, text: str) -> list[tuple[int, int | None]]:
        """Where the JSON of calls is: from after a call's opening tag to its closing tag, or to
        the end of the text so far (None), short of what may be the start of a closing tag. A
        stream sends a call from there as it is written, before the parse has decided it."""


def content_of(items: list[Item], final: bool) -> str:
    """The text outside the calls: each piece without the whitespace that touches a call, and
    (until ``final``) without a trailing whitespace a call may yet follow."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, ToolCall):
            continue
        if i > 0 and isinstance(items[i - 1], ToolCall):
            item = item.lstrip()
        if (i + 1 < len(items) and isinstance(items[i + 1], ToolCall)) or (i + 1 == len(items) and not final):
            item = item.rstrip()
        out.append(item)
    return "".join(out)


def merged(items: list[Item]) -> list[Item]:
    """Adjacent pieces of content as one."""
    out: list[Item] = []
    for item in items:
        if isinstance(item, str) and out and isinstance(out[-1], str):
            out[-1] += item
        elif item != "":
            out.append(item)
    return out


def partial_prefix_at_end(text: str, tag: str) -> int:
    """Where a proper prefix of ``tag`` ending ``text`` starts (len(text) when none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return len(text) - k
    return len(text)
