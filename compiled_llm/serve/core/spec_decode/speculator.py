"""Which sequences of a decode step draft tokens, how many, and what verification accepted.

A step that speculates verifies, for each sequence with drafts d_1..d_m, the m + 1 tokens
[last, d_1, ..., d_m] in one forward pass: every position's logits come out, the target token
is sampled at each position exactly as a plain decode step would sample it, and the drafts are
accepted while they equal those samples. The emitted tokens are the accepted drafts plus the
sample at the first mismatch (or after the last draft). With a draft that is one fixed token
(an n-gram proposal), this is rejection sampling: the draft is accepted with probability
p(d), and on rejection the sample is drawn from p with d excluded, renormalised, so the output
keeps the target distribution; greedy rows reproduce plain greedy decoding token for token.

Speculation has a cost: a verification step computes m + 1 rows per sequence and cannot be
queued before the previous step's tokens are read (the next step's inputs depend on how many
were accepted). So it turns itself off where it would not pay:

- per sequence, by its acceptance: each sequence keeps a moving average of the fraction of its
  drafts accepted; below ``MIN_ACCEPTANCE`` it stops drafting for a back-off that doubles with
  each failed retry (up to ``MAX_BACKOFF`` tokens), so text that stops repeating costs at most one
  wasted verification per back-off, and text that starts repeating again is found;
- per step: only pure decode steps speculate (a step with prompt work runs eagerly anyway and
  must not delay admissions); at most ``disable_by_batch_size`` sequences; fewer than
  ``max_rows`` sequences and at most that many verification rows; and only when the drafts'
  expected accepted tokens add at least ``MIN_STEP_GAIN`` of the step's plain tokens. A decode
  step is queued ahead of the previous one's tokens (async scheduling) only while no sequence's
  known suffix has a match (``likely_to_draft``), so text without repeats keeps that overlap;
- rows that need every position's penalties (presence, frequency, repetition) do not draft:
  their penalties would depend on the drafts before them.
"""

from __future__ import annotations

import dataclasses

from compiled_llm.serve.core.sequence import Sequence
from compiled_llm.serve.core.spec_decode.config import SpeculativeConfig
from compiled_llm.serve.core.spec_decode.ngram_proposer import NgramIndex

MIN_ACCEPTANCE = 0.25
MIN_STEP_GAIN = 0.25
MAX_BACKOFF = 64
ACCEPTANCE_EMA = 0.5  # weight of the latest verification in a sequence's acceptance average
# verification rows per step: a decode step's weight read is shared by this many rows before
# the step turns compute-bound on the GPUs measured
DEFAULT_MAX_ROWS = 64


@dataclasses.dataclass
class SpeculationStats:
    verify_steps: int = 0  # steps that verified drafts
    draft_tokens: int = 0  # tokens proposed in them
    accepted_tokens: int = 0  # of those, accepted
    emitted_tokens: int = 0  # tokens those steps produced (accepted + one per sequence)
    drafting_seqs: int = 0  # sequence-steps that verified drafts
    # [i]: drafts whose token i (from 0) was accepted, the tokens before it being accepted too
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per drafting sequence per verification step (1 = no draft accepted)."""
        return self.emitted_tokens / self.drafting_seqs if self.drafting_seqs else 0.0


@dataclasses.dataclass(eq=False)
class _SeqState:
    index: NgramIndex
    acceptance: float = 0.5  # a new sequence tries; two misses in a row turn it off
    resume_at: int = 0  # the sequence length from which it drafts again (after a back-off)
    backoff: int = 0  # the last back-off, in tokens


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_rows: int = DEFAULT_MAX_ROWS):
        self.config = config
        self.max_rows = max_rows
        self.stats = SpeculationStats()

    def _state(self, seq: Sequence) -> _SeqState:
        state = seq.draft_state
        if state is None:
            state = seq.draft_state = _SeqState(NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max))
        return state

    def _may_speculate(self, num_seqs: int, max_rows: int) -> bool:
        cap = self.config.disable_by_batch_size
        return (cap is None or num_seqs <= cap) and num_seqs < min(max_rows, self.max_rows)

    def _active(self, seq: Sequence) -> _SeqState | None:
        """seq's state if it may draft now (no penalties, not backing off)."""
        if seq.params.has_penalties:
            return None
        state = self._state(seq)
        return state if seq.num_tokens >= state.resume_at else None

    def propose(self, seqs: list[Sequence], room: list[int], max_rows: int) -> list[list[int]] | None:
        """Drafts for the sequences of a pure decode step (``room[i]``: the most tokens seq i
        may draft, from its max_tokens, the model length and the step's budget), or None when
        the step should not speculate."""
        if not self._may_speculate(len(seqs), max_rows):
            return None
        rows_left = min(max_rows, self.max_rows) - len(seqs)
        drafts: list[list[int]] = []
        gain = 0.0
        for seq, limit in zip(seqs, room):
            k = min(self.config.num_speculative_tokens, limit, rows_left)
            state = self._active(seq) if k > 0 else None
            draft = state.index.propose(seq.token_ids, k) if state is not None else []
            if draft:
                gain += state.acceptance * len(draft)
            rows_left -= len(draft)
            drafts.append(draft)
        if gain < MIN_STEP_GAIN * len(seqs):
            return None
        return drafts

    def likely_to_draft(self, seqs: list[Sequence], max_rows: int) -> bool:
        """Whether the step after the current one (whose tokens are not known yet) would
        probably speculate: the suffixes known now have n-gram matches worth a verification.
        The engine then waits for the current step's tokens instead of queueing a plain decode
        step ahead, which would hold speculation off for as long as steps keep being queued."""
        if not self._may_speculate(len(seqs), max_rows):
            return False
        k = self.config.num_speculative_tokens
        gain = 0.0
        for seq in seqs:
            state = self._active(seq)
            if state is not None and state.index.propose(seq.token_ids, 1):
                gain += state.acceptance * k
        return gain >= MIN_STEP_GAIN * len(seqs)

    def verify(self, drafts: list[list[int]], sampled: list[int]) -> list[list[int]]:
        """Each sequence's emitted tokens, given its drafts and the tokens sampled at its 1 + m
        positions (``sampled``, all sequences' rows in order): the drafts that equal the samples
        before them, then the sample at the first mismatch (or after the last draft)."""
        out, row = [], 0
        for draft in drafts:
            a = 0
            while a < len(draft) and draft[a] == sampled[row + a]:
                a += 1
            out.append(sampled[row:row + a + 1])
            row += len(draft) + 1
        return out

    def observe(self, seqs: list[Sequence], drafts: list[list[int]], emitted: list[list[int]]) -> None:
        """Update each drafting sequence's acceptance average, back-off, and the stats."""
        st = self.stats
        st.verify_steps += 1
        for seq, draft, tokens in zip(seqs, drafts, emitted):
            if not draft:
                continue
            accepted = len(tokens) - 1
            st.draft_tokens += len(draft)
            st.accepted_tokens += accepted
            st.emitted_tokens += len(tokens)
            st.drafting_seqs += 1
            if len(st.accepted_per_position) < len(draft):
                st.accepted_per_position.extend([0] * (len(draft) - len(st.accepted_per_position)))
            for position in range(accepted):
                st.accepted_per_position[position] += 1
            state = self._state(seq)
            state.acceptance += ACCEPTANCE_EMA * (accepted / len(draft) - state.acceptance)
            if state.acceptance >= MIN_ACCEPTANCE:
                state.backoff = 0
            else:
                state.backoff = min(2 * state.backoff or 4, MAX_BACKOFF)
                state.resume_at = seq.num_tokens + state.backoff
                # a retry after the back-off starts from the threshold: one good step keeps it on
                state.acceptance = MIN_ACCEPTANCE
