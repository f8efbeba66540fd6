"""Sliding-window KV blocks: with a window on every layer, each sequence gives back its blocks
wholly behind the window as it runs, so it holds about window / block_size of them however long
it grows; prefix caching stays correct (a block given back stays matchable until evicted, and a
hit needs only the window of its first computed token); preemption, aborts, speculative
verification and steps queued ahead leave every block accounted for. A model mixing sliding and
global layers keeps one pool, and the engine says what a hybrid allocator would save.

The end-to-end runs drive the real scheduler and block manager with a toy model runner that
keeps a "K/V" entry per slot (its position and a chained hash of the whole prefix up to it) and
checks every key its queries read: a block read after it was given back, or overwritten, shows
at once, and the toy's output depends on the oldest key of each window, so it shows there too.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from compiled_llm.graph.ops import paged_attention_read_ref
from compiled_llm.model.presets import preset_config
from compiled_llm.serve.core.block_manager import UNREAD_BLOCK, BlockManager, hybrid_kv_savings, window_blocks
from compiled_llm.serve.core.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from compiled_llm.serve.core.sequence import Sequence
from compiled_llm.serve.core.spec_decode.config import SpeculativeConfig
from compiled_llm.serve.core.spec_decode.speculator import Speculator
from compiled_llm.serve.sampling_params import SamplingParams

BS = 4
W = 10  # not a multiple of BS: the window's first block is partly inside it
EOS = 0

_arrivals = iter(range(10**9))


def make_seq(tokens, max_tokens=16, **kw) -> Sequence:
    a = next(_arrivals)
    return Sequence(str(a), list(tokens), SamplingParams(max_tokens=max_tokens), arrival=a, **kw)


def held(seq: Sequence) -> list[int]:
    """The blocks seq holds: its table past the entries it gave back."""
    return seq.block_table[seq.num_freed_blocks:]


def step_to(bm: BlockManager, seq: Sequence, n: int = 1) -> None:
    """What one step does to seq's blocks: slots for n tokens, computed, registered."""
    assert bm.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    seq.token_ids.extend([7] * max(0, seq.num_computed_tokens + 1 - seq.num_tokens))
    bm.commit(seq)


# ---- the window's first block ---------------------------------------------------------------------


def test_the_first_block_read_follows_the_attention_kernels_window_contract():
    bm = BlockManager(8, BS, sliding_window=W)
    # a query at p sees p - W + 1 .. p: block (p - W + 1) // BS holds its first key
    assert [bm.first_read_block(p) for p in (0, 9, 12, 13, 16, 17)] == [0, 0, 0, 1, 1, 2]
    assert BlockManager(8, BS).first_read_block(10_000) == 0  # no window: every block is read


def test_blocks_before_the_first_read_block_are_never_read_by_the_reference_attention():
    """The contract checked on the eager path: the blocks the cache gives back may hold garbage
    and their table entries any index, the output does not change."""
    torch.manual_seed(0)
    kv_heads, head_dim, ctx, n_q, window = 2, 8, 29, 3, 9
    n_blocks = -(-ctx // BS)
    cache = torch.randn(2, n_blocks, BS, kv_heads, head_dim)
    q = torch.randn(n_q, 4, head_dim)
    qsl, lens = torch.tensor([0, n_q]), torch.tensor([ctx])
    table = torch.arange(n_blocks)[None]
    out = paged_attention_read_ref(q, cache, qsl, lens, table, 0.3, sliding_window=window)
    first = BlockManager(n_blocks, BS, sliding_window=window).first_read_block(ctx - n_q)
    assert first > 0
    spoiled, bad_table = cache.clone(), table.clone()
    spoiled[:, :first] = float("nan")
    bad_table[0, :first] = 10**6  # an index past the cache: reading it would raise
    again = paged_attention_read_ref(q, spoiled, qsl, lens, bad_table, 0.3, sliding_window=window)
    torch.testing.assert_close(again, out)


# ---- giving blocks back ---------------------------------------------------------------------------


def test_a_decoding_sequence_gives_back_each_block_once_it_falls_wholly_behind_its_window():
    bm = BlockManager(16, BS, sliding_window=W)
    seq = make_seq(range(1, 7))
    step_to(bm, seq, 6)
    for _ in range(30):
        step_to(bm, seq)
        freed = bm.first_read_block(seq.num_computed_tokens - 1)  # the last step's first query
        assert seq.num_freed_blocks == freed
        assert all(bm.ref_counts[b] == 0 or b in held(seq) for b in seq.block_table[:freed])
        assert len(held(seq)) <= window_blocks(W, BS)
        bm.check_invariants()
    assert seq.num_freed_blocks >= 6
    assert bm.num_free_blocks == bm.num_blocks - len(held(seq))


def test_given_back_blocks_keep_their_table_entries_and_finishing_frees_only_the_held_ones():
    bm = BlockManager(16, BS, sliding_window=W)
    seq = make_seq(range(1, 7))
    step_to(bm, seq, 6)
    table = list(seq.block_table)
    for _ in range(20):
        step_to(bm, seq)
        # positions never move: the runner mirrors tables by position, append-only
        assert seq.block_table[:len(table)] == table
        table = list(seq.block_table)
    assert seq.num_freed_blocks > 0
    bm.free_seq(seq)  # a given-back entry freed again would trip "freed twice"
    assert bm.num_free_blocks == bm.num_blocks and seq.num_freed_blocks == 0
    bm.check_invariants()


def test_a_window_of_a_few_blocks_decodes_forever_in_that_many_blocks():
    bm = BlockManager(window_blocks(W, BS), BS, sliding_window=W)
    seq = make_seq([1])
    step_to(bm, seq)
    for _ in range(200):
        step_to(bm, seq)  # would fail if a block behind the window were kept
    assert seq.num_computed_tokens == 201 and seq.num_freed_blocks == bm.first_read_block(200)


def test_without_a_window_nothing_is_given_back():
    bm = BlockManager(64, BS)
    seq = make_seq([1, 2, 3])
    step_to(bm, seq, 3)
    for _ in range(40):
        step_to(bm, seq)
    assert seq.num_freed_blocks == 0 and len(held(seq)) == seq.num_computed_tokens // BS + 1


def test_a_block_another_sequence_shares_stays_taken_when_one_gives_it_back():
    bm = BlockManager(32, BS, sliding_window=W)
    a = make_seq(range(1, 10))
    step_to(bm, a, 9)
    b = make_seq(range(1, 10))
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_table[:2]
    assert bm.allocate_slots(b, 1, hits)
    b.num_computed_tokens = 9
    for _ in range(12):
        step_to(bm, a)
    assert a.num_freed_blocks >= 2
    assert [bm.ref_counts[x] for x in hits] == [1, 1]  # b's hold remains
    bm.free_seq(b)
    bm.free_seq(a)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_slots_count_the_blocks_the_sequence_gives_back_in_the_same_call():
    bm = BlockManager(4, BS, sliding_window=W)
    seq = make_seq(range(1, 13))
    step_to(bm, seq, 12)
    step_to(bm, seq)  # 13 tokens computed, in all 4 blocks: none left
    assert bm.num_free_blocks == 0 and seq.num_freed_blocks == 0
    # 4 more tokens need a fifth block: only the one falling behind the window can serve
    assert bm.allocate_slots(seq, 4)
    assert seq.num_freed_blocks == 1 and seq.block_table[4] == seq.block_table[0]
    bm.check_invariants()


# ---- prefix caching -------------------------------------------------------------------------------


def test_a_given_back_block_stays_matchable_and_a_later_request_takes_it_while_the_first_runs():
    bm = BlockManager(32, BS, sliding_window=W)
    a = make_seq(range(1, 7))
    step_to(bm, a, 6)
    for _ in range(14):
        step_to(bm, a)
    first = a.block_table[0]
    assert a.num_freed_blocks >= 2 and bm.ref_counts[first] == 0 and first in bm.block_hash
    b = make_seq(a.token_ids[:9])  # two full blocks of a's context, then one token to compute
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_table[:2]
    assert bm.allocate_slots(b, 1, hits)
    assert bm.ref_counts[first] == 1
    bm.free_seq(a)  # a's entry for it is a given-back one: a does not release b's hold
    assert bm.ref_counts[first] == 1
    bm.free_seq(b)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_a_prefix_hit_needs_only_the_blocks_its_first_computed_token_reads():
    bm = BlockManager(12, BS, sliding_window=W)
    a = make_seq(range(1, 7))
    step_to(bm, a, 6)
    for _ in range(26):
        step_to(bm, a)
    table = list(a.block_table)
    bm.free_seq(a)
    context = list(a.token_ids)  # 33 tokens: 8 full blocks cached, the oldest freed first
    # other traffic evicts the least recently freed blocks: a's head
    other = make_seq(range(100, 124))
    step_to(bm, other, 24)
    bm.free_seq(other)
    assert all(h not in bm.cached for h in a.block_hashes[:2])
    b = make_seq(context[:32] + [99])
    hits = bm.get_computed_blocks(b)
    first = bm.first_read_block(32)
    assert len(hits) == 8 and hits[:first] == [UNREAD_BLOCK] * first
    assert hits[first:] == table[first:8]
    free_before = bm.num_free_blocks
    assert bm.allocate_slots(b, 1, hits)
    # only the window's blocks are taken, and one new block for the token computed
    assert bm.num_free_blocks == free_before - (8 - first) - 1
    assert b.num_freed_blocks == first
    bm.free_seq(b)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_a_prefix_hit_with_a_hole_inside_the_window_stops_before_the_hole():
    bm = BlockManager(32, BS, sliding_window=W)
    a = make_seq(range(1, 34))
    step_to(bm, a, 33)
    table = list(a.block_table)
    bm.free_seq(a)
    hole = table[6]
    bm.free.remove(hole)  # evict block 6 alone, as an allocation taking it would
    del bm.cached[bm.block_hash.pop(hole)]
    bm.free.appendleft(hole)
    b = make_seq(a.token_ids[:33])
    hits = bm.get_computed_blocks(b)
    # a hit may end at block 6 at most, and must hold every block its first token reads
    first = bm.first_read_block(24)
    assert len(hits) == 6 and hits[:first] == [UNREAD_BLOCK] * first and hits[first:] == table[first:6]


# ---- the scheduler, end to end with a toy model -----------------------------------------------------


def toy_next(window_tokens: list[int]) -> int:
    """The toy model's greedy token after a window of keys (never EOS); it depends on the
    oldest key, so a wrong window start changes it."""
    return (7 * window_tokens[-1] + 3 * window_tokens[0] + len(window_tokens)) % 13 + 1


def reference(prompt: list[int], max_tokens: int, window: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        q = len(tokens) - 1
        tokens.append(toy_next(tokens[max(0, q - window + 1):q + 1]))
    return tokens[len(prompt):]


def chained(tokens: list[int]) -> list[int]:
    out, h = [], None
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


class ToyRunner:
    """The model runner's part over a cache of slots. A step first writes each computed token's
    entry (position, chained hash of the prefix up to it, token) into the slot its block table
    gives, then each query reads the keys of its window through the table: every key must lie
    in a block the sequence still holds and carry what its own prefix would have written. The
    step's tokens are toy_next of the keys read."""

    def __init__(self, bm: BlockManager, window: int):
        self.bm, self.window = bm, window
        self.slots: dict[int, tuple[int, int, int]] = {}
        self.keys_read = 0

    def _slot(self, seq: Sequence, p: int) -> int:
        i = p // self.bm.block_size
        assert i >= seq.num_freed_blocks, f"position {p} lies in a block {seq.request_id} gave back"
        b = seq.block_table[i]
        assert self.bm.ref_counts[b] > 0, f"block {b} is read or written while nobody holds it"
        return b * self.bm.block_size + p % self.bm.block_size

    def run(self, batch: ScheduledBatch) -> list[int]:
        """The step's sampled tokens: one per sample row, or one per query row of a
        verification. It runs once the step before it is applied (``serve``), so each row
        starts at its seq's num_computed_tokens. A row whose seq has finished since the step
        was scheduled samples a dummy token (the engine drops it)."""
        rows = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.is_finished:
                rows.append(None)
                continue
            start = seq.num_computed_tokens
            context = list(seq.token_ids) + (batch.draft_tokens[i] if batch.draft_tokens is not None else [])
            tokens = context[:start + n]
            hashes = chained(tokens)
            for p in range(start, start + n):  # a step writes its K/V before it attends
                self.slots[self._slot(seq, p)] = (p, hashes[p], tokens[p])
            rows.append((seq, start, n, tokens, hashes))
        out = []
        for i, row in enumerate(rows):
            if row is None:
                out.append(EOS)
                continue
            seq, start, n, tokens, hashes = row
            for q in range(start, start + n):
                keys = []
                for p in range(max(0, q - self.window + 1), q + 1):
                    assert self.slots.get(self._slot(seq, p)) == (p, hashes[p], tokens[p]), (seq.request_id, p)
                    keys.append(self.slots[self._slot(seq, p)][2])
                self.keys_read += len(keys)
                if batch.draft_tokens is not None or (q == start + n - 1 and i in batch.sample_rows):
                    out.append(toy_next(keys))
        return out


def check_holds(sched: Scheduler) -> None:
    """Every block's count is the number of running sequences' held entries naming it, and a
    waiting sequence holds nothing."""
    bm = sched.bm
    counts = [0] * bm.num_blocks
    for seq in sched.running:
        for b in held(seq):
            counts[b] += 1
    assert counts == bm.ref_counts
    assert all(not s.block_table and not s.num_freed_blocks for s in sched.waiting)
    bm.check_invariants()


def unfinished_rows(batch: ScheduledBatch, sampled: list[int]) -> tuple[ScheduledBatch, list[int]]:
    """A step's rows whose sequences still run, with their tokens (a step queued ahead may hold
    sequences that finished or were aborted since)."""
    kept, tokens = ScheduledBatch(), []
    by_row = {row: j for j, row in enumerate(batch.sample_rows)}
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        if seq.is_finished:
            continue
        if i in by_row:
            kept.sample_rows.append(len(kept.seqs))
            tokens.append(sampled[by_row[i]])
        kept.seqs.append(seq)
        kept.num_new_tokens.append(n)
    return kept, tokens


def serve(sched: Scheduler, runner: ToyRunner, async_scheduling: bool, before_step=None) -> dict[int, int]:
    """Run the scheduler dry as LLMEngine._step does: with async scheduling, a decode step's
    successor is scheduled (given slots, blocks behind its window given back) while the step is
    in flight. The toy device runs a step only when its tokens are collected, after that, as a
    busy GPU would: so every block a step reads must still be its sequence's then.
    ``before_step(i)`` runs first in each iteration (adds, aborts). Returns each sequence's most
    blocks held while it decoded."""
    pending, peak, i = None, {}, 0
    while True:
        if before_step is not None:
            before_step(i)
        i += 1
        if pending is None and not sched.has_unfinished():
            return peak
        if pending is not None:
            batch, pending = pending, None
        else:
            batch = sched.schedule()
            assert not batch.is_empty
        if async_scheduling and batch.is_decode:
            ahead = sched.schedule_ahead(batch)
            pending = ahead[0] if ahead is not None else None
        sampled = runner.run(batch)
        for seq in sched.running:
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                peak[seq.seq_id] = max(peak.get(seq.seq_id, 0), len(held(seq)))
        check_holds(sched)
        if batch.is_verify:
            emitted = sched.speculator.verify(batch.draft_tokens, sampled)
            sched.speculator.observe(batch.seqs, batch.draft_tokens, emitted)
            sched.update_verified(batch, emitted)
        else:
            sched.update(*unfinished_rows(batch, sampled))
        check_holds(sched)


def make_scheduler(num_blocks=256, budget=16, prefix_caching=True, speculative=False, window=W) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=1024,
                          enable_chunked_prefill=True)
    spec = Speculator(SpeculativeConfig("ngram", 3, prompt_lookup_max=3, prompt_lookup_min=1)) if speculative else None
    return Scheduler(cfg, BlockManager(num_blocks, BS, prefix_caching, sliding_window=window),
                     stop_token_ids=[EOS], speculator=spec)


SYSTEM = [11, 3, 5, 8, 2, 9, 4, 12, 6]  # a shared prompt head, cached after the first request


def test_a_long_generation_never_holds_more_than_the_window_in_blocks_per_sequence():
    # three 150-token contexts would need 3 * 38 blocks kept whole; 24 serve them all
    sched = make_scheduler(num_blocks=3 * window_blocks(W, BS, 16))
    seqs = [make_seq(SYSTEM[:n], max_tokens=140) for n in (3, 6, 9)]
    for s in seqs:
        sched.add(s)
    runner = ToyRunner(sched.bm, W)
    peak = serve(sched, runner, async_scheduling=True)
    assert sched.num_preemptions == 0
    # decoding with a step queued ahead: slots for two tokens past those computed
    assert max(peak.values()) <= window_blocks(W, BS, 2)
    for s in seqs:
        assert s.output_ids == reference(s.prompt_token_ids, 140, W)
        assert s.finish_reason == "length"
    assert sched.bm.num_free_blocks == sched.bm.num_blocks


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix_caching", "no_prefix_caching"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
@pytest.mark.parametrize("num_blocks", [256, 14], ids=["roomy", "preempting"])
def test_every_schedule_gives_the_windowed_models_own_output(prefix_caching, async_scheduling, speculative,
                                                             num_blocks):
    """Chunked prompts sharing a cached head, a second wave whose prompts are earlier
    contexts (their heads given back and maybe evicted), a request with two completions
    sharing its prompt, steps queued ahead, verification of n-gram drafts, preemption by
    recompute: every token is the model's own with the window, every key read is the right one."""
    sched = make_scheduler(num_blocks=num_blocks, prefix_caching=prefix_caching, speculative=speculative)
    runner = ToyRunner(sched.bm, W)
    first = [make_seq(SYSTEM + [n, n + 1] * n, max_tokens=40) for n in (1, 4, 7)]
    # two requests of two completions each: the first's prompt outruns the window (its blocks
    # are given back before the second completion takes them), the second's does not
    pairs = []
    for prompt in (SYSTEM + [5] * 14, SYSTEM[:6] + [9, 9, 9]):
        source = make_seq(prompt, max_tokens=30)
        pairs += [source, Sequence(source.request_id, list(prompt), source.params, arrival=source.arrival, index=1,
                                   share_prompt_of=source)]
    later: list[Sequence] = []

    def before_step(i):
        if i == 0:
            for s in first + pairs:
                sched.add(s)
        if i == 25:  # prompts that are contexts seen so far, then a token of their own
            for s in first[:2]:
                later.append(make_seq(s.token_ids[:-1] + [13], max_tokens=20))
                sched.add(later[-1])

    serve(sched, runner, async_scheduling, before_step)
    for s in first + pairs + later:
        assert s.output_ids == reference(s.prompt_token_ids, s.params.max_tokens, W), s.request_id
    assert runner.keys_read > 0
    assert sched.bm.num_free_blocks == sched.bm.num_blocks
    if num_blocks == 14:
        assert sched.num_preemptions > 0
    if speculative:
        assert sched.speculator.stats.verify_steps > 0
    if prefix_caching:
        assert sched.bm.stats.hit_tokens > 0


def test_a_sibling_whose_source_gave_back_prompt_blocks_takes_the_prefix_caches_copy():
    sched = make_scheduler()
    source = make_seq(range(1, 30), max_tokens=12)
    sibling = Sequence(source.request_id, list(source.prompt_token_ids), source.params, arrival=source.arrival,
                       index=1, share_prompt_of=source)
    sched.add(source)
    runner = ToyRunner(sched.bm, W)
    added = []

    def before_step(i):
        if i == 4:  # the source has computed its prompt and gone on decoding
            assert source.num_freed_blocks > sched.bm.first_read_block(28 // BS * BS)
            sched.add(sibling)
            added.append(i)

    serve(sched, runner, async_scheduling=True, before_step=before_step)
    assert added
    assert source.output_ids == sibling.output_ids == reference(source.prompt_token_ids, 12, W)
    assert sibling.metrics.num_cached_tokens > 0  # its prompt was not computed again


def test_preemption_and_aborts_leave_every_block_free():
    sched = make_scheduler(num_blocks=12)
    runner = ToyRunner(sched.bm, W)
    seqs = [make_seq(SYSTEM + [n] * 11, max_tokens=60) for n in range(1, 6)]
    aborted: list[Sequence] = []

    def before_step(i):
        if i == 0:
            for s in seqs:
                sched.add(s)
        if i == 30:
            running = [s for s in sched.running if s.num_freed_blocks]
            waiting = list(sched.waiting)
            assert running, "a running sequence with blocks given back"
            aborted.extend(running[:1] + waiting[:1])
            for s in aborted:
                sched.abort(s)
            check_holds(sched)

    serve(sched, runner, async_scheduling=True, before_step=before_step)
    assert sched.num_preemptions > 0 and aborted
    for s in seqs:
        if s not in aborted:
            assert s.output_ids == reference(s.prompt_token_ids, 60, W)
    assert sched.bm.num_free_blocks == sched.bm.num_blocks
    sched.bm.check_invariants()


# ---- mixed models -----------------------------------------------------------------------------------


def windowed(kinds: str, window: int | None):
    """tiny-mistral with layer kinds spelled "SG..." (sliding, global)."""
    types = tuple("sliding_attention" if k == "S" else "full_attention" for k in kinds)
    return dataclasses.replace(preset_config("tiny-mistral"), num_layers=len(kinds), layer_types=types,
                               sliding_window=window)


GLOBAL_ONLY = windowed("GG", None)


def test_a_hybrid_allocator_saves_the_sliding_layers_context_beyond_their_window():
    # Gemma 2's pattern: every other layer slides over 4096 tokens, at 8192 tokens
    half = hybrid_kv_savings(windowed("SG" * 4, 4096), 8192, 16)
    assert half == pytest.approx(0.5 * (1 - (4096 // 16 + 1) / (8192 // 16)))
    # Gemma 3's 5 of 6 layers over 1024 tokens save most of it at 32k
    assert hybrid_kv_savings(windowed("SSSSSG", 1024), 32768, 16) == pytest.approx(
        5 / 6 * (1 - (1024 // 16 + 1) / (32768 // 16)))
    # a chunk of prefill held with the window costs more blocks
    assert hybrid_kv_savings(windowed("SG", 4096), 8192, 16, step_tokens=2048) < half
    # nothing to save: no sliding layer, or a context within the window
    assert hybrid_kv_savings(GLOBAL_ONLY, 8192, 16) == 0.0
    assert hybrid_kv_savings(windowed("SG", 4096), 4096, 16) == 0.0


def test_the_engine_says_once_what_a_hybrid_allocator_would_save_on_a_mixed_model(caplog):
    from compiled_llm.serve.llm_engine import _log_kv_layout

    mixed = windowed("SG", 64)
    assert mixed.kv_window is None
    with caplog.at_level(logging.INFO, logger="compiled_llm.serve.llm_engine"):
        _log_kv_layout(mixed, 1024, 16, 16)
    (record,) = caplog.records
    # per sequence, 64 blocks for the global layer and 6 for the sliding one, rather than 2 x 64
    assert "hybrid allocator would save 45%" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="compiled_llm.serve.llm_engine"):
        _log_kv_layout(windowed("SS", 64), 1024, 16, 16)  # every layer slides: blocks go back
        _log_kv_layout(GLOBAL_ONLY, 1024, 16, 16)
    assert len(caplog.records) == 1 and "given back" in caplog.records[0].getMessage()
