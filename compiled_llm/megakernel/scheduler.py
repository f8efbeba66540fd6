"""Tiles -> SMs: list scheduling on an estimate of each tile's time, and the counters that order
the tiles across SMs.

Tiles are taken in program order (each op's after the ops it reads, so the order is
topological) and each goes to the SM where it could start first: when that SM is free and the
tiles it reads have ended. Every SM's list is therefore in program order, and a schedule made
this way cannot deadlock: the earliest tile not yet run has everything it waits for behind it.

A tile's dependencies are the tiles that write what it reads (``tiling.access``). It waits only
for those not already ordered before it, by its own SM's earlier tiles or by what it waits for
anyway; so every wait that is left is needed, and removing any one is a hazard the check finds.
A wait is on a counter each of a set of tiles adds one to when it ends: the producing op's
counter when the tile needs all of that op's tiles (the norm of a whole row, a linear's whole
input), else the one-tile counters of the tiles it needs (an attention split needs its head's q
and its group's k and v heads, not the others; a head's combine needs that head's splits).

The time estimate is weight bytes at each SM's share of the HBM bandwidth plus a fixed cost a
tile (attention: its split's share of its group's keys and values at an assumed context; the
combine: the fixed cost alone); it places tiles and is what ``inspect`` draws, not a measurement.
"""

from __future__ import annotations

import bisect
import dataclasses

from compiled_llm.megakernel import tiling
from compiled_llm.megakernel.lowering import DecodeOps
from compiled_llm.megakernel.schedule import MAX_ROWS, Instruction, Schedule


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the estimate assumes: an H200's copy bandwidth (measured 4,255 GB/s), a few
    microseconds of fixed work a tile, and the context attention reads."""

    num_sms: int
    hbm_bytes_per_us: float = 4.25e6
    tile_overhead_us: float = 0.5
    context_tokens: int = 1024
    element_bytes: int = 2


def tile_us(op, tile: int, cols, machine: Machine) -> float:
    per_sm = machine.hbm_bytes_per_us / machine.num_sms
    elements = tiling.weight_elements(op, tile, cols)
    if op.kind == "attention":
        elements = 2 * machine.context_tokens * op.attrs["head_dim"] // op.attrs["splits"]
    return machine.tile_overhead_us + elements * machine.element_bytes / per_sm


def dependencies(lowered: DecodeOps, tiles: list[tuple[int, int]]) -> list[list[int]]:
    """For each tile (index into ``tiles``), the tiles that write a region it reads."""
    cols = {b.name: b.cols for b in lowered.buffers}
    accesses = [tiling.access(lowered.ops[op], tile, cols) for op, tile in tiles]
    reads = [r for r, _ in accesses]
    writes = tiling.writers(w for _, w in accesses)
    starts = {b: [w[0] for w in lst] for b, lst in writes.items()}
    deps = []
    for i, regions in enumerate(reads):
        found = set()
        for region in regions:
            lst = writes.get(region.buffer, [])
            k = max(0, bisect.bisect_right(starts.get(region.buffer, []), region.start) - 1)
            while k < len(lst) and lst[k][0] < region.stop:
                if lst[k][1] > region.start and lst[k][2] != i:
                    found.add(lst[k][2])
                k += 1
        deps.append(sorted(found, reverse=True))
    return deps


def schedule(lowered: DecodeOps, machine: Machine) -> Schedule:
    """The schedule of ``lowered``'s ops on ``machine.num_sms`` SMs (see the module docstring)."""
    ops = lowered.ops
    cols = {b.name: b.cols for b in lowered.buffers}
    tiles = [(k, t) for k, op in enumerate(ops) for t in range(op.tiles)]
    first_tile = {}
    for i, (k, t) in enumerate(tiles):
        first_tile.setdefault(k, i)
    deps = dependencies(lowered, tiles)

    sm_free = [0.0] * machine.num_sms
    sm_last: list[int | None] = [None] * machine.num_sms
    start, end, placed = [0.0] * len(tiles), [0.0] * len(tiles), [0] * len(tiles)
    ancestors = [0] * len(tiles)  # bitset: the tiles ordered before this one
    waits_on: list[list[tuple[str, int]]] = []  # ("op", op index) | ("tile", tile index)
    behind_op: dict[int, int] = {}  # op -> its tiles and their ancestors
    for i, (k, t) in enumerate(tiles):
        ready = max((end[d] for d in deps[i]), default=0.0)
        sm = min(range(machine.num_sms), key=lambda s: (max(sm_free[s], ready), s))
        start[i] = max(sm_free[sm], ready)
        end[i] = start[i] + tile_us(ops[k], t, cols, machine)
        sm_free[sm], placed[i] = end[i], sm
        prev = sm_last[sm]
        sm_last[sm] = i
        covered = 0 if prev is None else ancestors[prev] | (1 << prev)
        by_op: dict[int, list[int]] = {}
        for d in deps[i]:
            by_op.setdefault(tiles[d][0], []).append(d)
        mine = []
        for d in deps[i]:  # latest first: its ancestors cover more of the rest
            if covered >> d & 1:
                continue
            producer = tiles[d][0]
            if len(by_op[producer]) == ops[producer].tiles:  # needs the whole op: its counter
                mine.append(("op", producer))
                if producer not in behind_op:
                    behind_op[producer] = 0
                    for j in range(first_tile[producer], first_tile[producer] + ops[producer].tiles):
                        behind_op[producer] |= ancestors[j] | (1 << j)
                covered |= behind_op[producer]
            else:
                mine.append(("tile", d))
                covered |= ancestors[d] | (1 << d)
        ancestors[i] = covered
        waits_on.append(mine)

    counters: dict[tuple[str, int], int] = {}
    for mine in waits_on:
        for key in mine:
            counters.setdefault(key, len(counters))
    instructions = []
    for i, (k, t) in enumerate(tiles):
        waits = tuple((counters[key], ops[key[1]].tiles if key[0] == "op" else 1) for key in waits_on[i])
        bumps = tuple(c for c in (counters.get(("op", k)), counters.get(("tile", i))) if c is not None)
        instructions.append(Instruction(k, t, placed[i], waits, bumps, round(start[i], 3), round(end[i], 3)))
    sms = tuple(tuple(i for i in range(len(tiles)) if placed[i] == s) for s in range(machine.num_sms))
    return Schedule(machine.num_sms, MAX_ROWS, lowered.buffers, ops, tuple(instructions), sms, len(counters),
                    lowered.logits, lowered.tokens)
