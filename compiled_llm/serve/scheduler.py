"""Continuous batching: which sequences run in the next step, and how many tokens each.

Each step has a token budget (max_num_batched_tokens) and a cap on running sequences
(max_num_seqs). Running decodes go first, so a flood of new prompts never starves them; then
unfinished prefill chunks; then waiting requests in arrival order, a long prompt taking whatever
budget is left (chunked prefill). When the blocks run out, the most recently arrived running
sequence is preempted by recompute: its blocks are freed and it goes back to the front of the
queue, to re-prefill its prompt and the tokens it had generated (prefix caching often makes that
cheap).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from compiled_llm.serve.block_manager import BlockManager
from compiled_llm.serve.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits, taken from the engine's options (``EngineConfig``, where their
    defaults live)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 1:
            raise ValueError(f"scheduler limits must be >= 1: {self}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")


@dataclass
class ScheduledBatch:
    """One step: seqs[i] computes num_new_tokens[i] tokens starting at its num_computed_tokens
    (as it was when scheduled). sample_rows lists the rows that reach the end of their tokens
    and therefore sample a new token; the others are prefill chunks. released_request_ids are
    the requests that stopped running (finished, aborted, preempted) since the previous
    schedule: the runner gives their rows back before it places this step's requests."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    released_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def is_decode(self) -> bool:
        """Every row is a decode: it computes one token, its last, and samples the next (the
        CUDA-graph case). Whether a row decodes is a property of the row, never of the step's
        shape: a one-token chunk of a prompt computes one token too, but not the last one."""
        return bool(self.seqs) and len(self.sample_rows) == len(self.seqs) == self.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, stop_token_ids=()):
        self.config = config
        self.bm = block_manager
        self.eos_token_ids = frozenset(stop_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._released: list[str] = []
        self.num_preemptions = 0

    # ---- requests -----------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        """Drop a request now; its blocks go back to the free queue at once."""
        if seq.status is SequenceStatus.FINISHED:
            return
        self.finish(seq, "abort")

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._released.append(seq.request_id)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = time.perf_counter()

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._released.append(seq.request_id)
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- one step -----------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(released_request_ids=self._released)
        self._released = []
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()

        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        chunks = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + chunks:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.allocate_slots(seq, n):
                # Free blocks by preempting the lowest-priority (latest) sequence not yet
                # given work in this step; that may be seq itself.
                candidates = [s for s in self.running if id(s) not in scheduled]
                victim = max(candidates, key=lambda s: s.arrival)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._add(batch, seq, n)
                scheduled.add(id(seq))
                budget -= n

        # Admit waiting requests in order; none while this step had to preempt.
        while (
            self.waiting
            and budget > 0
            and not batch.preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            hits = self.bm.get_computed_blocks(seq)
            cached = len(hits) * self.bm.block_size
            n = seq.num_tokens - cached
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.bm.allocate_slots(seq, n, hits):
                break
            self.waiting.popleft()
            self.bm.record_lookup(seq.num_tokens, cached)
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.perf_counter()
                seq.metrics.num_cached_tokens = cached
            seq.num_computed_tokens = cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add(batch, seq, n)
            budget -= n
        return batch

    def schedule_ahead(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, list[int] | None] | None:
        """The decode step after ``batch`` (a decode step whose tokens are not applied yet),
        for the engine to queue before it waits for ``batch``: the same running sequences,
        minus those that finish by length with ``batch``'s token. None when that step is not
        a plain continuation: requests are waiting to be admitted (they must not wait behind a
        chain of steps queued ahead), nothing would be left, or a block is missing (the regular
        schedule then preempts). Also returns which rows of ``batch``'s sampled ids feed the
        new step (None: all, in order)."""
        if self.waiting or not batch.is_decode:
            return None
        limit = self.config.max_model_len
        ahead = ScheduledBatch()
        rows: list[int] = []
        for i, seq in enumerate(batch.seqs):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            # batch's token makes it num_tokens + 1 long; the step ahead adds one more
            if seq.num_output_tokens + 2 > seq.params.max_tokens or seq.num_tokens + 2 > limit:
                continue
            if not self.bm.allocate_slots(seq, seq.num_tokens + 1 - seq.num_computed_tokens):
                return None
            ahead.sample_rows.append(len(ahead.seqs))
            ahead.seqs.append(seq)
            ahead.num_new_tokens.append(1)
            rows.append(i)
        if ahead.is_empty:
            return None
        return ahead, (None if len(rows) == len(batch.seqs) else rows)

    @staticmethod
    def _add(batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        if seq.num_computed_tokens + n == seq.num_tokens:
            batch.sample_rows.append(len(batch.seqs))
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)

    def update(self, batch: ScheduledBatch, sampled: list[int]) -> list[Sequence]:
        """Account for a finished step: sampled[j] is the new token of row batch.sample_rows[j].
        Returns the sequences that got a token (finished ones included); sequences that hit
        EOS, a stop token id or max_tokens are finished and their blocks freed."""
        assert len(sampled) == len(batch.sample_rows)
        now = time.perf_counter()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.bm.commit(seq)
        out: list[Sequence] = []
        for row, token in zip(batch.sample_rows, sampled):
            seq = batch.seqs[row]
            seq.token_ids.append(token)
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            out.append(seq)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
        return out

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None
