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
"""

from __future__ import annotations

from dataclasses import dataclass

from compiled_llm.serve.core.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
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

    # ---- prefix cache -------------------------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of seq's tokens (full blocks only). At least one token
        is always left to compute, because the step that computes it yields the next logits."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent = None
        for i in range((seq.num_tokens - 1) // bs):
            h = seq.block_hash(i, bs)
            entry = self.cached.get(h)
            if entry is None or entry[1] != parent or entry[2] != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(entry[0])
            parent = h
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queried_tokens += num_tokens
        self.stats.hit_tokens += num_hit_tokens

    def commit(self, seq: Sequence) -> None:
        """Register seq's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(seq.num_committed_blocks, full):
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

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        total = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(seq.block_table) - len(computed_blocks)
        # reusing a cached block nobody holds takes it off the free queue too
        revived = sum(1 for b in computed_blocks if self.ref_counts[b] == 0)
        return max(need, 0) + revived <= len(self.free)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Give seq the blocks for its computed tokens, ``computed_blocks`` (prefix-cache hits
        appended to its table) and ``num_new_tokens`` more. False, changing nothing, when the
        free queue cannot cover it."""
        if not self.can_allocate(seq, num_new_tokens, computed_blocks):
            return False
        for b in computed_blocks:
            if self.ref_counts[b] == 0:
                self.free.remove(b)
            self.ref_counts[b] += 1
        seq.block_table.extend(computed_blocks)
        seq.num_committed_blocks = len(seq.block_table) if computed_blocks else seq.num_committed_blocks
        total = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        for _ in range(self.blocks_needed(total) - len(seq.block_table)):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        b = self.free.popleft()
        h = self.block_hash.pop(b, None)
        if h is not None:  # evict: this block's prefix is no longer cached
            del self.cached[h]
        self.ref_counts[b] = 1
        return b

    def free_seq(self, seq: Sequence) -> None:
        """Drop seq's hold on its blocks. Tail blocks are queued before head blocks, so the
        shared prefixes (heads) are evicted last."""
        refs = self.ref_counts
        for b in reversed(seq.block_table):
            refs[b] -= 1
            assert refs[b] >= 0, f"block {b} freed twice"
            if refs[b] == 0:
                if b in self.block_hash:
                    self.free.append(b)
                else:
                    self.free.appendleft(b)  # holds nothing reusable: reuse first
        seq.block_table = []
        seq.num_committed_blocks = 0

    def check_invariants(self) -> None:
        """Consistency of counts, free queue and cache (used by tests)."""
        for b, refs in enumerate(self.ref_counts):
            assert refs >= 0
            assert (refs == 0) == (b in self.free), (b, refs)
        assert len(list(self.free)) == len(self.free)
        assert len(self.block_hash) == len(self.cached)
        for h, (b, _, _) in self.cached.items():
            assert self.block_hash[b] == h
