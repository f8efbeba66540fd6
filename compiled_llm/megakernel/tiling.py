"""What each tile of each op reads and writes: regions (column ranges, all rows) of the schedule's
buffers. One place says it, and the scheduler (which orders the tiles), the hazard check (which
proves the order) and the interpreter (which checks every read at run time) all ask it.

The op kinds, and how their output is cut:

  embed      the embedding rows of the step's tokens          tiles of hidden columns
  qkv_rope   norm + q/k/v + q/k norm + RoPE + KV store        one tile per q, k or v head
  attention  one query head over its paged context            one tile per query head
  glu        norm + gate/up + activation (the gated MLP's first half)   tiles of its columns
  linear     a linear, + residual when it has one (o, down)   tiles of output columns
  lm_head    final norm + lm_head, and each tile's best token  tiles of the vocabulary
  argmax     the best of the tiles' best tokens               one tile

A KV buffer's columns are heads: this step's key heads, then its value heads.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from compiled_llm.megakernel.schedule import Op

KINDS = ("embed", "qkv_rope", "attention", "glu", "linear", "lm_head", "argmax")
# the narrowest tile of a linear's columns (a GPU tile's rows of weights)
TILE_ALIGN = 16


@dataclasses.dataclass(frozen=True)
class Region:
    buffer: str
    start: int
    stop: int

    def overlaps(self, other: "Region") -> bool:
        return self.buffer == other.buffer and self.start < other.stop and other.start < self.stop

    def __str__(self) -> str:
        return f"{self.buffer}[{self.start}:{self.stop}]"


def tile_cols(n: int, num_sms: int) -> int:
    """Columns a tile of an n-column output takes: about one tile per SM, a multiple of
    TILE_ALIGN (all n when n is narrower)."""
    if n <= TILE_ALIGN:
        return n
    return min(n, TILE_ALIGN * math.ceil(n / num_sms / TILE_ALIGN))


def span(op: Op, tile: int) -> tuple[int, int]:
    """The output columns [start, stop) tile ``tile`` of a column-tiled op computes."""
    start = tile * op.tile_cols
    return start, min(start + op.tile_cols, op.attrs["cols"])


def heads(op: Op) -> tuple[int, int, int]:
    a = op.attrs
    return a["num_heads"], a["num_kv_heads"], a["head_dim"]


def qkv_part(op: Op, tile: int) -> tuple[str, int]:
    """("q" | "k" | "v", head) that tile ``tile`` of a qkv_rope op computes."""
    nh, nkv, _ = heads(op)
    if tile < nh:
        return "q", tile
    if tile < nh + nkv:
        return "k", tile - nh
    return "v", tile - nh - nkv


def access(op: Op, tile: int, cols: Mapping[str, int]) -> tuple[tuple[Region, ...], tuple[Region, ...]]:
    """(regions tile ``tile`` of ``op`` reads, regions it writes); ``cols``: each buffer's width."""
    kind = op.kind
    if kind == "embed":
        (out,) = op.outputs
        return (), (Region(out, *span(op, tile)),)
    if kind == "qkv_rope":
        (x,), (q, kv) = op.inputs, op.outputs
        nh, nkv, hd = heads(op)
        part, h = qkv_part(op, tile)
        if part == "q":
            written = Region(q, h * hd, (h + 1) * hd)
        else:
            written = Region(kv, h + (nkv if part == "v" else 0), h + 1 + (nkv if part == "v" else 0))
        return (Region(x, 0, cols[x]),), (written,)
    if kind == "attention":
        (q, kv), (out,) = op.inputs, op.outputs
        nh, nkv, hd = heads(op)
        g = tile // (nh // nkv)
        return ((Region(q, tile * hd, (tile + 1) * hd), Region(kv, g, g + 1), Region(kv, nkv + g, nkv + g + 1)),
                (Region(out, tile * hd, (tile + 1) * hd),))
    if kind == "glu":
        (x,), (out,) = op.inputs, op.outputs
        return (Region(x, 0, cols[x]),), (Region(out, *span(op, tile)),)
    if kind == "linear":
        x, *residual = op.inputs
        (out,) = op.outputs
        start, stop = span(op, tile)
        reads = (Region(x, 0, cols[x]),) + tuple(Region(r, start, stop) for r in residual)
        return reads, (Region(out, start, stop),)
    if kind == "lm_head":
        (x,), (logits, best_val, best_idx) = op.inputs, op.outputs
        return ((Region(x, 0, cols[x]),),
                (Region(logits, *span(op, tile)), Region(best_val, tile, tile + 1), Region(best_idx, tile, tile + 1)))
    if kind == "argmax":
        (best_val, best_idx), (tokens,) = op.inputs, op.outputs
        return ((Region(best_val, 0, cols[best_val]), Region(best_idx, 0, cols[best_idx])), (Region(tokens, 0, 1),))
    raise ValueError(f"unknown megakernel op kind {kind!r}; known: {', '.join(KINDS)}")


def writers(written) -> dict[str, list[tuple[int, int, int]]]:
    """Buffer -> (start, stop, tile) of every region written, by start: ``written`` is each
    tile's written regions, in tile order (what the scheduler orders by and the check proves)."""
    out: dict[str, list[tuple[int, int, int]]] = {}
    for i, regions in enumerate(written):
        for r in regions:
            out.setdefault(r.buffer, []).append((r.start, r.stop, i))
    for lst in out.values():
        lst.sort()
    return out


def weight_elements(op: Op, tile: int, cols: Mapping[str, int]) -> int:
    """Weight elements tile ``tile`` of ``op`` reads from memory (what its time is mostly made of
    in batch-1 decode; attention's KV is estimated by the scheduler, embed's rows are a few)."""
    kind = op.kind
    if kind in ("glu", "linear", "lm_head"):
        start, stop = span(op, tile)
        k = cols[op.inputs[0]]
        return (stop - start) * k * (2 if kind == "glu" else 1)
    if kind == "qkv_rope":
        return heads(op)[2] * cols[op.inputs[0]]
    if kind == "embed":
        start, stop = span(op, tile)
        return stop - start
    return 0
