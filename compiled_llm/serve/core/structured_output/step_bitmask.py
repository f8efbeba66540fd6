"""A step's token bitmask: one row per sampled logits row, each structured sequence's allowed
tokens, every token for the others (-1 words).

Filling a row can take a few hundred microseconds (a JSON string's state leaves thousands of
tokens to check against the rest of the grammar), more than the host's whole share of a decode
step. So the rows of a step whose sampling waits for the previous step's tokens are filled on a
thread of their own (``start``) as soon as those tokens are accepted, while the main thread goes
on with the outputs and the next launch; the fill runs in xgrammar's batch matcher, which
releases the GIL, over its own threads."""

from __future__ import annotations

import concurrent.futures
import os
from typing import Sequence

import numpy as np
import torch

from compiled_llm.serve.core.structured_output.grammar_matcher import GrammarMatcher


# Rows a fill thread takes at least: each call of xgrammar's batch matcher starts all its
# threads, ~200 µs each, while most rows filled (a JSON structure's) take a few microseconds
ROWS_PER_THREAD = 32


def fill_threads() -> int:
    """xgrammar's fill threads: the cores left after the engine's own thread."""
    return max(1, min(16, (os.cpu_count() or 2) - 1))


class StepBitmask:
    """Pinned host rows for up to ``max_rows`` logits rows of a ``vocab_size`` vocabulary, two
    of them taking turns (a step's copy to the device may still be reading the other)."""

    def __init__(self, max_rows: int, vocab_size: int, pin: bool):
        words = (vocab_size + 31) // 32
        self.vocab_size = vocab_size
        self.buffers = [torch.full((max_rows, words), -1, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self._batch_matchers: dict = {}  # thread count -> xgrammar BatchGrammarMatcher
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-bitmask")
        self._started: tuple[tuple[int, ...], concurrent.futures.Future] | None = None

    def start(self, matchers: Sequence[GrammarMatcher | None]) -> None:
        """Begin filling the rows of a step whose rows belong to ``matchers`` (None: not
        structured), on the fill thread; ``fill`` with the same matchers takes the result."""
        out, plain = self._next_buffer(len(matchers)), self._rows(matchers)
        # xgrammar's matchers are taken here: a sequence finishing meanwhile releases its own
        xgr_matchers = [m.matcher for m, _ in plain]
        self._started = (tuple(map(id, matchers)), plain,
                         self._thread.submit(self._fill_rows, out, xgr_matchers, [r for _, r in plain]))

    def fill(self, matchers: Sequence[GrammarMatcher | None], drafts: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """The bitmask of a step whose rows belong to ``matchers`` in order, each seq with
        1 + len(drafts[i]) consecutive rows in a verification step."""
        started, self._started = self._started, None
        if drafts is None and started is not None and started[0] == tuple(map(id, matchers)):
            return self._saw(*started[2].result(), started[1])
        if started is not None:
            started[2].result()  # not this step's: let it finish before its buffer is written again
        counts = [1] * len(matchers) if drafts is None else [1 + len(d) for d in drafts]
        out = self._next_buffer(sum(counts))
        out.fill_(-1)
        plain = []
        row = 0
        for i, (m, n) in enumerate(zip(matchers, counts)):
            if _live(m):
                if n == 1:
                    plain.append((m, row))
                else:
                    m.fill_after(drafts[i][:n - 1], out, row)
            row += n
        return self._saw(*self._fill_rows(out, [m.matcher for m, _ in plain], [r for _, r in plain], clear=False), plain)

    def _saw(self, out: torch.Tensor, allowed: list[int], plain: list[tuple[GrammarMatcher, int]]) -> torch.Tensor:
        """``out``, its rows' widths (``allowed``) told to their matchers
        (``GrammarMatcher.saw_mask``), here on the caller's thread: the step's choice of rows
        to mask was made before."""
        for (m, _), n in zip(plain, allowed):
            m.saw_mask(n, self.vocab_size)
        return out

    def close(self) -> None:
        """End the fill thread (after the fill it may be running)."""
        self._thread.shutdown(wait=True)

    def _batch_matcher(self, rows: int):
        """xgrammar's batch matcher for ``rows`` rows: a thread per ROWS_PER_THREAD rows, up to
        the cores (each call pays every thread's start, and a row is never split between
        threads)."""
        import xgrammar as xgr

        threads = max(1, min(fill_threads(), rows // ROWS_PER_THREAD))
        if threads not in self._batch_matchers:
            self._batch_matchers[threads] = xgr.BatchGrammarMatcher(threads)
        return self._batch_matchers[threads]

    def _next_buffer(self, rows: int) -> torch.Tensor:
        self._turn ^= 1
        return self.buffers[self._turn][:rows]

    @staticmethod
    def _rows(matchers: Sequence[GrammarMatcher | None]) -> list[tuple[GrammarMatcher, int]]:
        return [(m, r) for r, m in enumerate(matchers) if _live(m)]

    @torch.inference_mode()  # the buffers are the runner's inference tensors, on any thread
    def _fill_rows(self, out: torch.Tensor, matchers: list, rows: list[int],
                   clear: bool = True) -> tuple[torch.Tensor, list[int]]:
        """``out`` with ``rows`` filled by xgrammar's ``matchers``, and about how many tokens
        each allows."""
        if clear:
            out.fill_(-1)
        if not rows:
            return out, []
        self._batch_matcher(len(rows)).batch_fill_next_token_bitmask(matchers, out, rows)
        return out, allowed_estimate(out, rows)


# Every how many words of a bitmask row its allowed tokens are counted (an estimate: a state's
# allowed tokens are spread over the vocabulary, and only its share is wanted)
COUNT_STRIDE = 8


def allowed_estimate(bitmask: torch.Tensor, rows: list[int]) -> list[int]:
    """About how many tokens each of the bitmask's ``rows`` allows."""
    words = bitmask[:, ::COUNT_STRIDE].numpy()[rows].view(np.uint32)
    return (np.bitwise_count(words).sum(axis=1, dtype=np.int64) * COUNT_STRIDE).tolist()


def _live(m: GrammarMatcher | None) -> bool:
    return m is not None and m.constrains
