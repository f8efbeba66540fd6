"""Block manager: reference counts, chained-hash prefix caching, LRU eviction of cached blocks."""

import random
from collections import deque

import pytest

from compiled_llm.serve.sampling_params import SamplingParams
from compiled_llm.serve.core.block_manager import BlockManager, FreeBlockQueue
from compiled_llm.serve.core.sequence import Sequence

BS = 4


def make_seq(tokens, arrival=0):
    return Sequence(request_id=str(arrival), prompt_token_ids=list(tokens), params=SamplingParams(), arrival=arrival)


def admit(bm, seq):
    """What the scheduler does at admission: reuse cached blocks, allocate the rest, compute."""
    hits = bm.get_computed_blocks(seq)
    seq.num_computed_tokens = 0
    assert bm.allocate_slots(seq, seq.num_tokens - len(hits) * BS, hits)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    return hits


def test_allocation_covers_tokens_and_free_returns_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(range(10))
    admit(bm, seq)
    assert len(seq.block_table) == 3  # ceil(10 / 4)
    assert len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    bm.free_seq(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8
    bm.check_invariants()


def test_allocation_refused_without_side_effects_when_pool_is_short():
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = make_seq(range(9))  # needs 3 blocks
    assert not bm.allocate_slots(seq, 9)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_shared_prefix_reuses_full_blocks_and_counts_refs():
    bm = BlockManager(num_blocks=16, block_size=BS)
    system = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens
    a = make_seq(system + [1, 2, 3])
    b = make_seq(system + [7, 8, 9, 10, 11])
    admit(bm, a)
    hits = admit(bm, b)
    assert hits == a.block_table[:2]  # only full blocks are shared
    assert b.block_table[2] != a.block_table[2]
    assert bm.ref_counts[hits[0]] == 2
    bm.free_seq(a)
    assert bm.ref_counts[hits[0]] == 1
    bm.check_invariants()


def test_prefix_must_match_from_the_start():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    # same second block, different first block: the chained hash differs, no hit
    b = make_seq([0, 0, 0, 0, 5, 6, 7, 8, 9])
    assert bm.get_computed_blocks(b) == []


def test_at_least_one_token_is_left_to_compute():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(range(8))
    admit(bm, a)
    again = make_seq(range(8))  # exactly two full blocks, all cached
    assert bm.get_computed_blocks(again) == a.block_table[:1]


def test_freed_cached_blocks_survive_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=BS)
    old = make_seq([1] * 8)
    admit(bm, old)
    newer = make_seq([2] * 8)
    admit(bm, newer)
    bm.free_seq(old)
    bm.free_seq(newer)
    # both prefixes are still cached after being freed
    assert len(bm.get_computed_blocks(make_seq([1] * 9))) == 2
    assert len(bm.get_computed_blocks(make_seq([2] * 9))) == 2
    # a 2-block allocation evicts the least recently freed blocks: old's
    admit(bm, make_seq([3] * 7))
    assert bm.get_computed_blocks(make_seq([1] * 9)) == []
    assert len(bm.get_computed_blocks(make_seq([2] * 9))) == 2
    bm.check_invariants()


def test_uncached_blocks_are_reused_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=BS)
    cached = make_seq([5] * 8)
    admit(bm, cached)
    scratch = make_seq([6] * 3)  # one partial block: never cached
    admit(bm, scratch)
    bm.free_seq(cached)
    bm.free_seq(scratch)
    taker = make_seq([7] * 3)
    admit(bm, taker)
    assert len(bm.get_computed_blocks(make_seq([5] * 9))) == 2


def test_reviving_a_free_cached_block_counts_against_the_pool():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_seq([1] * 8)
    admit(bm, a)
    bm.free_seq(a)
    b = make_seq([1] * 8 + [2] * 5)  # 2 cached + 2 new blocks > 3
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2
    assert not bm.can_allocate(b, 5, hits)
    c = make_seq([1] * 8 + [2] * 3)  # 2 cached + 1 new
    assert bm.allocate_slots(c, 3, bm.get_computed_blocks(c))
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_decode_growth_allocates_one_block_per_block_size_tokens():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(range(4))
    admit(bm, seq)
    assert len(seq.block_table) == 1
    for tok in range(5):
        seq.token_ids.append(tok)
        assert bm.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
        bm.commit(seq)
    assert len(seq.block_table) == 3  # 9 tokens
    # generated tokens' full blocks are cached too
    follow = make_seq(seq.token_ids + [99])
    assert bm.get_computed_blocks(follow) == seq.block_table[:2]


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = make_seq(range(5))
    admit(bm, seq)
    table = list(seq.block_table)
    bm.free_seq(seq)
    seq.block_table = table
    with pytest.raises(AssertionError):
        bm.free_seq(seq)


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    admit(bm, make_seq(range(12)))
    assert bm.get_computed_blocks(make_seq(range(12))) == []
    assert bm.cached == {}


def test_free_block_queue_keeps_order_through_every_operation():
    """The linked-list free queue behaves as a deque that can also drop any member."""
    queue, model = FreeBlockQueue(50), deque(range(50))
    rng = random.Random(0)
    for _ in range(2000):
        op = rng.choice(["popleft", "append", "appendleft", "remove"])
        outside = sorted(set(range(50)) - set(model))
        if op == "popleft" and model:
            assert queue.popleft() == model.popleft()
        elif op in ("append", "appendleft") and outside:
            b = rng.choice(outside)
            getattr(queue, op)(b)
            getattr(model, op)(b)
        elif op == "remove" and model:
            b = rng.choice(list(model))
            queue.remove(b)
            model.remove(b)
        assert list(queue) == list(model)
        assert len(queue) == len(model)
        assert all((b in queue) == (b in model) for b in range(50))
    while model:
        assert queue.popleft() == model.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


def test_cycling_through_every_block_leaves_no_objects_for_the_garbage_collector():
    """A GPU's cache has hundreds of thousands of blocks: their state must not become objects
    the collector's full passes walk (each such pass stalls serving)."""
    import gc

    bm = BlockManager(num_blocks=20_000, block_size=BS)
    gc.collect()
    before = len(gc.get_objects())
    for start in range(0, 20_000 * BS, 64 * BS):
        seq = make_seq(range(start, start + 64 * BS), arrival=start)
        admit(bm, seq)
        bm.free_seq(seq)
    gc.collect()
    assert len(bm.cached) > 10_000  # the blocks did get registered and kept
    assert len(gc.get_objects()) - before < 1_000
