"""A streamed answer's tool calls: the text is parsed again as it grows, and only what became
decided is sent, so the deltas concatenate to what the whole answer parses to. A call is sent
when it is complete: a first delta with its id, type and name, then its arguments."""

from __future__ import annotations

from typing import Any

from compiled_llm.serve.openai.tool_parsers.base import ToolCall, ToolParser, content_of, new_tool_call_id


class ToolCallStream:
    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser = parser
        self.max_calls = max_calls  # parallel_tool_calls false: 1
        self.text = ""
        self.sent_content = ""
        self.sent_calls = 0

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """The content delta and the tool-call deltas (OpenAI's ``delta.tool_calls`` entries)."""
        self.text += delta
        items, _ = self.parser.parse(self.text, final)
        content = content_of(items, final)
        content_delta = content[len(self.sent_content):] if content.startswith(self.sent_content) else ""
        self.sent_content += content_delta
        calls = [item for item in items if isinstance(item, ToolCall)][:self.max_calls]
        deltas = []
        for index in range(self.sent_calls, len(calls)):
            call = calls[index]
            deltas.append({"index": index, "id": new_tool_call_id(), "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
            deltas.append({"index": index, "function": {"arguments": call.arguments}})
        self.sent_calls = len(calls)
        return content_delta, deltas

    @property
    def called(self) -> bool:
        return self.sent_calls > 0
