"""A schedule as the device tensors the persistent kernel reads (triton_kernel.py).

Everything is flat int32/int64/float32 arrays, built once per program (the weights and the
activation buffers do not move) and read by the kernel with plain loads:

  sm_ranges     int32 [num_sms, 2]      SM s runs instructions[sm_ranges[s, 0]:sm_ranges[s, 1]]
  instructions  int32 [n, INS_FIELDS]   one record an instruction, laid out SM by SM in the
                                        order each SM runs them: kind code, op index, tile, the
                                        output columns [col0, col1) (qkv_rope: its weight rows),
                                        then [start, count) of its waits and of its bumps
  wait_counters int32 [w]               the counters the waits spin on ...
  wait_values   int32 [w]               ... and the values they must reach
  bump_counters int32 [b]               the counters each instruction adds one to when done
  op_addrs      int64 [ops, ADDR_SLOTS] data_ptr of each op's weights (WEIGHT, BIAS, NORM, ...)
                                        and activation buffers (IN0, IN1, OUT0..2); 0 for none
  op_ints       int32 [ops, INT_SLOTS]  K (input width), N (output width), heads, head_dim,
                                        layer, sliding window, activation code, has-* flags,
                                        attention's splits
  op_floats     float32 [ops, FLOAT_SLOTS]  eps, norm_eps, scale, softcap
  prefetch      int64 [n, 4]            per instruction, in the records' order: two (address,
                                        bytes) ranges of the weight rows it reads, which the
                                        kernel asks into L2 while the SM still waits for or
                                        runs the instruction before (0 bytes: nothing)

Split attention: an attention op's OUT0 is its float32 partial buffer (per (head, split): m, l,
acc[head_dim]), which is its combine op's IN0; the combine's OUT0 is the attention output.

Activation buffers are [max_rows, cols], contiguous (a row's stride is its width); the KV cache is
not a buffer here: the kernel takes it as an argument (it may move between calls) and an op
names its layer. Weights must be contiguous and of the model's dtype, except the rotary table,
which is float32 ([positions, head_dim], cos then sin); anything else is a ValueError naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch
from torch import Tensor

from compiled_llm.megakernel import tiling
from compiled_llm.megakernel.schedule import Op, Schedule, is_kv, kv_layer

KIND_CODES = {kind: code for code, kind in enumerate(tiling.KINDS)}
ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1}

# instruction record fields
INS_KIND, INS_OP, INS_TILE, INS_COL0, INS_COL1, INS_WAIT0, INS_NWAIT, INS_BUMP0, INS_NBUMP = range(9)
INS_FIELDS = 9
# op address slots
A_WEIGHT, A_BIAS, A_NORM, A_Q_NORM, A_K_NORM, A_COS_SIN, A_IN0, A_IN1, A_OUT0, A_OUT1, A_OUT2 = range(11)
ADDR_SLOTS = 11
# op int slots
(I_KIND, I_K, I_N, I_HEADS, I_KV_HEADS, I_HEAD_DIM, I_LAYER, I_WINDOW, I_ACTIVATION, I_HAS_BIAS, I_HAS_RESIDUAL,
 I_HAS_NORM, I_HAS_Q_NORM, I_HAS_K_NORM, I_HAS_ROPE, I_TILES, I_SPLITS) = range(17)
INT_SLOTS = 17
# op float slots
F_EPS, F_NORM_EPS, F_SCALE, F_SOFTCAP = range(4)
FLOAT_SLOTS = 4
# at most this many weight bytes of one instruction are prefetched into L2 (the rest streams as it
# is read): every SM prefetches one instruction ahead, so 132 SMs hold at most ~17 MB of L2
PREFETCH_BYTES = 128 * 1024

_ADDR_ROLES = {"weight": A_WEIGHT, "bias": A_BIAS, "norm": A_NORM, "q_norm": A_Q_NORM, "k_norm": A_K_NORM,
               "cos_sin": A_COS_SIN}


@dataclasses.dataclass(frozen=True)
class Encoded:
    sm_ranges: Tensor
    instructions: Tensor
    wait_counters: Tensor
    wait_values: Tensor
    bump_counters: Tensor
    op_addrs: Tensor
    op_ints: Tensor
    op_floats: Tensor
    prefetch: Tensor
    num_counters: int
    max_head_dim: int  # the widest head (the kernel's head block)
    max_tiles: int  # the most lm_head tiles (the argmax's block)
    aligned: bool  # every weight starts 16-byte aligned and its rows are multiples of 16 elements
    max_k: int  # the widest weight row (the kernel's K block need not be wider)


def activation_buffers(s: Schedule, dtype: torch.dtype, device) -> dict[str, Tensor]:
    """The schedule's activation buffers, [max_rows, cols] each (the KV caches are not here)."""
    kinds = {"act": dtype, "float32": torch.float32, "int64": torch.int64}
    return {b.name: torch.zeros((s.max_rows, b.cols), dtype=kinds[b.dtype], device=device)
            for b in s.buffers if not is_kv(b.name)}


def instruction_record(s: Schedule, index: int) -> tuple[int, int, int, int, int]:
    """(kind code, op, tile, col0, col1) of instruction ``index``: the output columns a
    column-tiled op's tile computes; qkv_rope: the rows of its head in the q/k/v weight;
    attention: its (head, split)'s columns of the partial buffer; attention_combine: its head's
    output columns."""
    ins = s.instructions[index]
    op = s.ops[ins.op]
    if op.kind == "qkv_rope":
        nh, nkv, hd = tiling.heads(op)
        part, h = tiling.qkv_part(op, ins.tile)
        first = {"q": h, "k": nh + h, "v": nh + nkv + h}[part] * hd
        c0, c1 = first, first + hd
    elif op.kind in ("attention", "attention_combine"):
        c0, c1 = ins.tile * op.tile_cols, (ins.tile + 1) * op.tile_cols
    elif op.kind == "argmax":
        c0, c1 = 0, 1
    else:
        c0, c1 = tiling.span(op, ins.tile)
    return KIND_CODES[op.kind], ins.op, ins.tile, c0, c1


def encode_instructions(s: Schedule) -> tuple[list[list[int]], list[list[int]], list[int], list[int], list[int]]:
    """(sm ranges, records, wait counters, wait values, bump counters) as Python lists."""
    ranges, records, wc, wv, bumps = [], [], [], [], []
    for lst in s.sms:
        ranges.append([len(records), len(records) + len(lst)])
        for index in lst:
            ins = s.instructions[index]
            records.append([*instruction_record(s, index), len(wc), len(ins.waits), len(bumps), len(ins.bumps)])
            wc += [c for c, _ in ins.waits]
            wv += [v for _, v in ins.waits]
            bumps += list(ins.bumps)
    return ranges, records, wc, wv, bumps


def weight_ranges(s: Schedule, index: int, params: Mapping[str, Tensor]) -> list[tuple[int, int]]:
    """The (address, bytes) ranges of the weight rows instruction ``index`` reads, at most two,
    together at most PREFETCH_BYTES (the first rows of each): a column tile reads rows [col0,
    col1), glu those and the up half's, a q/k/v tile its head's rows; attention and its combine,
    embed (its row is the token's) and argmax read no weight rows known ahead."""
    ins = s.instructions[index]
    op = s.ops[ins.op]
    if op.kind not in ("qkv_rope", "glu", "linear", "lm_head"):
        return []
    w = params[op.params["weight"]]
    _, _, _, c0, c1 = instruction_record(s, index)
    firsts = [c0, c0 + w.shape[0] // 2] if op.kind == "glu" else [c0]
    row = w.shape[1] * w.element_size()
    rows = min(c1 - c0, PREFETCH_BYTES // len(firsts) // row)
    return [(w.data_ptr() + first * row, rows * row) for first in firsts if rows > 0]


def _weight(params: Mapping[str, Tensor], name: str, dtype: torch.dtype, role: str) -> Tensor:
    t = params[name]
    want = torch.float32 if role == "cos_sin" else dtype
    if t.dtype != want or not t.is_contiguous():
        raise ValueError(f"the megakernel reads {name} as a contiguous {want} tensor, not {t.dtype} "
                         f"({'' if t.is_contiguous() else 'non-'}contiguous)")
    return t


def op_tables(s: Schedule, op: Op, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
              dtype: torch.dtype) -> tuple[list[int], list[int], list[float]]:
    """(addresses, ints, floats) of one op (see the module docstring)."""
    addrs, ints, floats = [0] * ADDR_SLOTS, [0] * INT_SLOTS, [0.0] * FLOAT_SLOTS
    for role, name in op.params.items():
        addrs[_ADDR_ROLES[role]] = _weight(params, name, dtype, role).data_ptr()
    for slot, name in zip((A_IN0, A_IN1), op.inputs):
        if not is_kv(name):
            addrs[slot] = buffers[name].data_ptr()
    for slot, name in zip((A_OUT0, A_OUT1, A_OUT2), op.outputs):
        if not is_kv(name):
            addrs[slot] = buffers[name].data_ptr()
    a = op.attrs
    cols = {b.name: b.cols for b in s.buffers}
    ints[I_KIND] = KIND_CODES[op.kind]
    ints[I_K] = params[op.params["weight"]].shape[1] if op.kind == "embed" else (cols[op.inputs[0]] if op.inputs else 0)
    ints[I_N] = cols[op.outputs[0]]
    ints[I_TILES] = op.tiles if op.kind != "argmax" else cols[op.inputs[0]]
    if op.kind in ("qkv_rope", "attention"):
        nh, nkv, hd = tiling.heads(op)
        if hd % 2:
            raise ValueError(f"the megakernel's q/k/v tiles need an even head_dim, not {hd}")
        ints[I_HEADS], ints[I_KV_HEADS], ints[I_HEAD_DIM] = nh, nkv, hd
        kv = op.outputs[1] if op.kind == "qkv_rope" else op.inputs[1]
        ints[I_LAYER] = kv_layer(kv)
    if op.kind == "qkv_rope":
        cos_sin = op.params.get("cos_sin")
        if cos_sin is not None and params[cos_sin].shape[1] != ints[I_HEAD_DIM]:
            raise ValueError(f"the megakernel rotates whole heads: {cos_sin} is not [positions, head_dim]")
        floats[F_EPS], floats[F_NORM_EPS] = float(a["eps"]), float(a["norm_eps"])
    if op.kind == "attention_combine":
        ints[I_HEADS], ints[I_HEAD_DIM] = a["num_heads"], a["head_dim"]
    if op.kind in ("attention", "attention_combine"):
        ints[I_SPLITS] = a["splits"]
    if op.kind == "attention":
        ints[I_WINDOW] = int(a["sliding_window"] or 0)
        floats[F_SCALE], floats[F_SOFTCAP] = float(a["scale"]), float(a["softcap"] or 0.0)
    if op.kind in ("glu", "lm_head"):
        floats[F_EPS] = float(a["eps"])
    if op.kind == "glu":
        ints[I_ACTIVATION] = ACTIVATION_CODES[a["activation"]]
    ints[I_HAS_BIAS] = int("bias" in op.params)
    ints[I_HAS_RESIDUAL] = int(op.kind == "linear" and len(op.inputs) == 2)
    ints[I_HAS_NORM] = int("norm" in op.params)
    ints[I_HAS_Q_NORM] = int("q_norm" in op.params)
    ints[I_HAS_K_NORM] = int("k_norm" in op.params)
    ints[I_HAS_ROPE] = int("cos_sin" in op.params)
    return addrs, ints, floats


def _on_device(table: Tensor, device) -> Tensor:
    """A host table copied to ``device`` without a host sync (pinned, non-blocking): the first
    decode step, which encodes, may be the CUDA-graph runner's warm-up run, where a synchronising
    copy is an error that turns the engine's graphs off."""
    if torch.device(device).type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)


def encode(s: Schedule, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], dtype: torch.dtype,
           device) -> Encoded:
    """The device tensors of schedule ``s`` over ``params`` and the activation ``buffers``
    (``activation_buffers``), which must outlive the result: it holds their addresses."""
    for b in s.buffers:
        if not is_kv(b.name):
            t = buffers[b.name]
            if t.shape != (s.max_rows, b.cols) or not t.is_contiguous():
                raise ValueError(f"buffer {b.name} must be a contiguous [{s.max_rows}, {b.cols}] tensor")
    ranges, records, wc, wv, bumps = encode_instructions(s)
    tables = [op_tables(s, op, params, buffers, dtype) for op in s.ops]

    def i32(x, width=None):
        t = torch.tensor(x, dtype=torch.int32)
        return _on_device(t if len(x) else torch.zeros((0, width) if width else (1,), dtype=torch.int32), device)

    heads = [op.attrs["head_dim"] for op in s.ops if op.kind in ("qkv_rope", "attention")]
    weights = [params[op.params["weight"]] for op in s.ops if "weight" in op.params]
    aligned = all(w.data_ptr() % 16 == 0 and w.shape[1] % 16 == 0 for w in weights)
    prefetch = []
    for lst in s.sms:
        for index in lst:
            fetched = weight_ranges(s, index, params) if aligned else []
            prefetch.append([v for r in fetched + [(0, 0)] * (2 - len(fetched)) for v in r])
    return Encoded(
        sm_ranges=i32(ranges), instructions=i32(records, INS_FIELDS),
        wait_counters=i32(wc), wait_values=i32(wv), bump_counters=i32(bumps),
        op_addrs=_on_device(torch.tensor([t[0] for t in tables], dtype=torch.int64), device),
        op_ints=_on_device(torch.tensor([t[1] for t in tables], dtype=torch.int32), device),
        op_floats=_on_device(torch.tensor([t[2] for t in tables], dtype=torch.float32), device),
        prefetch=_on_device(torch.tensor(prefetch, dtype=torch.int64).reshape(-1, 4), device),
        num_counters=s.num_counters, max_head_dim=max(heads, default=2),
        max_tiles=max((op.tiles for op in s.ops if op.kind == "lm_head"), default=1), aligned=aligned,
        max_k=max((w.shape[1] for w in weights), default=16))
