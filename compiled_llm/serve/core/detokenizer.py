"""Incremental detokenization and stop strings.

Decoding the whole output after every token costs O(n^2); instead each step decodes a short
window (the tokens since the last emitted text, plus the previous window for context) and keeps
the difference, as vLLM does. A window that ends inside a multi-byte character decodes to
U+FFFD and waits for the next token. Stop strings are searched only in the text that can
contain a new match, and (vLLM's ``min_tokens``) only once there are more than min_tokens
tokens; a hit cuts the text where the stop string starts (or where it ends, with
``include_stop``), and ``stop_string`` says which one it was. While streaming, the last
len(longest stop) - 1 characters are held back, so a stop string is never half-sent.

The text is kept as the pieces it grew by (``TextPieces``): a step appends its piece, searches
stop strings in the tail and streams from it, so a long output costs linear time; ``text`` joins
the whole only when read.
"""

from __future__ import annotations

from typing import Sequence

from compiled_llm.serve.core.text_pieces import TextPieces, TextSnapshot


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: Sequence[str] = (), include_stop: bool = False, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.stop_string: str | None = None
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.pieces = TextPieces()
        self._tail = ""  # the text's last ``hold`` characters, where a stop string may have begun
        self._prefix_offset = 0
        self._read_offset = 0
        self._streamed = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> bool:
        """Append one token; True when the text now contains a stop string (cut off)."""
        return self.add_tokens((token,))

    def add_tokens(self, tokens: Sequence[int]) -> bool:
        """Append tokens, decoding the new window once (a stream's front end that fell behind
        catches up in one call). Without stop strings only: a stop string must be found at the
        token that completes it."""
        self.token_ids.extend(tokens)
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        delta = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        if self.stop:
            # a new match ends in the delta, so it starts in it or in the last hold characters
            window = self._tail + delta
            start = len(self.pieces) - len(self._tail)
            self._tail = window[-self.hold:] if self.hold else ""
            searched = len(self.token_ids) > self.min_tokens
            hits = [(i, s) for i, s in ((window.find(s), s) for s in self.stop) if i >= 0] if searched else []
            if hits:
                at, self.stop_string = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
                self.pieces.append(delta)
                self.pieces.truncate(start + at + (len(self.stop_string) if self.include_stop else 0))
                self.stopped = True
                return True
        self.pieces.append(delta)
        return self.stopped

    @property
    def text(self) -> str:
        """The whole text so far (joined on reading)."""
        return self.pieces.value()

    def snapshot(self) -> TextSnapshot:
        """The text as it is now, joined only if read (what an output carries)."""
        return self.pieces.snapshot()

    def finalize(self) -> None:
        """At the end (not cut by a stop string): the exact decode of all output tokens, which
        also flushes a trailing incomplete character."""
        if not self.stopped:
            self.pieces.replace(self._decode(self.token_ids))

    def take_delta(self, finished: bool) -> str:
        """Text not yet streamed; holds back a possible stop-string prefix unless finished."""
        length = len(self.pieces)
        end = length if finished else max(length - self.hold, self._streamed)
        delta = self.pieces.slice(self._streamed, end)
        self._streamed = end
        return delta
