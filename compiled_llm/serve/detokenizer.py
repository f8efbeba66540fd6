"""Incremental detokenization and stop strings.

Decoding the whole output after every token costs O(n^2); instead each step decodes a short
window (the tokens since the last emitted text, plus the previous window for context) and keeps
the difference, as vLLM does. A window that ends inside a multi-byte character decodes to
U+FFFD and waits for the next token. Stop strings are searched only in the text that can
contain a new match, and (vLLM's ``min_tokens``) only once there are more than min_tokens tokens; a hit cuts the text where the stop string starts (or where it ends, with
``include_stop``), and ``stop_string`` says which one it was. While streaming, the
last len(longest stop) - 1 characters are held back, so a stop string is never half-sent.
"""

from __future__ import annotations

from typing import Sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: Sequence[str] = (), include_stop: bool = False, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.stop_string: str | None = None
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
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
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        if self.stop and len(self.token_ids) > self.min_tokens:
            hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
            if hits:
                at, self.stop_string = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
                self.text = self.text[: at + (len(self.stop_string) if self.include_stop else 0)]
                self.stopped = True
        return self.stopped

    def finalize(self) -> None:
        """At the end (not cut by a stop string): the exact decode of all output tokens, which
        also flushes a trailing incomplete character."""
        if not self.stopped:
            self.text = self._decode(self.token_ids)

    def take_delta(self, finished: bool) -> str:
        """Text not yet streamed; holds back a possible stop-string prefix unless finished."""
        end = len(self.text) if finished else max(len(self.text) - self.hold, self._streamed)
        delta = self.text[self._streamed:end]
        self._streamed = end
        return delta
