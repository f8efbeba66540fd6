"""What each tile of each op reads and writes: regions (column ranges, all rows) of the schedule's
buffers. One place says it, and the scheduler (which orders the tiles), the hazard check (which
proves the order) and the interpreter (which checks every read at run time) all ask it.

The op kinds, and how their output is cut:

  embed      the embedding rows of the step's tokens          tiles of hidden columns
  qkv_rope   norm + q/k/v + q/k norm + RoPE + KV store        one tile per q, k or v head
  attention  one query head over one split of its paged context: that split's softmax
             partials (running max m, sum l, weighted values acc) in fp32
                                                              one tile per (query head, split)
  attention_combine  a head's partials of every split -> its attention output
                                                              one tile per query head
  glu        norm + gate/up + activation (the gated MLP's first half)   tiles of its columns
  linear     a linear, + residual when it has one (o, down)   tiles of output columns
  lm_head    final norm + lm_head, and each tile's best token  tiles of the vocabulary
  argmax     the best of the tiles' best tokens               one tile

A KV buffer's columns are heads: this step's key heads, then its value heads.

Attention is split along the context (flash-decoding) so that a layer's attention fills the SMs
rather than one per query head: tile t of an attention op is head ``t // splits``, split
``t % splits``, and writes ``head_dim + 2`` floats (m, l, acc) of the partial buffer; the
combine op's tile h reads head h's partials of all splits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from compiled_llm.megakernel.schedule import Op

KINDS = ("embed", "qkv_rope", "attention", "attention_combine", "glu", "linear", "lm_head", "argmax")
# the narrowest tile of a linear's columns (a GPU tile's rows of weights)
TILE_ALIGN = 16
# the most splits of a head's context: past 8, a split of a short context is a step or two of
# keys, and the combine reads more partials than the splits save
MAX_SPLITS = 8


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


def attention_splits(num_sms: int, num_heads: int) -> int:
    """Splits of each head's context: enough (head, split) tiles to give every SM one, at most
    MAX_SPLITS, at least one."""
    return max(1, min(MAX_SPLITS, num_sms // num_heads))


def split_span(ctx, window, splits, split):
    """Positions [lo, hi) of a context of ``ctx`` tokens that split ``split`` of ``splits``
    attends to: the visible positions [start, ctx) (start = ctx - window with a sliding window
    > 0, else 0) cut into chunks of a multiple of 16 keys (a cache block; the kernel's 32-key
    steps may end half masked), the last ones empty (lo == hi == ctx) when the context is short:
    a short context still runs every split's tile, which then writes empty partials.

    The one definition of the partition: the interpreter calls it with ints and the kernel jits
    this same code (triton_kernel._split_span), so it is written in what both run: + - * //,
    comparisons and min/max of non-negative integers, no branches and no module globals."""
    start = max(ctx - window, 0) * (window > 0)  # a product, not a branch: the kernel's window is a value
    chunk = ((ctx - start + splits - 1) // splits + 15) // 16 * 16
    lo = min(start + split * chunk, ctx)
    return lo, min(lo + chunk, ctx)


def partial_cols(op: Op) -> int:
    """Floats of one (head, split)'s partials: m, l, then acc[head_dim]."""
    return op.attrs["head_dim"] + 2


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
        (q, kv), (partial,) = op.inputs, op.outputs
        nh, nkv, hd = heads(op)
        h = tile // op.attrs["splits"]
        g = h // (nh // nkv)
        w = partial_cols(op)
        return ((Region(q, h * hd, (h + 1) * hd), Region(kv, g, g + 1), Region(kv, nkv + g, nkv + g + 1)),
                (Region(partial, tile * w, (tile + 1) * w),))
    if kind == "attention_combine":
        (partial,), (out,) = op.inputs, op.outputs
        hd, head_partials = op.attrs["head_dim"], op.attrs["splits"] * partial_cols(op)
        return ((Region(partial, tile * head_partials, (tile + 1) * head_partials),),
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
