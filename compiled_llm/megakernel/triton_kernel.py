"""The persistent megakernel: one Triton launch runs a whole decode step's schedule.

The grid is one program an SM (``schedule.num_sms``; every program must be resident at once,
so the runtime refuses a schedule made for more SMs than the GPU has). Program s walks its
instructions (encoding.py: ``sm_ranges[s]`` into one flat record array) in order, and for each:

  1. dispatches on the record's kind code; the kind issues the loads that wait for nothing (a
     weight tile's first chunk: weights never depend on this step), then
  2. spins on each wait until ``counter >= value`` (an atomic add of 0 with acquire semantics,
     so what the producing tiles wrote before their release bump is visible), then a CTA
     barrier, and runs the tile;
  3. CTA barrier (every thread's stores done), then adds 1 to each bump counter with release
     semantics.

Addresses. Each op has a row of int64 ``data_ptr``s (its weights and activation buffers), cast
in the kernel to typed pointers (``.to(tl.pointer_type(dtype), bitcast=True)``), which works
compiled and under TRITON_INTERPRET=1 (the interpreter keeps CPU tensors in place, so an address
taken on the host is the address it reads). This keeps one launch signature for every model:
no per-op pointer arguments, no base-tensor-plus-offset scheme. The KV cache and the step's
inputs (tokens, positions, slots, lengths, block tables) are ordinary arguments, since they are
the call's. The model dtype is the KV cache's element type.

Reads of what other SMs wrote this step (activations, the KV cache) use ``cache_modifier=".cg"``
(L2, not the SM's non-coherent L1), so they never see a stale L1 line whatever the acquire
does to L1; weights are loaded ``evict_first``. Pointers made from integers carry no alignment,
so when every weight is 16-byte aligned with rows of a multiple of 16 elements (``ALIGNED``,
checked by the encoding) the weight tiles are hinted so (``multiple_of``/``max_contiguous``, K
rewritten as ``K // 16 * 16``): their loads compile to 16-byte vectors (the sm_90 compile test
checks it); otherwise they are element loads.

Math. Each kind computes interpreter.py's math with fp32 accumulation and the reference's
rounding points: rms_norm's ``x * rstd`` rounded, times the weight rounded; a linear's sums
(+ bias) rounded, then + residual rounded; glu: gate and up rounded, act(gate) rounded, times
up rounded; q/k norm and RoPE in fp32 from the rounded projection, rounded once each; attention
split along the context (flash-decoding): each (head, split) tile's online softmax kept in fp32
as its partials (m, l, acc), which the head's combine tile rescales to their common max, sums
and rounds once; lm_head logits rounded and the tile's best taken on the
rounded values (first maximum). Rows are few (``ROWS``: the step's rows rounded up to a power
of two, a compile-time constant), so the products are FMA-and-reduce tiles in the style of
triton_gemv.py, no tl.dot. Each pass over x streams two weight sets as one [BLOCK_N, 2,
BLOCK_K / VEC, VEC] tile (``_gemv_pair``: gate and up, a q/k/v head's two rotary halves, or two
column chunks of a linear or the lm_head), a thread's VEC elements one 16-byte vector that it
sums itself each K step (as triton_gemv's one-row kernel does), the rest of the K sum once
after the loop (a reduction across threads every K step made o/down 2.4x slower). The stream
is software-pipelined: the next K chunk, or the next pass's first, is loaded before the current
one is used. A q/k/v head's halves are its weight rows [0, head_dim / 2) and [head_dim / 2,
head_dim), so the neox rotation pairs column h with h + head_dim / 2 without moving registers.
Attention runs one row at a time over its split's BLOCK_L keys a step, keys and values loaded a
step ahead; its split is tiling.split_span's own code, jitted here (``_split_span``).
"""

from __future__ import annotations

import types

import torch
import triton
import triton.language as tl

from compiled_llm.megakernel import encoding as E
from compiled_llm.megakernel import tiling

# the encoding's layout, as constants the jitted code can read
_NF = tl.constexpr(E.INS_FIELDS)
_NA = tl.constexpr(E.ADDR_SLOTS)
_NI = tl.constexpr(E.INT_SLOTS)
_NFL = tl.constexpr(E.FLOAT_SLOTS)
_A_WEIGHT, _A_BIAS, _A_NORM = tl.constexpr(E.A_WEIGHT), tl.constexpr(E.A_BIAS), tl.constexpr(E.A_NORM)
_A_Q_NORM, _A_K_NORM, _A_COS_SIN = tl.constexpr(E.A_Q_NORM), tl.constexpr(E.A_K_NORM), tl.constexpr(E.A_COS_SIN)
_A_IN0, _A_IN1 = tl.constexpr(E.A_IN0), tl.constexpr(E.A_IN1)
_A_OUT0, _A_OUT1, _A_OUT2 = tl.constexpr(E.A_OUT0), tl.constexpr(E.A_OUT1), tl.constexpr(E.A_OUT2)
_I_K, _I_N, _I_HEADS, _I_KV_HEADS = tl.constexpr(E.I_K), tl.constexpr(E.I_N), tl.constexpr(E.I_HEADS), tl.constexpr(E.I_KV_HEADS)
_I_HEAD_DIM, _I_LAYER, _I_WINDOW = tl.constexpr(E.I_HEAD_DIM), tl.constexpr(E.I_LAYER), tl.constexpr(E.I_WINDOW)
_I_ACTIVATION, _I_HAS_BIAS = tl.constexpr(E.I_ACTIVATION), tl.constexpr(E.I_HAS_BIAS)
_I_HAS_RESIDUAL, _I_HAS_NORM = tl.constexpr(E.I_HAS_RESIDUAL), tl.constexpr(E.I_HAS_NORM)
_I_HAS_Q_NORM, _I_HAS_K_NORM = tl.constexpr(E.I_HAS_Q_NORM), tl.constexpr(E.I_HAS_K_NORM)
_I_HAS_ROPE, _I_TILES, _I_SPLITS = tl.constexpr(E.I_HAS_ROPE), tl.constexpr(E.I_TILES), tl.constexpr(E.I_SPLITS)
_F_EPS, _F_NORM_EPS, _F_SCALE, _F_SOFTCAP = (tl.constexpr(E.F_EPS), tl.constexpr(E.F_NORM_EPS),
                                            tl.constexpr(E.F_SCALE), tl.constexpr(E.F_SOFTCAP))
_K_EMBED, _K_QKV, _K_ATTN, _K_COMBINE, _K_GLU, _K_LINEAR, _K_LM_HEAD, _K_ARGMAX = (
    tl.constexpr(E.KIND_CODES[k]) for k in ("embed", "qkv_rope", "attention", "attention_combine", "glu", "linear",
                                            "lm_head", "argmax"))
# the combine holds every split of a head in one block (the check refuses more splits)
_BLOCK_C = tl.constexpr(tiling.MAX_SPLITS)
# the partition of a head's context into splits: tiling.split_span's code, so the interpreter and
# the kernel cannot disagree on it, jitted with this module's globals (the Triton interpreter
# finds triton.language through the function's globals, and tiling does not import Triton)
_split_span = triton.jit(types.FunctionType(tiling.split_span.__code__, globals()))
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


# ---------------------------------------------------------------------------------------------
# building blocks
# ---------------------------------------------------------------------------------------------


@triton.jit
def _ptr(op_addr, op, slot, DT: tl.constexpr):
    """Op ``op``'s address ``slot`` as a pointer to DT."""
    return tl.load(op_addr + op * _NA + slot).to(tl.pointer_type(DT), bitcast=True)


@triton.jit
def _round(x, DT: tl.constexpr):
    return x.to(DT).to(tl.float32)


@triton.jit
def _rstd(x_ptr, K, eps, S, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """[ROWS] fp32: 1 / sqrt(mean(x^2) + eps) of each of the first S rows of x [*, K]. A row at a
    time on a 1-D chunk, so no index tensor changes layout inside the loop."""
    sel = tl.arange(0, ROWS)
    ss = tl.zeros([ROWS], tl.float32)
    for t in tl.static_range(ROWS):
        acc = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * K + ks, mask=ks < tl.where(t < S, K, 0), other=0.0,  # rows past S: none
                        cache_modifier=".cg").to(tl.float32)
            acc += x * x
        ss = tl.where(sel == t, tl.sum(acc, 0), ss)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def _globaltimer():
    """The GPU's nanosecond clock (``%globaltimer``: one clock for every SM)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _w_chunk(w_ptr, rows0, rows1, mask0, mask1, k0, K, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
             ALIGNED: tl.constexpr):
    """Columns [k0, k0 + BLOCK_K) of weight rows ``rows0`` and of ``rows1`` (``mask0``/``mask1``:
    which exist) of w [*, K], as one [BLOCK_N, 2, BLOCK_K / VEC, VEC] tile: a thread's VEC
    elements are one 16-byte vector along K."""
    KC: tl.constexpr = BLOCK_K // VEC
    which = tl.arange(0, 2)[None, :]
    w_row = tl.where(which == 0, rows0[:, None], rows1[:, None]).to(tl.int64)  # [BLOCK_N, 2]
    w_mask = tl.where(which == 0, mask0[:, None], mask1[:, None])
    ks = k0 + tl.arange(0, KC)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [KC, VEC]
    ptrs = w_ptr + w_row[:, :, None, None] * K + ks[None, None, :, :]
    if ALIGNED:  # rows start 16-byte aligned (the encoding checked): whole-vector loads
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, [1, 1, 1, 16]), [1, 1, 1, VEC])
    return tl.load(ptrs, mask=w_mask[:, :, None, None] & (ks < K)[None, None, :, :], other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _row_of(v, t, ROWS: tl.constexpr):
    """Element ``t`` (a compile-time row) of the [ROWS] vector ``v``."""
    return tl.sum(tl.where(tl.arange(0, ROWS) == t, v, 0.0), 0)


@triton.jit
def _gemv_pair(x_ptr, nw_ptr, has_norm, rstd, w_ptr, w, rows0, rows1, mask0, mask1, next0, next1, nmask0, nmask1,
               K, S, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
               DT: tl.constexpr, ALIGNED: tl.constexpr):
    """Two [ROWS, BLOCK_N] fp32 products in one pass over x: x (rms-normed with ``rstd`` and
    weight ``nw_ptr`` when has_norm, rounded as rms_norm_ref rounds) times weight rows ``rows0``
    and times weight rows ``rows1`` of w [*, K] (``mask0``/``mask1``: which exist); rows of x at
    and past S are 0. The two row sets are one weight tile a K step (gate and up, a head's two
    rotary halves, or two column chunks of one tile), so x is read and normed once for both.

    Software-pipelined: ``w`` is these rows' first K chunk, already loaded (the caller loads the
    first before it waits for x, since weights never wait), and every step loads the next chunk
    before it uses the current one, the last step the first chunk of rows ``next0``/``next1``
    (the tile's next pass; ``nmask*`` all false: none), which is returned with the products.

    Every product keeps the weight tile's layout: each row of x is broadcast onto the tile
    ([1, 1, KC, VEC]) and its product summed over the thread's own VEC elements into a
    [BLOCK_N, 2, KC, ROWS] accumulator (rows on the last axis, selected with a where, as
    triton_gemv's int4 steps do). A rows axis in front of the tile would make every step move
    the whole tile through shared memory into the product's layout. ``K`` is the caller's, which
    with ALIGNED it has already written as ``K // 16 * 16`` (for whole-vector masks)."""
    KC: tl.constexpr = BLOCK_K // VEC
    at_row = tl.arange(0, ROWS)[None, None, None, :]
    acc = tl.zeros([BLOCK_N, 2, KC, ROWS], tl.float32)  # a thread's vector summed each step, K at the end
    for k0 in range(0, K, BLOCK_K):
        last = k0 + BLOCK_K >= K
        w_next = _w_chunk(w_ptr, tl.where(last, next0, rows0), tl.where(last, next1, rows1),
                          tl.where(last, nmask0, mask0), tl.where(last, nmask1, mask1),
                          tl.where(last, 0, k0 + BLOCK_K), K, BLOCK_K, VEC, ALIGNED)
        ks = k0 + tl.arange(0, KC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
        wf = w.to(tl.float32)
        nw = tl.load(nw_ptr + ks, mask=ks < tl.where(has_norm, K, 0), other=0.0).to(tl.float32)
        for t in tl.static_range(ROWS):
            x = tl.load(x_ptr + t * K + ks, mask=ks < tl.where(t < S, K, 0), other=0.0,  # rows past S: none
                        cache_modifier=".cg").to(tl.float32)
            if has_norm:
                x = _round(_round(x * _row_of(rstd, t, ROWS), DT) * nw, DT)
            part = tl.sum(wf * x[None, None, :, :], 3, keep_dims=True)
            acc = tl.where(at_row == t, acc + part, acc)
        w = w_next
    y0, y1 = tl.split(tl.permute(tl.sum(acc, 2), (2, 0, 1)))  # [ROWS, BLOCK_N, 2] -> two [ROWS, BLOCK_N]
    return y0, y1, w


@triton.jit
def _wait(wait_counters, wait_values, counters, w0, nw, stamps, i, TIMED: tl.constexpr):
    """Spin until each of instruction ``i``'s counters reaches its value (an atomic add of 0 with
    acquire semantics, so what the producing tiles wrote before their release bump is visible),
    then a CTA barrier (which orders every thread's later reads after every thread's acquire);
    TIMED, stamp when it ran (``stamps[i, 1]``). Up to 8 counters are polled at once, one
    atomic a thread: a tile that waits for 3 (an attention head's q, k and v) or 8 tiles pays
    one round trip to L2 when they are done, not one each."""
    for j0 in range(w0, w0 + nw, 8):
        js = j0 + tl.arange(0, 8)
        m = js < w0 + nw
        cs = tl.load(wait_counters + js, mask=m, other=0)
        want = tl.load(wait_values + js, mask=m, other=0)
        pending = 1
        while pending > 0:  # a scalar carried, not the tensor: Triton 3.6 fails to compile the latter
            seen = tl.atomic_add(counters + cs, tl.zeros_like(cs), mask=m, sem="acquire")
            pending = tl.max(tl.where(m & (seen < want), 1, 0), 0)
    tl.debug_barrier()
    if TIMED:
        tl.store(stamps + 3 * i + 1, _globaltimer())


@triton.jit
def _tanh(z):
    return 2.0 * tl.sigmoid(2.0 * z) - 1.0


# ---------------------------------------------------------------------------------------------
# the kinds
# ---------------------------------------------------------------------------------------------


@triton.jit
def _embed(op_addr, op_int, op, c0, c1, token_ids, S, wait_counters, wait_values, counters, w0, nw, stamps, i,
           ROWS: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr, TIMED: tl.constexpr):
    _wait(wait_counters, wait_values, counters, w0, nw, stamps, i, TIMED)
    w_ptr = _ptr(op_addr, op, _A_WEIGHT, DT)
    out_ptr = _ptr(op_addr, op, _A_OUT0, DT)
    K = tl.load(op_int + op * _NI + _I_K)
    N = tl.load(op_int + op * _NI + _I_N)
    rows = tl.arange(0, ROWS)
    rmask = rows < S
    tok = tl.load(token_ids + rows, mask=rmask, other=0).to(tl.int64)
    for n0 in range(c0, c1, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        m = rmask[:, None] & (cols < c1)[None, :]
        v = tl.load(w_ptr + tok[:, None] * K + cols[None, :], mask=m, other=0.0)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], v, mask=m)


@triton.jit
def _qkv_rope(op_addr, op_int, op_flt, op, tile, c0, positions, slot_mapping, kv_ptr, kv_layer_stride,
              kv_half_stride, S,
              wait_counters, wait_values, counters, w0, nw, stamps, i, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, VEC: tl.constexpr, DT: tl.constexpr,
              ALIGNED: tl.constexpr, TIMED: tl.constexpr):
    base = op_int + op * _NI
    K = tl.load(base + _I_K)
    if ALIGNED:
        K = K // 16 * 16
    nh = tl.load(base + _I_HEADS)
    nkv = tl.load(base + _I_KV_HEADS)
    hd = tl.load(base + _I_HEAD_DIM)
    half = hd // 2
    x_ptr = _ptr(op_addr, op, _A_IN0, DT)
    w_ptr = _ptr(op_addr, op, _A_WEIGHT, DT)
    nw_ptr = _ptr(op_addr, op, _A_NORM, DT)
    has_norm = tl.load(base + _I_HAS_NORM) != 0
    hs = tl.arange(0, BLOCK_H)
    hmask = hs < half
    w = _w_chunk(w_ptr, c0 + hs, c0 + half + hs, hmask, hmask, 0, K, BLOCK_KH, VEC, ALIGNED)  # before the wait
    _wait(wait_counters, wait_values, counters, w0, nw, stamps, i, TIMED)
    rstd = tl.zeros([ROWS], tl.float32)
    if has_norm:
        rstd = _rstd(x_ptr, K, tl.load(op_flt + op * _NFL + _F_NORM_EPS), S, ROWS, BLOCK_K)
    y1, y2, w = _gemv_pair(x_ptr, nw_ptr, has_norm, rstd, w_ptr, w, c0 + hs, c0 + half + hs, hmask, hmask, hs, hs,
                           hs < 0, hs < 0, K, S, ROWS, BLOCK_H, BLOCK_KH, VEC, DT, ALIGNED)
    if tl.load(base + _I_HAS_BIAS) != 0:
        b_ptr = _ptr(op_addr, op, _A_BIAS, DT)
        y1 += tl.load(b_ptr + c0 + hs, mask=hmask, other=0.0).to(tl.float32)[None, :]
        y2 += tl.load(b_ptr + c0 + half + hs, mask=hmask, other=0.0).to(tl.float32)[None, :]
    y1 = _round(y1, DT)
    y2 = _round(y2, DT)
    # which part: 0 q, 1 k, 2 v; and its head
    part = (tile >= nh).to(tl.int32) + (tile >= nh + nkv).to(tl.int32)
    head = tile - nh * (part >= 1).to(tl.int32) - nkv * (part == 2).to(tl.int32)
    has_head_norm = ((part == 0) & (tl.load(base + _I_HAS_Q_NORM) != 0)) | \
                    ((part == 1) & (tl.load(base + _I_HAS_K_NORM) != 0))
    if has_head_norm:
        slot = tl.where(part == 1, _A_K_NORM, _A_Q_NORM)
        hn_ptr = tl.load(op_addr + op * _NA + slot).to(tl.pointer_type(DT), bitcast=True)
        hstd = tl.rsqrt((tl.sum(y1 * y1, 1) + tl.sum(y2 * y2, 1)) / hd + tl.load(op_flt + op * _NFL + _F_EPS))
        g1 = tl.load(hn_ptr + hs, mask=hmask, other=0.0).to(tl.float32)
        g2 = tl.load(hn_ptr + half + hs, mask=hmask, other=0.0).to(tl.float32)
        y1 = _round(_round(y1 * hstd[:, None], DT) * g1[None, :], DT)
        y2 = _round(_round(y2 * hstd[:, None], DT) * g2[None, :], DT)
    rows = tl.arange(0, ROWS)
    rmask = rows < S
    if (part != 2) & (tl.load(base + _I_HAS_ROPE) != 0):
        cs_ptr = _ptr(op_addr, op, _A_COS_SIN, tl.float32)
        pos = tl.load(positions + rows, mask=rmask, other=0).to(tl.int64)
        cs_rows = cs_ptr + pos[:, None] * hd + hs[None, :]
        m = rmask[:, None] & hmask[None, :]
        cos = tl.load(cs_rows, mask=m, other=0.0)
        sin = tl.load(cs_rows + half, mask=m, other=0.0)
        r1 = y1 * cos - y2 * sin
        r2 = y2 * cos + y1 * sin
        y1 = _round(r1, DT)
        y2 = _round(r2, DT)
    if part == 0:
        q_ptr = _ptr(op_addr, op, _A_OUT0, DT)
        at = q_ptr + rows[:, None] * (nh * hd) + head * hd + hs[None, :]
        m = rmask[:, None] & hmask[None, :]
        tl.store(at, y1.to(DT), mask=m)
        tl.store(at + half, y2.to(DT), mask=m)
    else:
        slots = tl.load(slot_mapping + rows, mask=rmask, other=-1).to(tl.int64)
        layer = tl.load(base + _I_LAYER).to(tl.int64)
        cache = kv_ptr + layer * kv_layer_stride + (part == 2).to(tl.int64) * kv_half_stride
        at = cache + slots[:, None] * (nkv * hd) + head * hd + hs[None, :]
        m = (rmask & (slots >= 0))[:, None] & hmask[None, :]
        tl.store(at, y1.to(DT), mask=m)
        tl.store(at + half, y2.to(DT), mask=m)


@triton.jit
def _kv_chunk(k_cache, v_cache, blk, ps, ctx, block_size, row_stride, ds, dmask):
    """The keys and values of positions ``ps`` (those before ``ctx``), whose cache blocks are
    ``blk``."""
    slots = blk * block_size + ps % block_size
    at = slots[:, None] * row_stride + ds[None, :]
    m = (ps < ctx)[:, None] & dmask[None, :]
    k = tl.load(k_cache + at, mask=m, other=0.0, cache_modifier=".cg")
    v = tl.load(v_cache + at, mask=m, other=0.0, cache_modifier=".cg")
    return k, v


@triton.jit
def _blocks(bt_row, ps, ctx, block_size):
    return tl.load(bt_row + ps // block_size, mask=ps < ctx, other=0).to(tl.int64)


@triton.jit
def _attention(op_addr, op_int, op_flt, op, tile, seq_lens, block_tables, bt_stride, kv_ptr, kv_layer_stride,
               kv_half_stride, block_size, S,
               wait_counters, wait_values, counters, w0, nw, stamps, i, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
               DT: tl.constexpr, TIMED: tl.constexpr):
    """One query head over one split of each row's context (tile = head * splits + split), rows
    one after another, BLOCK_L keys a step, software-pipelined: a step's keys and values are
    loaded one step ahead and their block-table entries two steps ahead, so a step's arithmetic
    never waits on a load issued in that step. Stores the split's m, l and acc (fp32) into its
    head_dim + 2 columns of the partial buffer; an empty split stores (-1e30, 0, 0)."""
    base = op_int + op * _NI
    nh = tl.load(base + _I_HEADS)
    nkv = tl.load(base + _I_KV_HEADS)
    hd = tl.load(base + _I_HEAD_DIM)
    window = tl.load(base + _I_WINDOW)
    splits = tl.load(base + _I_SPLITS)
    scale = tl.load(op_flt + op * _NFL + _F_SCALE)
    softcap = tl.load(op_flt + op * _NFL + _F_SOFTCAP)
    head = tile // splits
    split = tile % splits
    g = head // (nh // nkv)
    q_ptr = _ptr(op_addr, op, _A_IN0, DT)
    p_ptr = _ptr(op_addr, op, _A_OUT0, tl.float32)
    p_row = nh * splits * (hd + 2)  # a row of the partial buffer
    layer = tl.load(base + _I_LAYER).to(tl.int64)
    k_cache = kv_ptr + layer * kv_layer_stride + g * hd
    v_cache = k_cache + kv_half_stride
    ds = tl.arange(0, BLOCK_D)
    dmask = ds < hd
    ls = tl.arange(0, BLOCK_L)
    _wait(wait_counters, wait_values, counters, w0, nw, stamps, i, TIMED)
    for r in range(0, S):
        ctx = tl.load(seq_lens + r)
        lo, hi = _split_span(ctx, window, splits, split)
        bt_row = block_tables + r * bt_stride
        q = tl.load(q_ptr + r * (nh * hd) + head * hd + ds, mask=dmask, other=0.0, cache_modifier=".cg")
        q = q.to(tl.float32)
        k, v = _kv_chunk(k_cache, v_cache, _blocks(bt_row, lo + ls, hi, block_size), lo + ls, hi, block_size,
                         nkv * hd, ds, dmask)
        blk_next = _blocks(bt_row, lo + BLOCK_L + ls, hi, block_size)
        m_i = tl.full([], -1.0e30, tl.float32)
        l_i = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for p0 in range(lo, hi, BLOCK_L):
            ps = p0 + ls
            k_next, v_next = _kv_chunk(k_cache, v_cache, blk_next, ps + BLOCK_L, hi, block_size, nkv * hd, ds, dmask)
            blk_next = _blocks(bt_row, ps + 2 * BLOCK_L, hi, block_size)
            s = tl.sum(q[None, :] * k.to(tl.float32), 1) * scale
            if softcap > 0:
                s = _tanh(s / softcap) * softcap
            s = tl.where(ps < hi, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new
            k = k_next
            v = v_next
        at = p_ptr + r * p_row + tile * (hd + 2)
        tl.store(at, m_i)
        tl.store(at + 1, l_i)
        tl.store(at + 2 + ds, acc, mask=dmask)


@triton.jit
def _attention_combine(op_addr, op_int, op, tile, S, wait_counters, wait_values, counters, w0, nw, stamps, i,
                       BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, DT: tl.constexpr, TIMED: tl.constexpr):
    """Head ``tile``'s attention output from its splits' partials (other SMs wrote them: .cg
    loads): M = max m, w = exp(m - M), out = sum w acc / sum w l, rounded once; 0 where the
    denominator is 0 (a padding row). Lanes past the splits read m = -inf, so weigh 0."""
    _wait(wait_counters, wait_values, counters, w0, nw, stamps, i, TIMED)
    base = op_int + op * _NI
    nh = tl.load(base + _I_HEADS)
    hd = tl.load(base + _I_HEAD_DIM)
    splits = tl.load(base + _I_SPLITS)
    p_ptr = _ptr(op_addr, op, _A_IN0, tl.float32)
    o_ptr = _ptr(op_addr, op, _A_OUT0, DT)
    cs = tl.arange(0, BLOCK_C)
    cmask = cs < splits
    ds = tl.arange(0, BLOCK_D)
    dmask = ds < hd
    for r in range(0, S):
        at = p_ptr + r * (nh * splits * (hd + 2)) + (tile * splits + cs) * (hd + 2)
        m = tl.load(at, mask=cmask, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(at + 1, mask=cmask, other=0.0, cache_modifier=".cg")
        acc = tl.load(at[:, None] + 2 + ds[None, :], mask=cmask[:, None] & dmask[None, :], other=0.0,
                      cache_modifier=".cg")
        w = tl.exp(m - tl.max(m, 0))
        den = tl.sum(w * l, 0)
        out = tl.where(den > 0, tl.sum(w[:, None] * acc, 0) / tl.maximum(den, 1e-30), 0.0)
        tl.store(o_ptr + r * (nh * hd) + tile * hd + ds, out.to(DT), mask=dmask)


@triton.jit
def _glu(op_addr, op_int, op_flt, op, c0, c1, S,
         wait_counters, wait_values, counters, w0, nw, stamps, i, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
         BLOCK_K: tl.constexpr, VEC: tl.constexpr, DT: tl.constexpr, ALIGNED: tl.constexpr, TIMED: tl.constexpr):
    base = op_int + op * _NI
    K = tl.load(base + _I_K)
    if ALIGNED:
        K = K // 16 * 16
    inter = tl.load(base + _I_N)
    gelu = tl.load(base + _I_ACTIVATION) == 1
    x_ptr = _ptr(op_addr, op, _A_IN0, DT)
    w_ptr = _ptr(op_addr, op, _A_WEIGHT, DT)
    nw_ptr = _ptr(op_addr, op, _A_NORM, DT)
    out_ptr = _ptr(op_addr, op, _A_OUT0, DT)
    rows = tl.arange(0, ROWS)
    first = c0 + tl.arange(0, BLOCK_N)
    w = _w_chunk(w_ptr, first, inter + first, first < c1, first < c1, 0, K, BLOCK_K, VEC, ALIGNED)  # before the wait
    _wait(wait_counters, wait_values, counters, w0, nw, stamps, i, TIMED)
    rstd = _rstd(x_ptr, K, tl.load(op_flt + op * _NFL + _F_EPS), S, ROWS, BLOCK_K)
    for n0 in range(c0, c1, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cmask = cols < c1
        nxt = cols + BLOCK_N
        gate, up, w = _gemv_pair(x_ptr, nw_ptr, True, rstd, w_ptr, w, cols, inter + cols, cmask, cmask, nxt,
                                 inter + nxt, nxt < c1, nxt < c1, K, S, ROWS, BLOCK_N, BLOCK_K, VEC, DT, ALIGNED)
        gate = _round(gate, DT)
        up = _round(up, DT)
        if gelu:
            a = 0.5 * gate * (1.0 + _tanh(_SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)))
        else:
            a = gate * tl.sigmoid(gate)
        h = _round(a, DT) * up
        tl.store(out_ptr + rows[:, None] * inter + cols[None, :], h.to(DT), mask=(rows < S)[:, None] & cmask[None, :])


@triton.jit
def _linear_out(y, cols, cmask, op_addr, op, N, has_bias, has_residual, S, ROWS: tl.constexpr, DT: tl.constexpr):
    """Store one column chunk of a linear: + bias, rounded, + residual, rounded."""
    rows = tl.arange(0, ROWS)
    m = (rows < S)[:, None] & cmask[None, :]
    if has_bias:
        b_ptr = _ptr(op_addr, op, _A_BIAS, DT)
        y += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    y = _round(y, DT)
    if has_residual:
        r_ptr = _ptr(op_addr, op, _A_IN1, DT)
        y += tl.load(r_ptr + rows[:, None] * N + cols[None, :], mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    out_ptr = _ptr(op_addr, op, _A_OUT0, DT)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], y.to(DT), mask=m)


@triton.jit
def _linear(op_addr, op_int, op, c0, c1, S,
            wait_counters, wait_values, counters, w0, nw, stamps, i, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, VEC: tl.constexpr, DT: tl.constexpr, ALIGNED: tl.constexpr, TIMED: tl.constexpr):
    base = op_int + op * _NI
    K = tl.load(base + _I_K)
    if ALIGNED:
        K = K // 16 * 16
    N = tl.load(base + _I_N)
    x_ptr = _ptr(op_addr, op, _A_IN0, DT)
    w_ptr = _ptr(op_addr, op, _A_WEIGHT, DT)
    has_bias = tl.load(base + _I_HAS_BIAS) != 0
    has_residual = tl.load(base + _I_HAS_RESIDUAL) != 0
    rstd = tl.zeros([ROWS], tl.float32)
    first = c0 + tl.arange(0, BLOCK_N)
    w = _w_chunk(w_ptr, first, first + BLOCK_N, first < c1, first + BLOCK_N < c1, 0, K, BLOCK_K, VEC,
                 ALIGNED)  # before the wait
    _wait(wait_counters, wait_values, counters, w0, nw, stamps, i, TIMED)
    for n0 in range(c0, c1, 2 * BLOCK_N):  # two column chunks a pass
        cols0 = n0 + tl.arange(0, BLOCK_N)
        cols1 = cols0 + BLOCK_N
        nxt0 = cols0 + 2 * BLOCK_N
        nxt1 = cols1 + 2 * BLOCK_N
        y0, y1, w = _gemv_pair(x_ptr, x_ptr, False, rstd, w_ptr, w, cols0, cols1, cols0 < c1, cols1 < c1, nxt0, nxt1,
                               nxt0 < c1, nxt1 < c1, K, S, ROWS, BLOCK_N, BLOCK_K, VEC, DT, ALIGNED)
        _linear_out(y0, cols0, cols0 < c1, op_addr, op, N, has_bias, has_residual, S, ROWS, DT)
        _linear_out(y1, cols1, cols1 < c1, op_addr, op, N, has_bias, has_residual, S, ROWS, DT)


@triton.jit
def _logits_out(y, cols, cmask, out_ptr, N, best_val, best_idx, S, ROWS: tl.constexpr, DT: tl.constexpr):
    """Store one column chunk of logits (rounded) and fold it into the running (first) maximum."""
    rows = tl.arange(0, ROWS)
    logits = _round(y, DT)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], logits.to(DT), mask=(rows < S)[:, None] & cmask[None, :])
    vals = tl.where(cmask[None, :], logits, float("-inf"))
    chunk_val = tl.max(vals, 1)
    chunk_idx = tl.argmax(vals, 1, tie_break_left=True).to(tl.int64) + tl.min(cols, 0)
    better = chunk_val > best_val  # strict: an earlier chunk keeps a tie
    return tl.where(better, chunk_val, best_val), tl.where(better, chunk_idx, best_idx)


@triton.jit
def _lm_head(op_addr, op_int, op_flt, op, tile, c0, c1, S,
             wait_counters, wait_values, counters, w0, nw, stamps, i, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, VEC: tl.constexpr, DT: tl.constexpr, ALIGNED: tl.constexpr, TIMED: tl.constexpr):
    base = op_int + op * _NI
    K = tl.load(base + _I_K)
    if ALIGNED:
        K = K // 16 * 16
    N = tl.load(base + _I_N)
    tiles = tl.load(base + _I_TILES)
    x_ptr = _ptr(op_addr, op, _A_IN0, DT)
    w_ptr = _ptr(op_addr, op, _A_WEIGHT, DT)
    nw_ptr = _ptr(op_addr, op, _A_NORM, DT)
    out_ptr = _ptr(op_addr, op, _A_OUT0, DT)
    first = c0 + tl.arange(0, BLOCK_N)
    w = _w_chunk(w_ptr, first, first + BLOCK_N, first < c1, first + BLOCK_N < c1, 0, K, BLOCK_K, VEC,
                 ALIGNED)  # before the wait
    _wait(wait_counters, wait_values, counters, w0, nw, stamps, i, TIMED)
    rstd = _rstd(x_ptr, K, tl.load(op_flt + op * _NFL + _F_EPS), S, ROWS, BLOCK_K)
    rows = tl.arange(0, ROWS)
    rmask = rows < S
    best_val = tl.full([ROWS], float("-inf"), tl.float32)
    best_idx = tl.full([ROWS], 0, tl.int64) + c0
    for n0 in range(c0, c1, 2 * BLOCK_N):  # two column chunks a pass, the first folded in first
        cols0 = n0 + tl.arange(0, BLOCK_N)
        cols1 = cols0 + BLOCK_N
        nxt0 = cols0 + 2 * BLOCK_N
        nxt1 = cols1 + 2 * BLOCK_N
        y0, y1, w = _gemv_pair(x_ptr, nw_ptr, True, rstd, w_ptr, w, cols0, cols1, cols0 < c1, cols1 < c1, nxt0, nxt1,
                               nxt0 < c1, nxt1 < c1, K, S, ROWS, BLOCK_N, BLOCK_K, VEC, DT, ALIGNED)
        best_val, best_idx = _logits_out(y0, cols0, cols0 < c1, out_ptr, N, best_val, best_idx, S, ROWS, DT)
        best_val, best_idx = _logits_out(y1, cols1, cols1 < c1, out_ptr, N, best_val, best_idx, S, ROWS, DT)
    bv_ptr = _ptr(op_addr, op, _A_OUT1, tl.float32)
    bi_ptr = _ptr(op_addr, op, _A_OUT2, tl.int64)
    tl.store(bv_ptr + rows * tiles + tile, best_val, mask=rmask)
    tl.store(bi_ptr + rows * tiles + tile, best_idx, mask=rmask)


@triton.jit
def _argmax(op_addr, op_int, op, S,
            wait_counters, wait_values, counters, w0, nw, stamps, i,
            ROWS: tl.constexpr, BLOCK_V: tl.constexpr, TIMED: tl.constexpr):
    _wait(wait_counters, wait_values, counters, w0, nw, stamps, i, TIMED)
    tiles = tl.load(op_int + op * _NI + _I_TILES)
    bv_ptr = _ptr(op_addr, op, _A_IN0, tl.float32)
    bi_ptr = _ptr(op_addr, op, _A_IN1, tl.int64)
    out_ptr = _ptr(op_addr, op, _A_OUT0, tl.int64)
    rows = tl.arange(0, ROWS)
    rmask = rows < S
    ts = tl.arange(0, BLOCK_V)
    m = rmask[:, None] & (ts < tiles)[None, :]
    vals = tl.load(bv_ptr + rows[:, None] * tiles + ts[None, :], mask=m, other=float("-inf"), cache_modifier=".cg")
    best = tl.argmax(vals, 1, tie_break_left=True)
    tok = tl.load(bi_ptr + rows * tiles + best, mask=rmask, other=0, cache_modifier=".cg")
    tl.store(out_ptr + rows, tok, mask=rmask)


# ---------------------------------------------------------------------------------------------
# the persistent kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _prefetch_l2(prefetch, i, NUM_THREADS: tl.constexpr, PREFETCH_CHUNK: tl.constexpr):
    """Ask for instruction ``i``'s weight ranges (encoding.weight_ranges) to be brought into L2
    (``cp.async.bulk.prefetch.L2``: the copy engine fetches them, no register or thread waits),
    each range cut into requests of PREFETCH_CHUNK bytes (more where the CTA's threads would not
    cover it), one a thread."""
    t = tl.arange(0, NUM_THREADS).to(tl.int64)
    for r in tl.static_range(2):
        addr = tl.load(prefetch + 4 * i + 2 * r)
        nbytes = tl.load(prefetch + 4 * i + 2 * r + 1)
        chunk = tl.maximum((nbytes + 16 * NUM_THREADS - 1) // (16 * NUM_THREADS) * 16, PREFETCH_CHUNK)
        size = tl.minimum(tl.maximum(nbytes - t * chunk, 0), chunk).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addr + t * chunk, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def megakernel(sm_ranges, instructions, wait_counters, wait_values, bump_counters, counters,
               op_addr, op_int, op_flt, prefetch,
               token_ids, positions, slot_mapping, seq_lens, block_tables, bt_stride,
               kv_ptr, kv_layer_stride, kv_half_stride, block_size, S, stamps,
               ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_NL: tl.constexpr,
               BLOCK_KL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_L: tl.constexpr, BLOCK_V: tl.constexpr,
               VEC: tl.constexpr, ALIGNED: tl.constexpr, PREFETCH: tl.constexpr, NUM_THREADS: tl.constexpr,
               PREFETCH_CHUNK: tl.constexpr = 16384, TIMED: tl.constexpr = False):
    """``TIMED``: each instruction writes when it began waiting, began running and ended
    (``stamps[flat index] = (wait, run, end)``, ns of %globaltimer), for the measured timeline
    (``timeline.measured``); off, the kernel is the same code without the clock reads. Each
    kind waits for its counters itself (``_wait``), after it has issued the loads that need no
    counter: a weight tile's first chunk. ``PREFETCH`` (compiled, aligned weights): before waiting
    for instruction i, the SM asks for instruction i + 1's weights into L2, so HBM streams them
    while the SM waits and computes (off by default: measured slower so far, NOTES.md)."""
    DT: tl.constexpr = kv_ptr.dtype.element_ty
    sm = tl.program_id(0)
    first = tl.load(sm_ranges + 2 * sm)
    last = tl.load(sm_ranges + 2 * sm + 1)
    if PREFETCH:
        if first < last:
            _prefetch_l2(prefetch, first, NUM_THREADS, PREFETCH_CHUNK)
    for i in range(first, last):
        if PREFETCH:
            if i + 1 < last:
                _prefetch_l2(prefetch, i + 1, NUM_THREADS, PREFETCH_CHUNK)
        rec = instructions + i * _NF
        kind = tl.load(rec + 0)
        op = tl.load(rec + 1)
        tile = tl.load(rec + 2)
        c0 = tl.load(rec + 3)
        c1 = tl.load(rec + 4)
        w0 = tl.load(rec + 5)
        nw = tl.load(rec + 6)
        b0 = tl.load(rec + 7)
        nb = tl.load(rec + 8)
        if TIMED:
            tl.store(stamps + 3 * i, _globaltimer())
        if kind == _K_EMBED:
            _embed(op_addr, op_int, op, c0, c1, token_ids, S,
                   wait_counters, wait_values, counters, w0, nw, stamps, i, ROWS, BLOCK_N, DT, TIMED)
        elif kind == _K_QKV:
            _qkv_rope(op_addr, op_int, op_flt, op, tile, c0, positions, slot_mapping, kv_ptr, kv_layer_stride,
                      kv_half_stride, S,
                      wait_counters, wait_values, counters, w0, nw, stamps, i,
                      ROWS, BLOCK_K, BLOCK_H, BLOCK_KH, VEC, DT, ALIGNED, TIMED)
        elif kind == _K_ATTN:
            _attention(op_addr, op_int, op_flt, op, tile, seq_lens, block_tables, bt_stride, kv_ptr, kv_layer_stride,
                       kv_half_stride, block_size, S,
                       wait_counters, wait_values, counters, w0, nw, stamps, i, BLOCK_D, BLOCK_L, DT, TIMED)
        elif kind == _K_COMBINE:
            _attention_combine(op_addr, op_int, op, tile, S, wait_counters, wait_values, counters, w0, nw, stamps, i,
                               BLOCK_D, _BLOCK_C, DT, TIMED)
        elif kind == _K_GLU:
            _glu(op_addr, op_int, op_flt, op, c0, c1, S,
                 wait_counters, wait_values, counters, w0, nw, stamps, i,
                 ROWS, BLOCK_N, BLOCK_K, VEC, DT, ALIGNED, TIMED)
        elif kind == _K_LINEAR:
            _linear(op_addr, op_int, op, c0, c1, S,
                    wait_counters, wait_values, counters, w0, nw, stamps, i,
                    ROWS, BLOCK_NL, BLOCK_KL, VEC, DT, ALIGNED, TIMED)
        elif kind == _K_LM_HEAD:
            _lm_head(op_addr, op_int, op_flt, op, tile, c0, c1, S,
                     wait_counters, wait_values, counters, w0, nw, stamps, i, ROWS, BLOCK_NL, BLOCK_KL, VEC, DT,
                     ALIGNED, TIMED)
        elif kind == _K_ARGMAX:
            _argmax(op_addr, op_int, op, S,
                    wait_counters, wait_values, counters, w0, nw, stamps, i, ROWS, BLOCK_V, TIMED)
        tl.debug_barrier()
        if TIMED:
            tl.store(stamps + 3 * i + 2, _globaltimer())
        for j in range(b0, b0 + nb):
            tl.atomic_add(counters + tl.load(bump_counters + j), 1, sem="release")


def block_sizes(rows: int, enc: E.Encoded, num_warps: int = 8, prefetch: bool = False, itemsize: int = 2) -> dict:
    """The kernel's compile-time sizes for a step of ``rows`` rows. A GEMV step streams a [rows, 2, K
    block] weight tile of up to 16K elements (32 KB in bf16, 64 a thread at 8 warps, and as many
    again for the next step's; fewer at more rows, whose accumulators grow): glu 16 rows of gate
    and of up (BLOCK_N, BLOCK_K), q/k/v a head's two halves (BLOCK_H, BLOCK_KH), o/down/lm_head
    two chunks of 8 columns (BLOCK_NL, BLOCK_KL: the o and down tiles of the small models are 16
    columns, and two chunks of 16 would leave half of each pass masked). An attention step holds
    BLOCK_L keys and values (32: 128 was slower on an H200). ``prefetch``: the L2 prefetch
    (aligned weights only). ``itemsize``: the model dtype's bytes; a thread's weight vector is
    16 bytes (VEC elements) when the weights are aligned, else one element."""
    ROWS = triton.next_power_of_2(max(rows, 1))
    BLOCK_N, BLOCK_NL = 16, 8
    BLOCK_H = triton.next_power_of_2(max(enc.max_head_dim // 2, 1))
    widest = triton.next_power_of_2(enc.max_k)

    vec = 16 // itemsize if enc.aligned else 1

    def k_block(weight_rows: int) -> int:
        """At most 16K weight elements a step (2 sets x weight_rows x K block), and an
        accumulator (2 x weight_rows x K block / VEC x ROWS) of at most 4K fp32, 16 a thread,
        except where the 16-column floor overrides it (unaligned weights at 5-8 rows)."""
        return max(16, min(widest, 8192 // weight_rows, 4096 // (2 * weight_rows * ROWS) * vec))

    return dict(ROWS=ROWS, BLOCK_N=BLOCK_N, BLOCK_K=k_block(BLOCK_N), BLOCK_NL=BLOCK_NL, BLOCK_KL=k_block(BLOCK_NL),
                BLOCK_H=BLOCK_H, BLOCK_KH=k_block(BLOCK_H), BLOCK_D=triton.next_power_of_2(enc.max_head_dim),
                BLOCK_L=32, BLOCK_V=triton.next_power_of_2(enc.max_tiles), ALIGNED=enc.aligned,
                VEC=vec, PREFETCH=prefetch and enc.aligned,
                NUM_THREADS=32 * num_warps)


def launch(enc: E.Encoded, counters: torch.Tensor, num_sms: int, token_ids, positions, slot_mapping, seq_lens,
           block_tables, kv_cache: torch.Tensor, num_warps: int = 8, stamps: torch.Tensor | None = None,
           sizes: dict | None = None) -> None:
    """One decode step of ``token_ids.shape[0]`` rows: ``counters`` must be zero (the caller
    zeroes it on the stream); the outputs land in the buffers ``enc`` was made over. ``stamps``
    (int64 [instructions, 3], flat order: SM by SM): time every instruction into it. ``sizes``
    overrides block_sizes' choices (benchmarks try other tiles, and the L2 prefetch, with it; the
    prefetch is PTX, which the Triton interpreter cannot run)."""
    S = token_ids.shape[0]
    L, two, nb, bs, hkv, hd = kv_cache.shape
    assert kv_cache.is_contiguous() and block_tables.stride(-1) == 1
    megakernel[(num_sms,)](
        enc.sm_ranges, enc.instructions, enc.wait_counters, enc.wait_values, enc.bump_counters, counters,
        enc.op_addrs, enc.op_ints, enc.op_floats, enc.prefetch,
        token_ids, positions, slot_mapping, seq_lens, block_tables, block_tables.stride(0),
        kv_cache, kv_cache.stride(0), kv_cache.stride(1), bs, S, counters if stamps is None else stamps,
        num_warps=num_warps, num_stages=1, TIMED=stamps is not None,
        **{**block_sizes(S, enc, num_warps, itemsize=kv_cache.element_size()), **(sizes or {})})
