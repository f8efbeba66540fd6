"""tool_choice "required" and a named function, as vLLM does them: the answer is decoded under a
JSON schema built from the tools (structured outputs), so it always parses into calls.

- a named function: the schema is that function's ``parameters`` (none: any object), and the
  whole answer is the call's arguments;
- "required": the answer is a JSON array of ``{"name": <a tool's name>, "parameters": <that
  tool's parameters>}`` items (``anyOf`` over the tools), at least one, and at most one when
  parallel_tool_calls is false. The tools' ``$defs`` move to the array schema's root, where
  their ``#/$defs/...`` references point.
"""

from __future__ import annotations

import json
from typing import Any

from compiled_llm.errors import InvalidRequestError
from compiled_llm.serve.openai.tool_parsers.base import ToolCall
from compiled_llm.serve.openai.tool_parsers.json_spans import ObjectScanner
from compiled_llm.serve.openai.tool_parsers.stream import scanned_call

# a function without parameters takes any object, as its arguments are one
ANY_OBJECT: dict[str, Any] = {"type": "object"}
DEFINITIONS = ("$defs", "definitions")  # where schemas keep the parts their refs name


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema (a copy), any object when it has none."""
    schema = tool["function"].get("parameters")
    return dict(schema) if schema else dict(ANY_OBJECT)


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return parameters(tool)


def required_schema(tools: list[dict[str, Any]], max_calls: int | None) -> dict[str, Any]:
    """The array of calls: each item one tool's name and its parameters."""
    hoisted: dict[str, dict[str, Any]] = {}
    cases = []
    for tool in tools:
        params = parameters(tool)
        for where in DEFINITIONS:
            for name, part in (params.pop(where, None) or {}).items():
                key = (where, name)
                if hoisted.setdefault(key, part) != part:
                    raise InvalidRequestError(f"tools define {where}/{name} differently; tool_choice 'required' "
                                              f"needs each name in {where} to mean one schema across the tools")
        cases.append({"type": "object", "properties": {"name": {"const": tool["function"]["name"]}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": cases}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    for (where, name), part in hoisted.items():
        schema.setdefault(where, {})[name] = part
    return schema


def parse_required(text: str) -> list[ToolCall] | None:
    """The calls of a "required" answer; None when it is not a whole array of calls (an answer
    cut short by max_tokens). Each call's arguments are the model's own JSON text."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list) or not value or not all(
            isinstance(item, dict) and isinstance(item.get("name"), str) and item["name"]
            and isinstance(item.get("parameters"), dict) for item in value):
        return None
    scanner = ObjectScanner(depth=2)
    scanner.feed(text)
    calls = [scanned_call(scanner, obj, "parameters") for obj in scanner.objects]
    return [ToolCall(name, arguments) for name, arguments in calls]
