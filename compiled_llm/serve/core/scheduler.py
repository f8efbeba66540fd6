"""Continuous batching: which sequences run in the next step, and how many tokens each.

Each step has a token budget (max_num_batched_tokens) and a cap on running sequences
(max_num_seqs). Running decodes go first, so a flood of new prompts never starves them; then
unfinished prefill chunks; then waiting requests in arrival order, a long prompt taking whatever
budget is left (chunked prefill). When the blocks run out, the most recently arrived running
sequence is preempted by recompute: its blocks are freed and it goes back to the front of the
queue, to re-prefill its prompt and the tokens it had generated (prefix caching often makes that
cheap).

A request with structured outputs is admitted once its grammar is compiled; until then the
requests behind it pass it (``has_schedulable``). Its sequence's matcher has taken each token
before it is applied (the engine checks them, ``update_verified`` here), ends the sequence when
the grammar has taken a stop token, and trims speculative drafts to what the grammar allows. A
sequence whose token the engine had to draw again is ``stale_ahead``: the step queued ahead
used the first draw, so its row there is dropped and no further step is queued ahead of it.

Blocks are given step by step (``BlockManager.allocate_slots``), never reserved for a whole
context. With a sliding window on every layer, giving a sequence its slots first gives back its
blocks behind the window, so a sequence holds about window / block_size blocks however long it
runs, and those freed blocks serve the same step; admission and preemption need no other rule.
A sibling sharing a prompt whose blocks its source gave back already takes the prefix cache's
copy instead (``_computed_blocks``).

A decode step lists its rows longest context first: the decode attention kernel starts its
programs row by row, and the long ones must not be left for the tail.

One exception to "decodes first": with a prefill CUDA graph available
(``solo_prefill_max_tokens``), a trickle of new prompts (at most that many tokens waiting in all)
runs one prompt per step on its own, ahead of the decodes. A prompt mixed into the decode batch
would make that step eager, whose host cost alone is many times a graph step's; alone, the
prompt replays a prefill graph and the decodes their decode graph, so the new request's first
token comes sooner and the running ones lose less time.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from compiled_llm.serve.core.block_manager import BlockManager
from compiled_llm.serve.core.sequence import Sequence, SequenceStatus
from compiled_llm.serve.core.spec_decode.speculator import Speculator

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits, taken from the engine's options (``EngineConfig``, where their
    defaults live)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    # largest prompt that runs alone, ahead of the decodes, when few tokens wait (module
    # docstring); 0: never (no prefill graphs)
    solo_prefill_max_tokens: int = 0

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 1:
            raise ValueError(f"scheduler limits must be >= 1: {self}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")


@dataclass
class ScheduledBatch:
    """One step: seqs[i] computes num_new_tokens[i] tokens starting at its num_computed_tokens
    (as it was when scheduled). sample_rows lists the rows that reach the end of their tokens
    and therefore sample a new token; the others are prefill chunks. released_seq_ids are
    the sequences that stopped running (finished, aborted, preempted) since the previous
    schedule: the runner gives their rows back before it places this step's sequences."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    released_seq_ids: list[int] = field(default_factory=list)
    # a verification step: each seq's draft tokens (maybe none), computed after its last token
    draft_tokens: list[list[int]] | None = None
    # a step queued ahead: its last host_fed rows compute their seq's last token, known on the
    # host (seqs whose row in the step before was stale), not the one the step before samples
    host_fed: int = 0

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

    @property
    def is_verify(self) -> bool:
        """A decode step whose sequences also compute draft tokens (one logits row per token)."""
        return self.draft_tokens is not None


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, stop_token_ids=(),
                 speculator: Speculator | None = None):
        self.config = config
        self.bm = block_manager
        self.speculator = speculator
        self.eos_token_ids = frozenset(stop_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._released: list[int] = []
        self.num_preemptions = 0
        # seqs whose token in the step queued ahead was computed from a token since replaced
        self.stale_ahead: set[int] = set()

    # ---- requests -----------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_schedulable(self) -> bool:
        """Whether a step would have work: something runs, or a waiting sequence does not wait
        for its grammar."""
        return bool(self.running) or any(not s.waits_for_grammar for s in self.waiting)

    def abort(self, seq: Sequence) -> None:
        """Drop a request now; its blocks go back to the free queue at once."""
        if seq.status is SequenceStatus.FINISHED:
            return
        self.finish(seq, "abort")

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._released.append(seq.seq_id)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        if seq.grammar is not None:
            seq.grammar.release()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = time.perf_counter()

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._released.append(seq.seq_id)
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- one step -----------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(released_seq_ids=self._released)
        self._released = []
        if self._admit_solo(batch):
            return batch
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()

        # A seq whose prompt log-probabilities are asked for is prefilled like any other, in
        # chunks, but its step yields a row of logits per prompt position (ModelRunner.
        # _logits_rows): ``extra_rows`` counts the rows beyond one per seq, so a step never
        # holds more logits than the max_num_seqs rows the engine's memory profile samples.
        extra_rows = 0
        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        chunks = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + chunks:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.wants_prompt_logprobs:
                n = min(n, 1 + self.config.max_num_seqs - len(self.running) - extra_rows)
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
                extra_rows += n - 1 if seq.wants_prompt_logprobs else 0

        # Admit waiting requests in order; none while this step had to preempt. A sibling
        # waiting to share its first completion's prompt is passed over until it can.
        i = 0
        while (
            i < len(self.waiting)
            and budget > 0
            and not batch.preempted
            and len(self.running) + extra_rows < self.config.max_num_seqs
        ):
            seq = self.waiting[i]
            if seq.waits_for_grammar:
                i += 1
                continue
            source = seq.share_prompt_of
            if source is not None and source.is_finished:
                source = seq.share_prompt_of = None
            if source is not None and not (
                source.status is SequenceStatus.RUNNING and source.num_computed_tokens >= source.num_prompt_tokens
            ):
                i += 1
                continue
            hits = self._computed_blocks(seq, source)
            cached = len(hits) * self.bm.block_size
            n = seq.num_tokens - cached
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if seq.wants_prompt_logprobs:
                n = min(n, self.config.max_num_seqs - len(self.running) - extra_rows)
            if not self.bm.allocate_slots(seq, n, hits):
                break
            del self.waiting[i]
            self._start(batch, seq, n, cached, shared=source is not None)
            extra_rows += n - 1 if seq.wants_prompt_logprobs else 0
            budget -= n
        if batch.is_decode:
            _longest_first(batch)
        if self.speculator is not None and batch.is_decode and not batch.preempted:
            self._add_drafts(batch, budget)
        return batch

    def _add_drafts(self, batch: ScheduledBatch, budget: int) -> None:
        """Turn a pure decode step into a verification step where the speculator proposes
        drafts: each fits the seq's max_tokens (the step emits at most drafts + 1 tokens), the
        model length, the step's token budget and row limit, and the free blocks."""
        room = []
        for seq in batch.seqs:
            left = min(seq.params.max_tokens - seq.num_output_tokens, self.config.max_model_len - seq.num_tokens) - 1
            room.append(max(0, min(left, budget)))
        drafts = self.speculator.propose(batch.seqs, room, self.config.max_num_seqs)
        if drafts is None:
            return
        for i, (seq, draft) in enumerate(zip(batch.seqs, drafts)):
            draft = draft[:budget]
            if draft and seq.grammar is not None:
                draft = seq.grammar.allowed_prefix(draft)
            if draft and not self.bm.allocate_slots(seq, 1 + len(draft)):
                draft = []
            drafts[i] = draft
            batch.num_new_tokens[i] = 1 + len(draft)
            budget -= len(draft)
        if any(drafts):
            batch.draft_tokens = drafts

    def _start(self, batch: ScheduledBatch, seq: Sequence, n: int, cached: int, shared: bool) -> None:
        """A waiting seq, its slots allocated, runs from this step with its first n tokens."""
        if not shared:
            self.bm.record_lookup(seq.num_tokens, cached)
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = time.perf_counter()
            seq.metrics.num_cached_tokens = cached
        seq.num_computed_tokens = cached
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._add(batch, seq, n)

    def _admit_solo(self, batch: ScheduledBatch) -> bool:
        """Admit the first waiting prompt as the step's only work, when the module docstring's
        exception applies: decodes are running (else it runs alone anyway), no prompt chunk is
        in progress, at most ``solo_prefill_max_tokens`` prompt tokens wait in all, and the
        prompt fits one step."""
        limit = self.config.solo_prefill_max_tokens
        if not limit or not self.waiting or not self.running:
            return False
        if any(s.num_tokens - s.num_computed_tokens > 1 for s in self.running):
            return False
        if sum(s.num_tokens for s in self.waiting) > limit or len(self.running) >= self.config.max_num_seqs:
            return False
        seq = self.waiting[0]
        if seq.share_prompt_of is not None or seq.wants_prompt_logprobs or seq.waits_for_grammar:
            return False
        hits = self._computed_blocks(seq, None)
        cached = len(hits) * self.bm.block_size
        n = seq.num_tokens - cached
        if n > self.config.max_num_batched_tokens or not self.bm.allocate_slots(seq, n, hits):
            return False
        self.waiting.popleft()
        self._start(batch, seq, n, cached, shared=False)
        return True

    def _computed_blocks(self, seq: Sequence, source: Sequence | None) -> list[int]:
        """Blocks whose KV ``seq`` can take instead of computing: the full prompt blocks of the
        sibling it shares a prompt with, else its prefix-cache hits. None for a seq that needs
        every prompt position's logits."""
        if seq.wants_prompt_logprobs:
            return []
        if source is not None:
            bs = self.bm.block_size
            full = min((seq.num_tokens - 1) // bs, source.num_computed_tokens // bs)
            if source.num_freed_blocks > self.bm.first_read_block(full * bs):
                # with a sliding window the source gave back blocks seq's first step reads:
                # what the prefix cache still holds of them is all there is to take
                return self.bm.get_computed_blocks(seq)
            return source.block_table[:full]
        return self.bm.get_computed_blocks(seq)

    def schedule_ahead(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, list[int] | None] | None:
        """The decode step after ``batch`` (a decode step whose tokens are not applied yet),
        for the engine to queue before it waits for ``batch``: the same running sequences,
        minus those that finish by length with ``batch``'s token. None when that step is not
        a plain continuation: requests are waiting to be admitted (they must not wait behind a
        chain of steps queued ahead; one still waiting for its grammar's compile does not
        count, it could not be admitted anyway), nothing would be left, or a block is missing
        (the regular schedule then preempts). Also returns which rows of ``batch``'s sampled
        ids feed the new step (None: all, in order)."""
        if not batch.is_decode or any(not s.waits_for_grammar for s in self.waiting):
            return None
        if self.speculator is not None and self.speculator.likely_to_draft(batch.seqs, self.config.max_num_seqs):
            return None  # the next step should verify drafts, which needs this step's tokens
        limit = self.config.max_model_len
        ahead = ScheduledBatch()
        rows: list[int] = []
        redo: list[Sequence] = []
        for i, seq in enumerate(batch.seqs):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if seq.seq_id in self.stale_ahead:
                redo.append(seq)  # its row in batch is void: it computes its last token again
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
        for seq in redo:
            if not self.bm.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens):
                return None
            ahead.sample_rows.append(len(ahead.seqs))
            ahead.seqs.append(seq)
            ahead.num_new_tokens.append(1)
        ahead.host_fed = len(redo)
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
            seq.output_ids.append(token)
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            out.append(seq)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
        return out

    def update_verified(self, batch: ScheduledBatch, emitted: list[list[int]]) -> list[tuple[Sequence, int]]:
        """Account for a verification step: emitted[i] are seq i's accepted drafts and the
        token after them. Each token is checked like a decoded one, and a stop ends the list
        there. The seq's last token and accepted drafts now have their K/V; the rejected
        drafts' slots are rolled back (num_computed_tokens stops before them). Returns each seq
        with how many tokens it got."""
        now = time.perf_counter()
        out = []
        for seq, tokens in zip(batch.seqs, emitted):
            reason = None
            applied = 0
            for token in tokens:
                if seq.grammar is not None and not seq.grammar.accept(token):
                    # drawn under its mask: no token of the vocabulary continues the grammar
                    logger.warning("request %s: no token of the vocabulary continues its grammar here; it is "
                                   "aborted", seq.request_id)
                    reason = "abort"
                    break
                seq.token_ids.append(token)
                seq.output_ids.append(token)
                applied += 1
                reason = self._stop_reason(seq, token)
                if reason is not None:
                    break
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            # the rejected drafts' K/V lies past num_computed_tokens: the next step overwrites
            # it; their blocks stay with the seq for the tokens that come next, as in vLLM
            seq.num_computed_tokens = seq.num_tokens - 1
            self.bm.commit(seq)
            if reason is not None:
                self.finish(seq, reason)
            out.append((seq, applied))
        return out

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        """Why ``seq`` ends with ``token`` (its grammar, if any, has taken it), or None."""
        p = seq.params
        if seq.grammar is not None and seq.grammar.is_terminated:
            return "stop"
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None


def _longest_first(batch: ScheduledBatch) -> None:
    """Put a decode step's rows in order of context length, longest first (ties in their order).
    The decode attention kernel starts its programs row by row, so the longest start first and
    the short ones fill the tail (see triton_paged_attention). Steps scheduled ahead keep the
    order: every row grows by one token."""
    batch.seqs.sort(key=lambda s: -s.num_tokens)
