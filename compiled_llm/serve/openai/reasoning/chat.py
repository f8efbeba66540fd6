"""The chat endpoint's side of reasoning: a reply's message fields, and its stream's deltas, with
the ``<think>`` block as ``reasoning_content`` and the rest as ``content``."""

from __future__ import annotations

import dataclasses

from compiled_llm.serve.openai.reasoning.parsers import PARSERS, ReasoningParser, prompt_ends_think
from compiled_llm.serve.openai.reasoning.think_tags import CLOSE
from compiled_llm.serve.openai.reasoning.think_tags import ThinkStream

# Enough of the prompt's end to see whether its generation prompt opened a think block.
PROMPT_TAIL_TOKENS = 8


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    return None if name is None else PARSERS[name]


def prompt_tail(tokenizer, prompt_ids: list[int]) -> str:
    """The rendered prompt's end, special tokens kept (the think tags may be special)."""
    if tokenizer is None or not prompt_ids:
        return ""
    return tokenizer.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)


def after_thinking(structured, tokenizer, prompt_ids: list[int]):
    """``structured`` (StructuredOutputsParams) for a reasoning model: constraining the answer
    after ``</think>``, not the thinking, unless the prompt already closed the think block, as
    vLLM does. Where ``</think>`` is no single token the grammar constrains the whole output."""
    if structured is None or tokenizer is None or prompt_ends_think(prompt_tail(tokenizer, prompt_ids)):
        return structured
    ids = tokenizer.encode(CLOSE, add_special_tokens=False)
    if len(ids) != 1:
        return structured
    return dataclasses.replace(structured, start_after_token_id=ids[0])


class ChatReasoning:
    """One request's reasoning split: ``message`` for a whole reply, ``delta`` per streamed
    delta of each choice (its own stream per choice index)."""

    def __init__(self, parser: ReasoningParser, tail: str):
        self.parser, self.tail = parser, tail
        self.streams: dict[int, ThinkStream] = {}

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole reply as (reasoning_content, the answer after it)."""
        reasoning, content = self.parser.split(text, self.tail)
        return reasoning, content or ""

    def delta(self, index: int, text: str, finished: bool) -> dict:
        stream = self.streams.setdefault(index, self.parser.stream(self.tail))
        reasoning, content = stream.feed(text)
        if finished:
            more_reasoning, more_content = stream.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        return delta
