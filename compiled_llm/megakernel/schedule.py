"""A megakernel schedule as data, and its JSON form (the engine's ``megakernel.json``).

A ``Buffer`` is a [rows, cols] array in global memory that one decode step writes once (the
batch's rows, up to ``max_rows``); ``kv<L>`` names layer L's KV cache, whose columns are this
step's key heads then value heads. An ``Op`` is one lowered fused op, cut into ``tiles`` of its
output. An ``Instruction`` is one tile run by one SM: it waits until each of its ``waits``
counters reaches its value, runs, then adds one to each of its ``bumps``. Each SM runs its list
(``sms``) in order.

Reading is strict (``schedule_from_json``): every field's type and range is checked and anything
else is a one-line EngineError, so a damaged or tampered file is refused, never half read; the
hazard check (check.py) runs on what it returns before anything executes it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

from compiled_llm.errors import EngineError

FORMAT = "cllm-megakernel-schedule"
VERSION = 1
# decode buckets the backend serves: batch rows 1..MAX_ROWS, one token each
MAX_ROWS = 8
BUFFER_DTYPES = ("act", "float32", "int64")  # act: the model's dtype
# the SMs a schedule is made for when the build has no GPU to ask (H100 and H200 have 132)
DEFAULT_NUM_SMS = 132
MAX_NUM_SMS = 1024
KV_BUFFER = re.compile(r"kv(0|[1-9][0-9]{0,5})")  # layer L's KV cache: kv<L>


def kv_layer(name: str) -> int | None:
    """The layer of a KV buffer's name (``kv3`` -> 3), None for any other buffer."""
    return int(name[2:]) if KV_BUFFER.fullmatch(name) else None


def is_kv(name: str) -> bool:
    """A buffer that is a layer's KV cache, not an activation buffer of its own."""
    return kv_layer(name) is not None


@dataclasses.dataclass(frozen=True)
class Buffer:
    name: str
    cols: int
    dtype: str = "act"


@dataclasses.dataclass(frozen=True)
class Op:
    """One lowered op. ``params`` maps the kind's weight roles to engine weight names;
    ``attrs`` holds its static arguments (JSON scalars); its output is cut into ``tiles``
    (``tiling.py`` says what a tile covers)."""

    kind: str
    name: str  # the graph node it came from
    layer: int  # -1 for none
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: Mapping[str, str]
    attrs: Mapping[str, Any]
    tiles: int
    tile_cols: int

    @property
    def label(self) -> str:
        return self.kind if self.layer < 0 else f"{self.kind}.{self.layer}"


@dataclasses.dataclass(frozen=True)
class Instruction:
    op: int
    tile: int
    sm: int
    waits: tuple[tuple[int, int], ...]  # (counter, value it must reach)
    bumps: tuple[int, ...]
    start_us: float = 0.0  # the scheduler's estimate
    end_us: float = 0.0


@dataclasses.dataclass(frozen=True)
class Schedule:
    num_sms: int
    max_rows: int
    buffers: tuple[Buffer, ...]
    ops: tuple[Op, ...]
    instructions: tuple[Instruction, ...]
    sms: tuple[tuple[int, ...], ...]  # each SM's instruction indices, in the order it runs them
    num_counters: int
    logits: str  # the buffer of the step's logits
    tokens: str  # the buffer of the step's greedy tokens

    def label(self, index: int) -> str:
        """``qkv_rope.3[5]``: the op, layer and tile of instruction ``index``."""
        ins = self.instructions[index]
        return f"{self.ops[ins.op].label}[{ins.tile}]"

    def buffer(self, name: str) -> Buffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    def without_wait(self, index: int, wait: int) -> "Schedule":
        """This schedule with instruction ``index``'s ``wait``-th wait dropped (what a test of
        the hazard check removes)."""
        ins = self.instructions[index]
        changed = dataclasses.replace(ins, waits=ins.waits[:wait] + ins.waits[wait + 1:])
        return dataclasses.replace(self, instructions=self.instructions[:index] + (changed,)
                                   + self.instructions[index + 1:])


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------


def schedule_to_json(s: Schedule) -> dict:
    return {
        "format": FORMAT, "version": VERSION, "num_sms": s.num_sms, "max_rows": s.max_rows,
        "num_counters": s.num_counters, "logits": s.logits, "tokens": s.tokens,
        "buffers": [[b.name, b.cols, b.dtype] for b in s.buffers],
        "ops": [{"kind": o.kind, "name": o.name, "layer": o.layer, "inputs": list(o.inputs),
                 "outputs": list(o.outputs), "params": dict(o.params), "attrs": dict(o.attrs),
                 "tiles": o.tiles, "tile_cols": o.tile_cols} for o in s.ops],
        "instructions": [[i.op, i.tile, i.sm, [list(w) for w in i.waits], list(i.bumps),
                          round(i.start_us, 3), round(i.end_us, 3)] for i in s.instructions],
        "sms": [list(x) for x in s.sms],
    }


def _fail(what: str) -> EngineError:
    return EngineError(f"megakernel.json: {what}; rebuild the engine")


def _int(v: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    if type(v) is not int or v < lo or (hi is not None and v > hi):
        span = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise _fail(f"{what} must be an integer in {span}, got {str(v)[:30]!r}")
    return v


def _num(v: Any, what: str) -> float:
    if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
        raise _fail(f"{what} must be a finite number >= 0")
    return float(v)


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str) or not v or len(v) > 200:
        raise _fail(f"{what} must be a name")
    return v


def _list(v: Any, what: str, limit: int = 10_000_000) -> list:
    if not isinstance(v, list) or len(v) > limit:
        raise _fail(f"{what} must be a list")
    return v


def _scalar_map(v: Any, what: str) -> dict:
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise _fail(f"{what} must be an object")
    for k, x in v.items():
        if not (x is None or type(x) in (bool, int, float, str)):
            raise _fail(f"{what}[{k!r}] must be a number, text, true/false or null")
    return dict(v)


def schedule_from_json(data: Any) -> Schedule:
    """The schedule a ``megakernel.json`` document holds (see the module docstring)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _fail(f"not a {FORMAT} document")
    if data.get("version") != VERSION:
        raise _fail(f"format version {str(data.get('version'))[:20]!r} is not {VERSION}")
    num_sms = _int(data.get("num_sms"), "num_sms", 1, MAX_NUM_SMS)
    max_rows = _int(data.get("max_rows"), "max_rows", 1, MAX_ROWS)
    # a counter counts some ops' or tiles' ends: never more of them than ops and tiles
    limit = len(_list(data.get("ops"), "ops")) + len(_list(data.get("instructions"), "instructions"))
    num_counters = _int(data.get("num_counters"), "num_counters", 0, limit)
    buffers = []
    for k, b in enumerate(_list(data.get("buffers"), "buffers")):
        if not isinstance(b, list) or len(b) != 3 or b[2] not in BUFFER_DTYPES:
            raise _fail(f"buffer {k} must be [name, cols, {'|'.join(BUFFER_DTYPES)}]")
        buffers.append(Buffer(_str(b[0], f"buffer {k}'s name"), _int(b[1], f"buffer {k}'s cols", 1), b[2]))
    names = {b.name for b in buffers}
    if len(names) != len(buffers):
        raise _fail("a buffer name is used twice")
    ops = []
    for k, o in enumerate(_list(data.get("ops"), "ops")):
        if not isinstance(o, dict):
            raise _fail(f"op {k} must be an object")
        io = {}
        for key in ("inputs", "outputs"):
            io[key] = tuple(_str(x, f"op {k}'s {key}") for x in _list(o.get(key), f"op {k}'s {key}", 16))
            if not set(io[key]) <= names:
                raise _fail(f"op {k} names a buffer the schedule does not have")
        params = _scalar_map(o.get("params"), f"op {k}'s params")
        if not all(isinstance(x, str) for x in params.values()):
            raise _fail(f"op {k}'s params must map roles to weight names")
        ops.append(Op(kind=_str(o.get("kind"), f"op {k}'s kind"), name=_str(o.get("name"), f"op {k}'s name"),
                      layer=_int(o.get("layer"), f"op {k}'s layer", -1), inputs=io["inputs"],
                      outputs=io["outputs"], params=params, attrs=_scalar_map(o.get("attrs"), f"op {k}'s attrs"),
                      tiles=_int(o.get("tiles"), f"op {k}'s tiles", 1),
                      tile_cols=_int(o.get("tile_cols"), f"op {k}'s tile_cols", 1)))
    instructions = []
    for k, i in enumerate(_list(data.get("instructions"), "instructions")):
        if not isinstance(i, list) or len(i) != 7:
            raise _fail(f"instruction {k} must be [op, tile, sm, waits, bumps, start_us, end_us]")
        op = _int(i[0], f"instruction {k}'s op", 0, len(ops) - 1)
        waits = []
        for w in _list(i[3], f"instruction {k}'s waits", 4096):
            if not isinstance(w, list) or len(w) != 2:
                raise _fail(f"instruction {k}'s waits must be [counter, value] pairs")
            waits.append((_int(w[0], f"instruction {k}'s counter", 0, num_counters - 1),
                          _int(w[1], f"instruction {k}'s wait value", 1)))
        bumps = tuple(_int(c, f"instruction {k}'s bump", 0, num_counters - 1)
                      for c in _list(i[4], f"instruction {k}'s bumps", 4096))
        start, end = _num(i[5], f"instruction {k}'s start_us"), _num(i[6], f"instruction {k}'s end_us")
        if end < start:
            raise _fail(f"instruction {k} ends before it starts")
        instructions.append(Instruction(op, _int(i[1], f"instruction {k}'s tile", 0, ops[op].tiles - 1),
                                        _int(i[2], f"instruction {k}'s sm", 0, num_sms - 1), tuple(waits), bumps,
                                        start, end))
    sms = tuple(tuple(_int(x, f"SM {s}'s instruction", 0, len(instructions) - 1)
                      for x in _list(lst, f"SM {s}'s list")) for s, lst in enumerate(_list(data.get("sms"), "sms", MAX_NUM_SMS)))
    if len(sms) != num_sms:
        raise _fail(f"sms lists {len(sms)} SMs, not num_sms {num_sms}")
    logits, tokens = _str(data.get("logits"), "logits"), _str(data.get("tokens"), "tokens")
    if logits not in names or tokens not in names:
        raise _fail("logits or tokens names a buffer the schedule does not have")
    return Schedule(num_sms, max_rows, tuple(buffers), tuple(ops), tuple(instructions), sms, num_counters,
                    logits, tokens)
