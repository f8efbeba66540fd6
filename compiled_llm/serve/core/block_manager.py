"""Paged-KV block allocation with reference counts and prefix caching.

A block holds ``block_size`` consecutive tokens of one or more sequences' context. Full blocks
are registered in the prefix cache under a chained hash (parent block's hash, the block's token
ids), so a later request whose prompt starts with the same tokens reuses them instead of
recomputing. Blocks nobody holds sit in a free queue in LRU order: an allocation takes the
least recently freed block, dropping its cache entry (eviction). Blocks that carry no cached
prefix are queued first, so cached ones survive as long as possible.

A block's state lives in flat containers (a reference-count list, the free queue's links, dicts
for the cached ones), not in an object per block, and nothing ever rehashes all blocks: a GPU's
KV cache has hundreds of thousands of them. As many objects would cost seconds to make at load,
or, made on first use, would pile up in the garbage collector's oldest generation, whose every
pass stalls the serving loop for tens of ms; an OrderedDict free queue of that size rehashes
now and then, a stall as long.

With a sliding window on every layer (``ModelConfig.kv_window``: Mistral 7B v0.1, Phi-3 4k), a
query at position p reads only the keys p - w + 1 .. p, and the attention kernels never read a
block wholly before their first query's window, nor its block-table entry. So each time a
sequence is given slots, the blocks wholly before (its first uncomputed position - w + 1) go
back (``first_read_block``), exactly as a finished sequence's do: a registered one stays in the
prefix cache until evicted, so it can still be matched. Its table keeps those entries, which
keeps every position's index (the runner mirrors tables by position, append-only); the
sequence counts them in ``num_freed_blocks`` and neither reads nor frees them again. A
prefix-cache hit then needs only the blocks the first computed query reads to be cached, not
the whole chain from the first block (``_window_hits``). Models mixing sliding and global
layers keep one pool holding the whole context for every layer; ``hybrid_kv_savings`` says
what per-kind pools would save.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import TYPE_CHECKING

from compiled_llm.serve.core.sequence import Sequence

if TYPE_CHECKING:
    from compiled_llm.model.config import ModelConfig


# The entry a block table holds at a position whose block the sequence never took: a prefix-cache
# hit wholly before the sliding window (its block may have been evicted). No step reads it; it
# is a valid index all the same, so that no kernel could fault on it.
UNREAD_BLOCK = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def window_blocks(window: int, block_size: int, step_tokens: int = 1) -> int:
    """The most blocks a sequence holds at once under a sliding ``window`` while a step computes
    ``step_tokens`` tokens: the keys its first query reads and the step's own (w - 1 +
    step_tokens positions), plus one for a window that does not start on a block boundary.
    (vLLM's SlidingWindowSpec counts the same.)"""
    return cdiv(window - 1 + step_tokens, block_size) + 1


def hybrid_kv_savings(config: ModelConfig, max_model_len: int, block_size: int, step_tokens: int = 1) -> float:
    """The fraction of the KV cache a hybrid allocator would save on ``config`` for a sequence
    at ``max_model_len``: one pool per layer kind, each sliding layer holding only its window
    and one step's tokens (``window_blocks``; vLLM sizes its pools with the step's token
    budget), rather than one pool where every layer holds the whole context. 0 for a model
    without sliding layers; every layer has the same K/V size per token here, so blocks
    compare directly."""
    full = cdiv(max_model_len, block_size)
    held = 0
    for layer in range(config.num_layers):
        window = config.layer_window(layer)
        held += min(full, window_blocks(window, block_size, step_tokens)) if window else full
    return 1.0 - held / (config.num_layers * full)


class FreeBlockQueue:
    """Free block ids, least recently freed first: a doubly linked list over two int lists
    (vLLM's free block queue), so taking the head, queueing at either end and taking a block out
    of the middle (a cached block reused) are O(1), with no container ever resized."""

    def __init__(self, num_blocks: int):
        n = self._end = num_blocks  # index n: the sentinel, before the head and after the tail
        self._next = list(range(1, n + 1)) + [0]
        self._prev = [n] + list(range(n - 1)) + [n - 1]
        self._len = n

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block_id: int) -> bool:
        return self._prev[block_id] >= 0

    def __iter__(self):
        b = self._next[self._end]
        while b != self._end:
            yield b
            b = self._next[b]

    def popleft(self) -> int:
        if not self._len:
            raise IndexError("no free block")
        b = self._next[self._end]
        self.remove(b)
        return b

    def remove(self, block_id: int) -> None:
        assert self._prev[block_id] >= 0, f"block {block_id} is not in the free queue"
        nxt, prv = self._next, self._prev
        after, before = nxt[block_id], prv[block_id]
        nxt[before], prv[after] = after, before
        nxt[block_id] = prv[block_id] = -1
        self._len -= 1

    def append(self, block_id: int) -> None:
        """Queue at the tail: reused last."""
        self._insert(block_id, self._prev[self._end], self._end)

    def appendleft(self, block_id: int) -> None:
        """Queue at the head: reused first."""
        self._insert(block_id, self._end, self._next[self._end])

    def _insert(self, block_id: int, before: int, after: int) -> None:
        assert self._prev[block_id] < 0, f"block {block_id} is already in the free queue"
        nxt, prv = self._next, self._prev
        nxt[before], prv[block_id], nxt[block_id], prv[after] = block_id, before, after, block_id
        self._len += 1


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens looked up at admission
    hit_tokens: int = 0  # of those, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # the window of every layer (ModelConfig.kv_window), or None: blocks before it go back
        self.sliding_window = sliding_window
        self.ref_counts = [0] * num_blocks  # sequences holding each block
        self.free = FreeBlockQueue(num_blocks)
        # the prefix cache: chained hash -> (block id, parent block's hash, the block's token ids,
        # kept to rule out hash collisions); and block id -> its hash, for registered blocks
        self.cached: dict[int, tuple[int, int | None, tuple[int, ...]]] = {}
        self.block_hash: dict[int, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def first_read_block(self, position: int) -> int:
        """The first block a step whose first query is at ``position`` may read: with a
        sliding window w, the blocks wholly before position - w + 1 (the attention kernels'
        contract, ``paged_attention_read_ref``). No later step of the sequence reads them
        either, its queries only move forward. 0 without a window."""
        w = self.sliding_window
        return max(0, position - w + 1) // self.block_size if w else 0

    # ---- prefix cache -------------------------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of seq's tokens (full blocks only). At least one token
        is always left to compute, because the step that computes it yields the next logits."""
        if not self.enable_prefix_caching:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        if self.sliding_window:
            return self._window_hits(seq, limit)
        hits: list[int] = []
        for i in range(limit):
            b = self._cached_block(seq, i)
            if b is None:
                break
            hits.append(b)
        return hits

    def _cached_block(self, seq: Sequence, i: int) -> int | None:
        """The cached block holding seq's full block i after the same whole prefix, or None."""
        bs = self.block_size
        entry = self.cached.get(seq.block_hash(i, bs))
        parent = seq.block_hashes[i - 1] if i else None
        if entry is None or entry[1] != parent or entry[2] != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
            return None
        return entry[0]

    def _window_hits(self, seq: Sequence, limit: int) -> list[int]:
        """With a sliding window: the longest prefix of n <= ``limit`` blocks whose blocks from
        ``first_read_block(n * block_size)`` on, the ones the first computed query reads, are
        all cached (and at least block n - 1, which a one-token window would not read: a hit
        is never made of nothing). The blocks before need not be: no step reads them, and
        a cached block's K/V, registered under the chained hash of its whole prefix, is what
        computing that prefix would give. Their entries are UNREAD_BLOCK (allocate_slots does
        not take them). Scanned from the end, so a full hit costs a window's lookups."""
        bs = self.block_size
        end = limit
        while end > 0:
            start = min(self.first_read_block(end * bs), end - 1)
            found: list[int] = []
            for i in range(end - 1, start - 1, -1):
                b = self._cached_block(seq, i)
                if b is None:
                    break
                found.append(b)
            else:
                return [UNREAD_BLOCK] * start + found[::-1]
            end = i  # block i is missing: a hit ends before it
        return []

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queried_tokens += num_tokens
        self.stats.hit_tokens += num_hit_tokens

    def commit(self, seq: Sequence) -> None:
        """Register seq's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        # a block given back (sliding window) may be another's by now: never register it late
        for i in range(max(seq.num_committed_blocks, seq.num_freed_blocks), full):
            b = seq.block_table[i]
            if b in self.block_hash:
                continue  # reused from the cache
            h = seq.block_hash(i, bs)
            if h in self.cached:
                continue  # another sequence computed the same prefix at the same time
            parent = seq.block_hashes[i - 1] if i else None
            self.cached[h] = (b, parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            self.block_hash[b] = h
        seq.num_committed_blocks = max(seq.num_committed_blocks, full)

    # ---- allocation ---------------------------------------------------------------------------

    def _layout(self, seq: Sequence, num_new_tokens: int, computed_blocks) -> tuple[int, int]:
        """(the table length the step needs, the first block it may read). The step's first
        query is the first token not computed, after ``computed_blocks``. With async scheduling
        a step is queued ahead while the one before it is in flight and not yet applied, so
        num_computed_tokens is then the in-flight step's first query, one behind the new
        step's: the blocks given back are read by neither, and reusing them at once is safe
        whatever order the device ran the two steps in (the runner runs them in order on one
        stream anyway)."""
        start = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        return self.blocks_needed(start + num_new_tokens), self.first_read_block(start)

    def _fits_held_blocks(self, seq: Sequence, num_new_tokens: int, computed_blocks) -> bool:
        """The step needs nothing from the free queue and gives nothing back: the tokens fit
        in the blocks seq holds, with no hits to take and no window to slide (a decode step,
        15 times in 16 at block size 16). Checked first: it is every running row's every step."""
        return (not computed_blocks and not self.sliding_window
                and seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        if self._fits_held_blocks(seq, num_new_tokens, computed_blocks):
            return True
        total_blocks, first = self._layout(seq, num_new_tokens, computed_blocks)
        held = len(seq.block_table)
        need = total_blocks - held - len(computed_blocks)
        refs = self.ref_counts
        # reusing a cached block nobody holds takes it off the free queue too (a hit before
        # the window is not taken at all); seq's own blocks before the window go back first,
        # those another sequence shares staying taken
        revived = sum(1 for i, b in enumerate(computed_blocks, held) if i >= first and refs[b] == 0)
        released = sum(1 for b in seq.block_table[seq.num_freed_blocks:first] if refs[b] == 1)
        return max(need, 0) + revived <= len(self.free) + released

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Give seq the blocks for its computed tokens, ``computed_blocks`` (prefix-cache hits
        appended to its table) and ``num_new_tokens`` more; with a sliding window, first give
        back its blocks wholly before the step's window (those hits are not taken). False,
        changing nothing, when the free queue cannot cover it."""
        if self._fits_held_blocks(seq, num_new_tokens, computed_blocks):
            return True
        if not self.can_allocate(seq, num_new_tokens, computed_blocks):
            return False
        total_blocks, first = self._layout(seq, num_new_tokens, computed_blocks)
        self._release_before(seq, min(first, len(seq.block_table)))
        for i, b in enumerate(computed_blocks, len(seq.block_table)):
            if i < first:
                continue  # never read: its entry only keeps the positions
            if self.ref_counts[b] == 0:
                self.free.remove(b)
            self.ref_counts[b] += 1
        seq.block_table.extend(computed_blocks)
        seq.num_committed_blocks = len(seq.block_table) if computed_blocks else seq.num_committed_blocks
        seq.num_freed_blocks = max(seq.num_freed_blocks, first)
        for _ in range(total_blocks - len(seq.block_table)):
            seq.block_table.append(self._take_free_block())
        return True

    def _release_before(self, seq: Sequence, end: int) -> None:
        """Give back seq's blocks before table position ``end`` that it still holds."""
        for b in seq.block_table[seq.num_freed_blocks:end]:
            self._release(b)
        seq.num_freed_blocks = max(seq.num_freed_blocks, end)

    def _release(self, b: int) -> None:
        """Drop one hold on block b; once nobody holds it, it is queued for reuse, at the head
        when it holds nothing reusable, else at the tail (its prefix stays cached longest)."""
        refs = self.ref_counts
        refs[b] -= 1
        assert refs[b] >= 0, f"block {b} freed twice"
        if refs[b] == 0:
            if b in self.block_hash:
                self.free.append(b)
            else:
                self.free.appendleft(b)

    def _take_free_block(self) -> int:
        b = self.free.popleft()
        h = self.block_hash.pop(b, None)
        if h is not None:  # evict: this block's prefix is no longer cached
            del self.cached[h]
        self.ref_counts[b] = 1
        return b

    def free_seq(self, seq: Sequence) -> None:
        """Drop seq's hold on its blocks (not on those it gave back already). Tail blocks are
        queued before head blocks, so the shared prefixes (heads) are evicted last."""
        for b in reversed(seq.block_table[seq.num_freed_blocks:]):
            self._release(b)
        seq.block_table = []
        seq.num_committed_blocks = 0
        seq.num_freed_blocks = 0

    def check_invariants(self) -> None:
        """Consistency of counts, free queue and cache (used by tests)."""
        for b, refs in enumerate(self.ref_counts):
            assert refs >= 0
            assert (refs == 0) == (b in self.free), (b, refs)
        assert len(list(self.free)) == len(self.free)
        assert len(self.block_hash) == len(self.cached)
        for h, (b, _, _) in self.cached.items():
            assert self.block_hash[b] == h
