"""Packing scheduled sequences into a PackedBatch (host side, shared by the reference loop,
the runtime and tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from compiled_llm.model.spec import PackedBatch


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: ``new_tokens`` follow ``num_cached`` tokens already in
    the cache; ``block_table`` lists the blocks holding the whole context."""

    new_tokens: Sequence[int]
    num_cached: int
    block_table: Sequence[int]


def pack_batch(
    seqs: Sequence[ScheduledSeq],
    block_size: int,
    device: torch.device | str = "cpu",
    max_blocks: int | None = None,
) -> PackedBatch:
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    width = max_blocks or max((len(s.block_table) for s in seqs), default=1) or 1
    tables = torch.zeros((len(seqs), width), dtype=torch.int32)
    for i, s in enumerate(seqs):
        n = len(s.new_tokens)
        ctx = s.num_cached + n
        if ctx > len(s.block_table) * block_size:
            raise ValueError(f"sequence {i}: {ctx} tokens need more than its {len(s.block_table)} blocks")
        token_ids.extend(s.new_tokens)
        for pos in range(s.num_cached, ctx):
            positions.append(pos)
            slots.append(s.block_table[pos // block_size] * block_size + pos % block_size)
        qsl.append(qsl[-1] + n)
        seq_lens.append(ctx)
        tables[i, : len(s.block_table)] = torch.tensor(list(s.block_table), dtype=torch.int32)

    def t(x, dtype=torch.int64):
        return torch.tensor(x, dtype=dtype, device=device)

    return PackedBatch(
        token_ids=t(token_ids),
        positions=t(positions),
        query_start_loc=t(qsl, torch.int32),
        seq_lens=t(seq_lens, torch.int32),
        block_tables=tables.to(device),
        slot_mapping=t(slots),
    )
