"""Which row of the runner's block-table mirror each running request uses.

The runner keeps every running request's block table in one numpy array, a row per request, so
a step's tables are a fancy-index away and each row only receives the blocks added since the last
step. Rows belong to the runner: a sequence (one of a request's ``n`` completions) gets one the first
time it runs, and gives it back when the scheduler reports it released (finished, aborted or
preempted; ``ScheduledBatch``'s ``released_seq_ids``). A preempted sequence that runs again gets
a fresh row and its new table is copied whole.
"""

from __future__ import annotations

import numpy as np

from compiled_llm.serve.core.sequence import Sequence


class RequestRows:
    def __init__(self, max_rows: int, width: int):
        self.tables = np.zeros((max_rows, width), dtype=np.int32)
        self._row_of: dict[int, int] = {}  # seq_id -> row
        self._synced = [0] * max_rows  # block-table entries already copied into each row
        self._free = list(range(max_rows - 1, -1, -1))
        self.assigned_now: list[int] = []  # indices into the last rows_of call's seqs that got a fresh row

    def release(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            row = self._row_of.pop(sid, None)
            if row is not None:
                self._free.append(row)

    def rows_of(self, seqs: list[Sequence]) -> np.ndarray:
        """Each sequence's row, its new block-table entries copied in (a row is assigned on a
        request's first step)."""
        rows = np.empty(len(seqs), dtype=np.int64)
        self.assigned_now = []
        for i, s in enumerate(seqs):
            row = self._row_of.get(s.seq_id)
            if row is None:
                if not self._free:
                    raise RuntimeError("more running sequences than the runner has rows (max_num_seqs)")
                row = self._row_of[s.seq_id] = self._free.pop()
                self._synced[row] = 0
                self.assigned_now.append(i)
            k, n = self._synced[row], len(s.block_table)
            if n < k:
                raise RuntimeError(f"request {s.request_id!r}: its block table shrank while it held a row")
            if n > k:
                self.tables[row, k:n] = s.block_table[k:n]
                self._synced[row] = n
            rows[i] = row
        return rows

    @property
    def num_assigned(self) -> int:
        return len(self._row_of)
