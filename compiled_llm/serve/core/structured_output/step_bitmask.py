"""A step's token bitmask: one row per sampled logits row, each structured sequence's allowed
tokens, every token for the others (-1 words)."""

from __future__ import annotations

from typing import Sequence

import torch
import xgrammar as xgr

from compiled_llm.serve.core.structured_output.grammar_matcher import GrammarMatcher

# From this many structured rows a step's rows are filled on xgrammar's thread pool
BATCH_FILL_MIN_ROWS = 8


class StepBitmask:
    """Pinned host rows for up to ``max_rows`` logits rows of a ``vocab_size`` vocabulary, two
    of them taking turns (a step's copy to the device may still be reading the other)."""

    def __init__(self, max_rows: int, vocab_size: int, pin: bool):
        words = (vocab_size + 31) // 32
        self.buffers = [torch.full((max_rows, words), -1, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self._batch = None

    def fill(self, matchers: Sequence[GrammarMatcher | None], drafts: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """The bitmask of a step whose rows belong to ``matchers`` (None: not structured) in
        order, each seq with 1 + len(drafts[i]) consecutive rows in a verification step."""
        self._turn ^= 1
        counts = [1] * len(matchers) if drafts is None else [1 + len(d) for d in drafts]
        out = self.buffers[self._turn][:sum(counts)]
        out.fill_(-1)
        row = 0
        plain: list[tuple[xgr.GrammarMatcher, int]] = []
        for i, (m, n) in enumerate(zip(matchers, counts)):
            if m is not None and not m.released and not m.is_terminated:
                if n == 1:
                    plain.append((m.matcher, row))
                else:
                    m.fill_after(drafts[i][:n - 1], out, row)
            row += n
        if len(plain) >= BATCH_FILL_MIN_ROWS:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask([m for m, _ in plain], out, [r for _, r in plain])
        else:
            for m, r in plain:
                m.fill_next_token_bitmask(out, r)
        return out
