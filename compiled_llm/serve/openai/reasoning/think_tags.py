"""Reasoning between ``<think>`` and ``</think>``: a finished output split into (reasoning,
content), and the same split made delta by delta while it streams.

The rule, one for both: an output that starts with the open tag, or one whose prompt already
opened the block (``starts_in_reasoning``), is reasoning up to the first close tag and content
after it; a block never closed is all reasoning (a reply cut short by max_tokens). An output
that starts outside the block is all content, tags and all. Reasoning is None when the output
never was in a block; content is None when empty, as vLLM's.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(text: str, starts_in_reasoning: bool) -> tuple[str | None, str | None]:
    """(reasoning, content) of a finished output."""
    if text.startswith(OPEN):
        text, starts_in_reasoning = text[len(OPEN):], True
    if not starts_in_reasoning:
        return None, text or None
    reasoning, closed, content = text.partition(CLOSE)
    return reasoning, (content or None) if closed else None


def _partial_tag_at_end(text: str, tag: str) -> int:
    """How many of ``text``'s last characters begin ``tag`` (held back until the next delta)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ThinkStream:
    """``split_reasoning`` over text deltas: ``feed`` each delta, then ``finish``; each returns
    (reasoning delta, content delta). A tag split across deltas is held back until it is whole,
    so the deltas always add up to ``split_reasoning`` of the whole text."""

    def __init__(self, starts_in_reasoning: bool):
        self.state = "start"  # before it is known whether the output opens the block
        self.starts_in_reasoning = starts_in_reasoning
        self.held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        text, self.held = self.held + delta, ""
        reasoning = ""
        if self.state == "start":
            if OPEN.startswith(text) and len(text) < len(OPEN):
                self.held = text  # maybe the open tag, not yet whole
                return "", ""
            if text.startswith(OPEN):
                text, self.state = text[len(OPEN):], "reasoning"
            else:
                self.state = "reasoning" if self.starts_in_reasoning else "content"
        if self.state == "reasoning":
            before, closed, after = text.partition(CLOSE)
            if not closed:
                k = _partial_tag_at_end(text, CLOSE)
                self.held = text[len(text) - k:] if k else ""
                return text[:len(text) - k], ""
            reasoning, text, self.state = before, after, "content"
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """What is still held back: a tag's beginning that the output ended in."""
        held, self.held = self.held, ""
        if self.state == "start":
            self.state = "reasoning" if self.starts_in_reasoning else "content"
        return (held, "") if self.state == "reasoning" else ("", held)
