"""The reasoning parsers ``--reasoning-parser`` names, as vLLM's of the same names.

``qwen3``: reasoning when the output opens ``<think>`` or the prompt's generation prompt did
(Qwen3's thinking templates end it with ``<think>``); otherwise (``enable_thinking`` false,
whose template closes an empty block in the prompt) the output is all content.
``deepseek_r1``: the output is always reasoning until ``</think>`` (DeepSeek-R1 opens the
block in its template, and its older versions never write ``<think>``).
"""

from __future__ import annotations

import dataclasses

from compiled_llm.serve.openai.reasoning.think_tags import CLOSE, OPEN, ThinkStream, split_reasoning


def prompt_opens_think(prompt_tail: str) -> bool:
    """Whether a rendered prompt ends inside an open think block (its end is ``<think>``)."""
    return prompt_tail.rstrip().endswith(OPEN)


def prompt_ends_think(prompt_tail: str) -> bool:
    """Whether a rendered prompt closed its think block (``enable_thinking`` false renders an
    empty one): the answer starts at once."""
    return CLOSE in prompt_tail and prompt_tail.rfind(CLOSE) > prompt_tail.rfind(OPEN)


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    name: str
    always_reasoning: bool  # deepseek_r1: the block is open whatever the prompt says

    def starts_in_reasoning(self, prompt_tail: str) -> bool:
        return self.always_reasoning or prompt_opens_think(prompt_tail)

    def split(self, text: str, prompt_tail: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a finished output."""
        return split_reasoning(text, self.starts_in_reasoning(prompt_tail))

    def stream(self, prompt_tail: str) -> ThinkStream:
        return ThinkStream(self.starts_in_reasoning(prompt_tail))


PARSERS = {p.name: p for p in (ReasoningParser("qwen3", False), ReasoningParser("deepseek_r1", True))}

__all__ = ["CLOSE", "OPEN", "PARSERS", "ReasoningParser", "prompt_ends_think", "prompt_opens_think"]
