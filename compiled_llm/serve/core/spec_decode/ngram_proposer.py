"""n-gram (prompt-lookup) proposals: the tokens that followed the latest earlier occurrence of
a sequence's last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that
occurred before.

Each sequence keeps an index from every n-gram of its tokens to the position just after its
latest occurrence, extended by the tokens appended since the previous proposal, so a step costs
O(new tokens x n) dictionary updates and one lookup per n, not a scan of the whole context.

A match near the end proposes fewer than k tokens unless the copy is continued through the
proposal itself: where the continuation runs into the end of the context, the text is taken to
repeat with the same period (an overlapping copy, as in LZ77), so a loop of period 2 still
proposes k tokens.
"""

from __future__ import annotations


class NgramIndex:
    """The n-gram index of one token list (which only grows)."""

    __slots__ = ("min_n", "max_n", "_next", "_indexed")

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence
        self._indexed = 0  # tokens[:_indexed] are indexed as followers

    def _extend(self, tokens: list[int]) -> None:
        """Index every n-gram that a known token follows (tokens[i] follows tokens[i-n:i])."""
        nxt, lo, hi = self._next, self.min_n, self.max_n
        for i in range(max(self._indexed, lo), len(tokens)):
            for n in range(lo, min(hi, i) + 1):
                nxt[tuple(tokens[i - n:i])] = i
        self._indexed = len(tokens)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier occurrence of tokens' suffix."""
        # the suffix itself is only indexed as a follower once a token comes after it, so the
        # lookup below never finds the suffix's own position
        self._extend(tokens)
        end = len(tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            start = self._next.get(tuple(tokens[end - n:]))
            if start is None:
                continue
            out: list[int] = []
            for j in range(k):
                src = start + j
                out.append(tokens[src] if src < end else out[src - end])
            return out
        return []
