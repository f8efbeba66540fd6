"""Paged-KV block allocation with reference counts and prefix caching.

A block holds ``block_size`` consecutive tokens of one or more sequences' context. Full blocks
are registered in the prefix cache under a chained hash (parent block's hash, the block's token
ids), so a later request whose prompt starts with the same tokens reuses them instead of
recomputing. Blocks nobody holds sit in a free queue in LRU order: an allocation takes the
least recently freed block, dropping its cache entry (eviction). Blocks that carry no cached
prefix are queued first, so cached ones survive as long as possible.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from compiled_llm.serve.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered in the prefix cache
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # kept to rule out hash collisions


class _Blocks(dict):
    """Block objects by id, each made on first use: a GPU's KV cache has hundreds of thousands
    of blocks, and making them all up front cost more than a second of every load."""

    def __missing__(self, block_id: int) -> Block:
        block = self[block_id] = Block(block_id)
        return block


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
        self.blocks = _Blocks()
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, Block] = {}  # chained hash -> block
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
            block = self.cached.get(h)
            if (
                block is None
                or block.parent_hash != parent
                or block.token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs])
            ):
                break
            hits.append(block.block_id)
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
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue  # reused from the cache
            h = seq.block_hash(i, bs)
            if h in self.cached:
                continue  # another sequence computed the same prefix at the same time
            block.hash = h
            block.parent_hash = seq.block_hashes[i - 1] if i else None
            block.token_ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            self.cached[h] = block
        seq.num_committed_blocks = max(seq.num_committed_blocks, full)

    # ---- allocation ---------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        total = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(seq.block_table) - len(computed_blocks)
        # reusing a cached block nobody holds takes it off the free queue too
        revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        return max(need, 0) + revived <= len(self.free)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Give seq the blocks for its computed tokens, ``computed_blocks`` (prefix-cache hits
        appended to its table) and ``num_new_tokens`` more. False, changing nothing, when the
        free queue cannot cover it."""
        if not self.can_allocate(seq, num_new_tokens, computed_blocks):
            return False
        for b in computed_blocks:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self.free[b]
            block.ref_count += 1
        seq.block_table.extend(computed_blocks)
        seq.num_committed_blocks = len(seq.block_table) if computed_blocks else seq.num_committed_blocks
        total = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        for _ in range(self.blocks_needed(total) - len(seq.block_table)):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        b, _ = self.free.popitem(last=False)
        block = self.blocks[b]
        if block.hash is not None:  # evict: this block's prefix is no longer cached
            if self.cached.get(block.hash) is block:
                del self.cached[block.hash]
            block.hash = block.parent_hash = block.token_ids = None
        block.ref_count = 1
        return b

    def free_seq(self, seq: Sequence) -> None:
        """Drop seq's hold on its blocks. Tail blocks are queued before head blocks, so the
        shared prefixes (heads) are evicted last."""
        for b in reversed(seq.block_table):
            block = self.blocks[b]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {b} freed twice"
            if block.ref_count == 0:
                self.free[b] = None
                if block.hash is None:
                    self.free.move_to_end(b, last=False)  # holds nothing reusable: reuse first
        seq.block_table = []
        seq.num_committed_blocks = 0

    def check_invariants(self) -> None:
        """Consistency of counts, free queue and cache (used by tests)."""
        for block in map(self.blocks.__getitem__, range(self.num_blocks)):
            assert block.ref_count >= 0
            assert (block.ref_count == 0) == (block.block_id in self.free), block
        for h, block in self.cached.items():
            assert block.hash == h
