"""Hermes tool calls, Qwen2.5's and Qwen3's: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
any number of them, with text around them. A call the model leaves open at the end of its
answer counts when its JSON is whole."""

from __future__ import annotations

from compiled_llm.serve.openai.tool_parsers.base import Item, ToolCall, merged, partial_prefix_at_end

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser:
    arguments_key = "arguments"
    calls_per_span = 1

    def call_spans(self, text: str) -> list[tuple[int, int | None]]:
        spans, pos = [], text.find(OPEN)
        while pos >= 0:
            start = pos + len(OPEN)
            close = text.find(CLOSE, start)
            if close < 0:  # a closing tag may be under way at the end
                spans.append((start, partial_prefix_at_end(text, CLOSE)))
                break
            spans.append((start, close))
            pos = text.find(OPEN, close + len(CLOSE))
        return spans

    def parse(self, text: str, final: bool) -> tuple[list[Item], int]:
        items: list[Item] = []
        pos = 0
        while True:
            start = text.find(OPEN, pos)
            if start < 0:
                end = len(text) if final else partial_prefix_at_end(text[pos:], OPEN) + pos
                items.append(text[pos:end])
                return merged(items), end
            items.append(text[pos:start])
            body_start = start + len(OPEN)
            close = text.find(CLOSE, body_start)
            if close < 0:
                if not final:
                    return merged(items), start
                call = ToolCall.from_json(text[body_start:].strip())
                items.append(call if call is not None else text[start:])
                return merged(items), len(text)
            call = ToolCall.from_json(text[body_start:close].strip())
            pos = close + len(CLOSE)
            items.append(call if call is not None else text[start:pos])
