"""Running a schedule on CPU with the reference ops: the megakernel's semantics, executable.

The SMs are simulated: at each turn one SM whose next instruction's waits are met runs it (the
first such SM, or one drawn with ``order_seed``, so that tests can try many legal orders), then
bumps its counters. Every tile computes its share of the op with the ops' reference functions
(``graph/ops.py``) on slices of the weights, exactly as the fused op's reference does it whole.

Buffers start as NaN (integers as -1), and before a tile runs, every region it reads must have
been written in this step; a read of something not yet written is a ScheduleError naming both
tiles' ops, so a missing dependency is caught where it bites, not only as wrong logits.
"""

from __future__ import annotations

import random
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from compiled_llm.graph.fused_ops import glu_activation_ref
from compiled_llm.graph.ops import rms_norm_ref, rotary_ref, soft_cap
from compiled_llm.megakernel import tiling
from compiled_llm.megakernel.check import ScheduleError
from compiled_llm.megakernel.schedule import Op, Schedule, is_kv, kv_layer
from compiled_llm.model.spec import PackedBatch


def is_decode(batch: PackedBatch, max_rows: int) -> bool:
    """One new token for each of at most ``max_rows`` sequences."""
    rows = batch.seq_lens.shape[0]
    return (batch.token_ids.shape[0] == rows <= max_rows
            and batch.query_start_loc.tolist() == list(range(rows + 1)))


class _Step:
    """One decode step's state: the buffers, which regions of them are written, the inputs."""

    def __init__(self, s: Schedule, params: Mapping[str, Tensor], batch: PackedBatch, kv_cache: Tensor):
        self.s, self.params, self.batch, self.kv = s, params, batch, kv_cache
        rows = batch.seq_lens.shape[0]
        dtype = kv_cache.dtype  # the model's (the cos/sin table, say, is float32 in any engine)
        self.bufs: dict[str, Tensor] = {}
        for b in s.buffers:
            if is_kv(b.name):
                continue  # the KV cache itself
            if b.dtype == "int64":
                self.bufs[b.name] = torch.full((rows, b.cols), -1, dtype=torch.int64, device=kv_cache.device)
            else:
                kind = torch.float32 if b.dtype == "float32" else dtype
                self.bufs[b.name] = torch.full((rows, b.cols), float("nan"), dtype=kind, device=kv_cache.device)
        self.cols = {b.name: b.cols for b in s.buffers}
        self.written: dict[str, list[tuple[int, int, int]]] = {}  # buffer -> (start, stop, writer)

    def check_reads(self, index: int, regions) -> None:
        for r in regions:
            spans = sorted(w for w in self.written.get(r.buffer, []) if w[1] > r.start and w[0] < r.stop)
            at = r.start
            for w0, w1, _ in spans:
                if w0 > at:
                    break
                at = max(at, w1)
            if at < r.stop:
                raise ScheduleError(f"{self.s.label(index)} ran before {r.buffer}[{at}:{r.stop}] was written: "
                                    "the schedule lacks a dependency")

    def wrote(self, index: int, regions) -> None:
        for r in regions:
            self.written.setdefault(r.buffer, []).append((r.start, r.stop, index))

    def w(self, op: Op, role: str) -> Tensor | None:
        name = op.params.get(role)
        return None if name is None else self.params[name]


def _embed(st: _Step, op: Op, tile: int) -> None:
    start, stop = tiling.span(op, tile)
    st.bufs[op.outputs[0]][:, start:stop] = st.w(op, "weight").index_select(0, st.batch.token_ids)[:, start:stop]


def _qkv_rope(st: _Step, op: Op, tile: int) -> None:
    a = op.attrs
    nh, nkv, hd = tiling.heads(op)
    part, h = tiling.qkv_part(op, tile)
    x = st.bufs[op.inputs[0]]
    norm = st.w(op, "norm")
    if norm is not None:
        x = rms_norm_ref(x, norm, a["norm_eps"])
    first = {"q": h * hd, "k": (nh + h) * hd, "v": (nh + nkv + h) * hd}[part]
    bias = st.w(op, "bias")
    y = F.linear(x, st.w(op, "weight")[first:first + hd], None if bias is None else bias[first:first + hd])
    y = y.reshape(-1, 1, hd)
    head_norm = st.w(op, {"q": "q_norm", "k": "k_norm"}.get(part, ""))
    if head_norm is not None:
        y = rms_norm_ref(y, head_norm, a["eps"])
    cos_sin = st.w(op, "cos_sin")
    if cos_sin is not None and part != "v":
        y = rotary_ref(y, st.batch.positions, cos_sin)
    if part == "q":
        st.bufs[op.outputs[0]][:, h * hd:(h + 1) * hd] = y.reshape(-1, hd)
        return
    layer = st.kv[kv_layer(op.outputs[1])]  # [2, num_blocks, block_size, Hkv, D]
    flat = layer[0 if part == "k" else 1].view(-1, nkv, hd)
    slots = st.batch.slot_mapping
    keep = slots >= 0
    flat[slots[keep], h] = y[keep, 0].to(flat.dtype)


# an empty split's running max: finite, so the combine's exp(m - M) is 0 beside any real score
# and 1 when every split is empty (then the denominator is 0 and the output 0)
EMPTY_MAX = -1.0e30


def attention_partial_ref(q: Tensor, cache: Tensor, seq_lens: Tensor, block_tables: Tensor, scale: float,
                          sliding_window: int, softcap: float, splits: int, split: int) -> Tensor:
    """[rows, head_dim + 2] fp32: each decode row's (m, l, acc) over the positions of split
    ``split`` (tiling.split_span) of its context, for one query head: q [rows, head_dim], cache
    [2, num_blocks, block_size, head_dim] (its KV group's keys and values). m is the largest
    scaled, softcapped score, l the sum of exp(score - m), acc the sum of exp(score - m) * v:
    what paged_attention_read_ref's softmax is made of, the keys gathered through the block
    table as it gathers them. An empty split is (EMPTY_MAX, 0, 0)."""
    block_size, hd = cache.shape[2], cache.shape[3]
    out = torch.zeros(q.shape[0], hd + 2, dtype=torch.float32, device=q.device)
    out[:, 0] = EMPTY_MAX
    for r, ctx in enumerate(seq_lens.tolist()):
        lo, hi = tiling.split_span(ctx, sliding_window or 0, splits, split)
        if lo == hi:
            continue
        pos = torch.arange(lo, hi, device=q.device)
        blocks = block_tables[r, pos // block_size].long()
        k, v = (cache[i, blocks, pos % block_size].float() for i in (0, 1))  # [n, hd]
        scores = soft_cap((k @ q[r].float()) * scale, softcap or 0.0)
        m = scores.max()
        p = torch.exp(scores - m)
        out[r, 0], out[r, 1], out[r, 2:] = m, p.sum(), p @ v
    return out


def attention_combine_ref(partials: Tensor, dtype: torch.dtype) -> Tensor:
    """[rows, head_dim] of ``dtype``: one head's attention output from its partials [rows,
    splits, head_dim + 2] (attention_partial_ref's): each split's sums rescaled to the largest
    max, M = max_c m_c, out = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c, rounded once;
    0 where the denominator is 0 (a padding row, or nothing to attend to)."""
    m, l, acc = partials[..., 0], partials[..., 1], partials[..., 2:]
    w = torch.exp(m - m.max(dim=1, keepdim=True).values)
    den = (w * l).sum(dim=1, keepdim=True)
    num = (w[..., None] * acc).sum(dim=1)
    return torch.where(den > 0, num / den.clamp_min(1e-30), 0.0).to(dtype)


def _attention(st: _Step, op: Op, tile: int) -> None:
    a = op.attrs
    nh, nkv, hd = tiling.heads(op)
    splits = a["splits"]
    h, split = divmod(tile, splits)
    g = h // (nh // nkv)
    q = st.bufs[op.inputs[0]][:, h * hd:(h + 1) * hd]
    cache = st.kv[a["layer"]][:, :, :, g]
    b = st.batch
    w = tiling.partial_cols(op)
    st.bufs[op.outputs[0]][:, tile * w:(tile + 1) * w] = attention_partial_ref(
        q, cache, b.seq_lens, b.block_tables, a["scale"], a["sliding_window"], a["softcap"], splits, split)


def _attention_combine(st: _Step, op: Op, tile: int) -> None:
    hd, splits = op.attrs["head_dim"], op.attrs["splits"]
    n = splits * tiling.partial_cols(op)
    partials = st.bufs[op.inputs[0]][:, tile * n:(tile + 1) * n].reshape(-1, splits, hd + 2)
    out = st.bufs[op.outputs[0]]
    out[:, tile * hd:(tile + 1) * hd] = attention_combine_ref(partials, out.dtype)


def _glu(st: _Step, op: Op, tile: int) -> None:
    start, stop = tiling.span(op, tile)
    inter = op.attrs["cols"]
    n = rms_norm_ref(st.bufs[op.inputs[0]], st.w(op, "norm"), op.attrs["eps"])
    w = st.w(op, "weight")
    gate, up = F.linear(n, w[start:stop]), F.linear(n, w[inter + start:inter + stop])
    st.bufs[op.outputs[0]][:, start:stop] = glu_activation_ref(gate, op.attrs["activation"]) * up


def _linear(st: _Step, op: Op, tile: int) -> None:
    start, stop = tiling.span(op, tile)
    bias = st.w(op, "bias")
    y = F.linear(st.bufs[op.inputs[0]], st.w(op, "weight")[start:stop], None if bias is None else bias[start:stop])
    if len(op.inputs) == 2:
        y = st.bufs[op.inputs[1]][:, start:stop] + y
    st.bufs[op.outputs[0]][:, start:stop] = y


def _lm_head(st: _Step, op: Op, tile: int) -> None:
    start, stop = tiling.span(op, tile)
    n = rms_norm_ref(st.bufs[op.inputs[0]], st.w(op, "norm"), op.attrs["eps"])
    logits = F.linear(n, st.w(op, "weight")[start:stop])
    logits_buf, best_val, best_idx = (st.bufs[b] for b in op.outputs)
    logits_buf[:, start:stop] = logits
    best = logits.float().argmax(dim=-1)  # the first of equal maxima, as the sampler's argmax
    best_val[:, tile] = logits.float().gather(1, best[:, None])[:, 0]
    best_idx[:, tile] = best + start


def _argmax(st: _Step, op: Op, tile: int) -> None:
    vals, idx = (st.bufs[b] for b in op.inputs)
    st.bufs[op.outputs[0]][:, 0] = idx.gather(1, vals.argmax(dim=-1, keepdim=True))[:, 0]


RUN = {"embed": _embed, "qkv_rope": _qkv_rope, "attention": _attention, "attention_combine": _attention_combine,
       "glu": _glu, "linear": _linear, "lm_head": _lm_head, "argmax": _argmax}


@torch.no_grad()
def interpret(s: Schedule, params: Mapping[str, Tensor], batch: PackedBatch, kv_cache: Tensor,
              order_seed: int | None = None) -> tuple[Tensor, Tensor]:
    """(logits [S, V], greedy tokens [S]) of one decode step of ``batch`` run by schedule ``s``,
    writing this step's keys and values into ``kv_cache`` as the program does."""
    if not is_decode(batch, s.max_rows):
        raise ValueError(f"the megakernel runs decode steps of 1..{s.max_rows} sequences, one token each")
    st = _Step(s, params, batch, kv_cache)
    pick = random.Random(order_seed) if order_seed is not None else None
    head = [0] * s.num_sms
    counters = [0] * s.num_counters
    remaining = len(s.instructions)
    cols = st.cols
    while remaining:
        ready = [sm for sm, lst in enumerate(s.sms) if head[sm] < len(lst)
                 and all(counters[c] >= v for c, v in s.instructions[lst[head[sm]]].waits)]
        if not ready:
            raise ScheduleError("deadlock: no SM's next instruction can start")
        sm = pick.choice(ready) if pick else ready[0]
        index = s.sms[sm][head[sm]]
        ins = s.instructions[index]
        op = s.ops[ins.op]
        reads, writes = tiling.access(op, ins.tile, cols)
        st.check_reads(index, reads)
        RUN[op.kind](st, op, ins.tile)
        st.wrote(index, writes)
        for c in ins.bumps:
            counters[c] += 1
        head[sm] += 1
        remaining -= 1
    return st.bufs[s.logits], st.bufs[s.tokens][:, 0]
