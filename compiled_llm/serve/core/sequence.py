"""One request's state inside the engine: its tokens, how many of them sit in the KV cache, its
blocks, its sampling parameters and timings.

The scheduler and the block manager mutate it; nothing here touches a device.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from compiled_llm.serve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One completion of a request (a request with ``n`` > 1 has ``n`` of them, ``index``
    0..n-1, sharing its ``request_id``; ``seq_id`` tells them apart)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # submission order: lower = higher priority (FCFS)
    prompt: str | None = None
    generator: object | None = None  # torch.Generator for seeded sampling
    index: int = 0
    # A sibling whose prompt KV this one shares: admitted once that one has computed its prompt,
    # taking its full prompt blocks by reference instead of recomputing them.
    share_prompt_of: "Sequence | None" = None
    seq_id: int = field(default_factory=_seq_ids.__next__)
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    output_ids: list[int] = field(default_factory=list)  # the output part, kept alongside
    num_computed_tokens: int = 0  # tokens whose K/V are in this sequence's blocks
    block_table: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks of token_ids (tokens never change, so this only grows).
    block_hashes: list[int] = field(default_factory=list)
    num_committed_blocks: int = 0  # leading blocks already registered in the prefix cache
    # Leading entries of block_table this sequence no longer holds: with a sliding window they
    # lie wholly before any key its steps can read (BlockManager.first_read_block). The entries
    # stay, so the table keeps its positions, but they are never read nor freed again.
    num_freed_blocks: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # Per output token when params.logprobs is set: token id -> Logprob (outputs.Logprob).
    logprobs: list[dict] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # Per prompt token after the first when params.prompt_logprobs is set, same shape.
    prompt_logprobs: list[dict] = field(default_factory=list)
    # the speculator's per-sequence state (its n-gram index, acceptance), made on first use
    draft_state: object | None = None
    # with structured outputs: its place in the grammar (core/structured_output/grammar_matcher)
    grammar: object | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return list(self.output_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's log-probabilities are asked for and not all computed yet (the first
        completion of a request computes them; its siblings share its prompt)."""
        return (
            self.params.prompt_logprobs is not None
            and self.index == 0
            and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1
        )

    @property
    def waits_for_grammar(self) -> bool:
        """Its grammar is still being compiled, or failed to (the engine then aborts it): it
        cannot be scheduled."""
        return self.grammar is not None and (not self.grammar.ready or self.grammar.error is not None)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_hash(self, index: int, block_size: int) -> int:
        """Chained hash of full block ``index``: hash((parent hash, its token ids)). Equal
        hashes mean equal whole prefixes (the block manager also checks the tokens)."""
        while len(self.block_hashes) <= index:
            i = len(self.block_hashes)
            parent = self.block_hashes[i - 1] if i else None
            tokens = tuple(self.token_ids[i * block_size:(i + 1) * block_size])
            assert len(tokens) == block_size, "only full blocks have a hash"
            self.block_hashes.append(hash((parent, tokens)))
        return self.block_hashes[index]
