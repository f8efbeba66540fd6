"""Tool calls in a model's text, as vLLM's ``--tool-call-parser``: one module per format
(``hermes``: Qwen's ``<tool_call>{...}</tool_call>``; ``llama3_json``: Llama 3.1's JSON call),
``base`` what they share, ``stream`` the incremental split of a streamed answer, ``json_spans``
where the members of JSON still being written are)."""

from __future__ import annotations

from compiled_llm.serve.openai.tool_parsers.base import ToolCall, ToolParser
from compiled_llm.serve.openai.tool_parsers.hermes import HermesParser
from compiled_llm.serve.openai.tool_parsers.llama3_json import Llama3JsonParser

PARSERS: dict[str, ToolParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser()}


def parser_for_template(template: str | None) -> str | None:
    """The parser a chat template implies: Qwen's ``<tool_call>`` tags -> hermes; Llama 3.1's
    ``<|python_tag|>`` or ``"parameters"`` calls -> llama3_json; else none."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ('"parameters"' in template and "tools" in template):
        return "llama3_json"
    return None


__all__ = ["PARSERS", "ToolCall", "ToolParser", "parser_for_template"]
