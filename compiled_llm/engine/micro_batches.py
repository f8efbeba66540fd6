"""A step's packed batch cut into micro-batches of whole sequences, for a pipeline to overlap.

A pipelined step runs micro-batch j+1 on stage k while stage k+1 runs micro-batch j
(``pipeline_stage.py``). Sequences of one step are independent (each attends to its own blocks
and writes its own slots), so running them in groups and putting the logits back in order is
the same computation. Every rank cuts the same batch the same way: the cut depends only on the
batch (``query_start_loc``), which every rank receives whole.
"""

from __future__ import annotations

import dataclasses

import torch

from compiled_llm.model.spec import PackedBatch


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    batch: PackedBatch
    first_token: int  # its rows are the step's token rows [first_token, end_token)
    end_token: int


def cut_points(query_start_loc: list[int], parts: int) -> list[int]:
    """Sequence indices [0, ..., S] cutting S sequences into at most ``parts`` groups of about
    equal token counts, none empty."""
    seqs = len(query_start_loc) - 1
    parts = max(1, min(parts, seqs))
    total = query_start_loc[-1]
    cuts = [0]
    for j in range(1, parts):
        target = total * j / parts
        # the first sequence boundary at or past the target, leaving room for the groups after
        s = next((i for i in range(cuts[-1] + 1, seqs) if query_start_loc[i] >= target), seqs)
        s = min(s, seqs - (parts - j))
        if s > cuts[-1]:
            cuts.append(s)
    cuts.append(seqs)
    return cuts


def split(batch: PackedBatch, parts: int) -> list[MicroBatch]:
    """``batch`` as at most ``parts`` micro-batches, in order (one when it has one sequence)."""
    qsl = batch.query_start_loc.tolist()
    cuts = cut_points(qsl, parts)
    if len(cuts) == 2:
        return [MicroBatch(batch, 0, qsl[-1])]
    out = []
    for a, b in zip(cuts, cuts[1:]):
        t0, t1 = qsl[a], qsl[b]
        out.append(MicroBatch(PackedBatch(
            token_ids=batch.token_ids[t0:t1],
            positions=batch.positions[t0:t1],
            query_start_loc=batch.query_start_loc[a:b + 1] - t0,
            seq_lens=batch.seq_lens[a:b],
            block_tables=batch.block_tables[a:b],
            slot_mapping=batch.slot_mapping[t0:t1],
        ), t0, t1))
    return out


def rows_within(rows: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Of a step's logits rows (token rows, ascending), those of ``mb``, as its own rows."""
    inside = (rows >= mb.first_token) & (rows < mb.end_token)
    return rows[inside] - mb.first_token
