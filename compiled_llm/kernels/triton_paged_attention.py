"""Triton paged attention over the block-table KV cache: a one-launch split-K decode kernel and a
GQA-stacked varlen causal prefill kernel.

Decode (every sequence has exactly one query row, T == S, recognisable from shapes alone):
``_decode_kernel``, grid (Hkv, S, NUM_SPLITS), does the whole op in one launch.
  * Grid order: the kv heads vary fastest, so the GPU starts programs sequence by sequence. The
    scheduler lists a decode step's rows longest context first (``Scheduler.schedule``), so the
    longest programs start first and the short ones fill the tail: at 128-256 sequences of mixed
    lengths that is 11-24% faster than sequences in arrival order (benchmarks/NOTES.md).
  * One program owns one kv head and all the query heads that share it (GQA: the group is padded
    to >= 16 rows so tl.dot can use tensor cores), and one contiguous slice of the sequence's
    context. It streams that slice's keys and values once and runs an online softmax.
  * KV store folded in: the new token of row s sits at position seq_len - 1 and its k/v rows are
    inputs. The split-0 program of each (s, kv head) writes them into the cache at
    slot_mapping[s]; the program whose slice holds position seq_len - 1 takes k/v for it from the
    inputs instead of the cache (which may not be written yet). No program reads that slot, so
    there is no race. This needs slot_mapping[s] to be -1 (write nothing; position seq_len - 1
    is then read from the cache, as the reference does) or the slot the block table gives
    position seq_len - 1, which is what pack_batch and the runtime's decode staging produce. Any
    other slot is still written, and position seq_len - 1 is then read from the cache, but a
    program attending over that other slot is not ordered against the write: such a batch is
    not a decode batch this kernel takes.
  * Split reduce folded in: each program writes its normalised partial output and log-sum-exp
    (base 2), then draws a ticket from a per-(sequence, kv head) counter; the program that draws
    the last ticket combines the live splits of its GROUP query heads in split order (so the
    result does not depend on which program finished last), writes the output rows and puts the
    counter back to 0. Ordering on the GPU: partial stores, CTA barrier, atomic add with
    acq_rel semantics at gpu scope (release publishes this CTA's stores, acquire makes the other
    programs' stores visible to the winner), and the winner reads partials with .cg (L2, not a
    possibly stale L1). With one split (NUM_SPLITS is a constexpr) the program writes its output
    itself: no partials, no tickets.
  * The counters live in a persistent zero-initialised int32 workspace per device (see
    ``split_counters``); every launch leaves them at 0. One decode attention may be in flight
    per device at a time (the runtime runs one stream).
  * Programmatic dependent launch: the step inputs (lengths, block table, slot mapping) and the
    cache rows of earlier steps are not the previous kernel's output, so each program loads its
    first key/value tile before the PDL wait; q, the new k/v rows and every store come after it.
  NUM_SPLITS comes from the block table's width (or a sliding layer's window, if shorter) and the
  batch size, never from seq_lens values,
  so the launch is the same for every step of a CUDA-graph bucket; each program derives its own
  slice from seq_lens on the device. Splits past a short context are empty (lse = -inf), the
  combiner skips them; a padding row (seq_len 0) has only empty splits and its output is 0.

Prefill / mixed (any T): ``_prefill_kernel``, grid (T // TOKENS + S + 1, Hkv): tiles over every
sequence's rows, each program finding its sequence by a binary search over query_start_loc, so
the grid comes from shapes alone (no host read: capturable, and the host never waits). One
program takes TOKENS query tokens of one sequence for all GROUP query heads of one kv head,
stacked into a [BLOCK_M, D] tile (row r: head r // TOKENS, token r % TOKENS; TOKENS =
BLOCK_M // GROUP, so a group of 7 uses 63 of 64 rows), so each K/V tile is loaded once for the
whole group. The query rows of sequence s are the last q_len tokens of its seq_len-token
context, so row i sees keys 0 .. seq_len - q_len + i; earlier chunks are read from the cache
through the block table like the new ones (the new k/v are stored first, by kv_store). Key
tiles below the block's first query position are visible to every row and run without any mask;
only the tiles on the diagonal pay for the causal mask (and, on a sliding layer, those at the
window's start, which some rows see in part).

Softmax runs in base 2 (scores pre-multiplied by scale * log2(e)), accumulation in fp32.

Sliding layers (Mistral, Gemma) and soft-capped scores (Gemma 2) are constexpr arguments of the
same kernels (WINDOW, SOFTCAP; 0 turns each off and compiles it out). With a window w the query at
position p sees keys p - w + 1 .. p: decode splits only the window, and a prefill program starts
at the first key its block's first row sees, masks the tiles the rows see in part, and loads no
key (nor block-table entry) below it, so the cache may have given those blocks back.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from compiled_llm.kernels import launch_configs
from compiled_llm.kernels.triton_common import (
    dot, is_fp32, next_pow2, pdl_launch, pdl_open, pdl_wait, sm_count, use_pdl,
)
from compiled_llm.kernels.triton_kv_store import kv_store, store_slot

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # the kernels' copy (a jitted function reads constexpr globals only)


# ---------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------


@triton.jit
def _scores(q, k, qk_scale, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """q k^T scaled into base 2; with SOFTCAP > 0, Gemma's soft cap cap * tanh(s / cap) on the
    scaled scores s first (tanh from exp2, which the interpreter runs too)."""
    scores = dot(q, tl.trans(k), IEEE) * qk_scale
    if SOFTCAP > 0:
        x = scores * (2.0 / (_LOG2E * SOFTCAP))  # 2 s / cap, in base e
        scores = (SOFTCAP * _LOG2E) * (1.0 - 2.0 / (tl.exp2(x * _LOG2E) + 1.0))
    return scores


@triton.jit
def _window_start(seq_len, first_query, WINDOW: tl.constexpr):
    """The first key a query at ``first_query`` (or later) of a sliding layer can see; 0 for a
    global layer (WINDOW 0)."""
    if WINDOW > 0:
        return tl.maximum(first_query - WINDOW + 1, 0)
    else:
        return seq_len * 0


@triton.jit
def _split_len(seq_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per split: a whole number of BLOCK_N tiles (0 for an empty context)."""
    return tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def _new_row_position(slot_ptr, bt_row, s, seq_len, stride_bt_b, BLOCK_SIZE: tl.constexpr):
    """(slot row s's new k/v go to, position whose k/v the readers take from the inputs or -1).
    Step inputs only (slot mapping, block table, lengths): readable before the PDL wait."""
    slot = tl.load(slot_ptr + s).to(tl.int64)
    # only when the slot is where the block table puts position seq_len - 1 does the new row
    # stand in for the cache (slot -1: nothing is written, the cache holds the row)
    last = tl.maximum(seq_len - 1, 0)
    last_blk = tl.load(bt_row + (last // BLOCK_SIZE) * stride_bt_b).to(tl.int64)
    fresh = (seq_len > 0) & (slot == last_blk * BLOCK_SIZE + last % BLOCK_SIZE)
    return slot, tl.where(fresh, seq_len - 1, -1)


@triton.jit
def _store_new_row(
    k_ptr, v_ptr, cache_ptr, slot, s, kvh, split, offs_d, mask_d,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_c_kv, stride_c_blk, stride_c_off, stride_c_h, stride_c_d,
    BLOCK_SIZE: tl.constexpr,
):
    """Store row s's new k/v of this kv head (split 0 only) and return (the new k row, the new v
    row) in the cache dtype, so the values read are exactly the values stored."""
    new_k = tl.load(k_ptr + s * stride_kt + kvh * stride_kh + offs_d * stride_kd, mask=mask_d, other=0.0)
    new_v = tl.load(v_ptr + s * stride_vt + kvh * stride_vh + offs_d * stride_vd, mask=mask_d, other=0.0)
    new_k = new_k.to(cache_ptr.dtype.element_ty)
    new_v = new_v.to(cache_ptr.dtype.element_ty)
    if (split == 0) & (slot >= 0):
        store_slot(cache_ptr, slot, new_k, new_v, kvh * stride_c_h + offs_d * stride_c_d, mask_d,
                   stride_c_kv, stride_c_blk, stride_c_off, BLOCK_SIZE)
    return new_k, new_v


@triton.jit
def _cached_kv_tile(kv_base, bt_row, n0, end, new_pos, offs_d, mask_d,
                    stride_bt_b, stride_c_kv, stride_c_blk, stride_c_off, stride_c_d,
                    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """K and V rows of keys n0 .. n0 + BLOCK_N - 1 (below ``end``) from the cache, 0 past the end
    and at ``new_pos`` (the slot being written this step, never read)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    blk = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_bt_b, mask=mask_n, other=0)
    row = blk.to(tl.int64) * stride_c_blk + (offs_n % BLOCK_SIZE) * stride_c_off
    kv_mask = (mask_n & (offs_n != new_pos))[:, None] & mask_d[None, :]
    k = tl.load(kv_base + row[:, None] + offs_d[None, :] * stride_c_d, mask=kv_mask, other=0.0)
    v = tl.load(kv_base + stride_c_kv + row[:, None] + offs_d[None, :] * stride_c_d, mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _attend_tile(q, k, v, n0, end, m_i, l_i, acc, new_pos, new_k, new_v, qk_scale,
                 BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """One BLOCK_N-key step of the online softmax over cached rows k, v (keys n0.., below end),
    the new row standing in at ``new_pos``. A tile with no key (an empty split) changes nothing."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    is_new = (offs_n == new_pos)[:, None]
    k = tl.where(is_new, new_k[None, :], k)
    v = tl.where(is_new, new_v[None, :], v)
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    scores = _scores(q, k, qk_scale, SOFTCAP, IEEE)
    scores = tl.where(mask_n[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)  # no key yet: exp2(-inf) = 0, not NaN
    p = tl.exp2(scores - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def _combine_splits(
    mid_o_ptr, mid_lse_ptr, out_ptr, s, kvh, n_live,
    stride_mo_s, stride_mo_h, stride_mo_p, stride_ml_s, stride_ml_h,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Out rows of the GROUP heads of kv head kvh: the n_live live splits' partials weighted by
    exp2(lse - max), BLOCK_P splits per step in split order (deterministic). Loads bypass L1
    (.cg): the partials were written by other programs."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    lse_row = mid_lse_ptr + s * stride_ml_s + heads * stride_ml_h
    o_row = mid_o_ptr + s * stride_mo_s + heads * stride_mo_h
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for p0 in range(0, n_live, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        mask_gp = mask_g[:, None] & (offs_p < n_live)[None, :]
        lse = tl.load(lse_row[:, None] + offs_p[None, :], mask=mask_gp, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(
            o_row[:, None, None] + offs_p[None, :, None] * stride_mo_p + offs_d[None, None, :],
            mask=mask_gp[:, :, None] & mask_d[None, None, :], other=0.0, cache_modifier=".cg",
        )
        m_new = tl.maximum(m, tl.max(lse, 1))
        m_use = tl.where(m_new > float("-inf"), m_new, 0.0)  # padded heads see only -inf
        alpha = tl.exp2(m - m_use)
        w = tl.exp2(lse - m_use[:, None])
        den = den * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)
        m = m_new
    out = acc / tl.where(den > 0, den, 1.0)[:, None]  # no live split (padding row): 0
    tl.store(
        out_ptr + s * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :],
    )


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, cache_ptr, slot_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
    out_ptr, mid_o_ptr, mid_lse_ptr, counter_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_c_kv, stride_c_blk, stride_c_off, stride_c_h, stride_c_d,
    stride_bt_s, stride_bt_b,
    stride_ot, stride_oh, stride_od,
    stride_mo_s, stride_mo_h, stride_mo_p,
    stride_ml_s, stride_ml_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False, WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0,
):
    # PDL: launched while the previous kernel (q/k/v) runs. The step inputs (lengths, block
    # table, slot mapping) and the cache rows of earlier steps need nothing from it, so the first
    # key tile is loaded before the wait; q and the new k/v rows (its output) and every store come
    # after.
    pdl_open(PDL)
    kvh = tl.program_id(0)
    s = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + s)
    n_q = tl.load(qsl_ptr + s + 1) - tl.load(qsl_ptr + s)
    seq_len = tl.where(n_q > 0, seq_len, 0)
    # a sliding layer reads the window only: the splits share it, not the whole context
    lo = _window_start(seq_len, seq_len - 1, WINDOW)
    per_split = _split_len(seq_len - lo, NUM_SPLITS, BLOCK_N)
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_h
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    bt_row = bt_ptr + s * stride_bt_s
    kv_base = cache_ptr + kvh * stride_c_h
    slot, new_pos = _new_row_position(slot_ptr, bt_row, s, seq_len, stride_bt_b, BLOCK_SIZE)
    k_first, v_first = _cached_kv_tile(kv_base, bt_row, start, end, new_pos, offs_d, mask_d, stride_bt_b,
                                       stride_c_kv, stride_c_blk, stride_c_off, stride_c_d, BLOCK_SIZE, BLOCK_N)
    pdl_wait(PDL)
    new_k, new_v = _store_new_row(
        k_ptr, v_ptr, cache_ptr, slot, s, kvh, split, offs_d, mask_d,
        stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
        stride_c_kv, stride_c_blk, stride_c_off, stride_c_h, stride_c_d, BLOCK_SIZE,
    )

    # decode: row s of q is sequence s's only query row
    q = tl.load(
        q_ptr + s * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_h[:, None] & mask_d[None, :], other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    if PREFETCH:
        # the next tile's loads are issued before this tile's math, so two tiles are in flight
        # per program (in registers; a pipelining stage would take shared memory). The last
        # trip loads a tile past ``end``: fully masked, it moves no bytes.
        k, v, n_cur = k_first, v_first, start
        for n0 in range(start + BLOCK_N, end + BLOCK_N, BLOCK_N):
            k_next, v_next = _cached_kv_tile(kv_base, bt_row, n0, end, new_pos, offs_d, mask_d, stride_bt_b,
                                             stride_c_kv, stride_c_blk, stride_c_off, stride_c_d, BLOCK_SIZE, BLOCK_N)
            m_i, l_i, acc = _attend_tile(q, k, v, n_cur, end, m_i, l_i, acc, new_pos, new_k, new_v, qk_scale,
                                         BLOCK_N, SOFTCAP, IEEE)
            k, v, n_cur = k_next, v_next, n0
    else:
        # the first tile (loaded before the wait) is peeled off; the loop loads the rest
        m_i, l_i, acc = _attend_tile(q, k_first, v_first, start, end, m_i, l_i, acc, new_pos, new_k, new_v,
                                     qk_scale, BLOCK_N, SOFTCAP, IEEE)
        for n0 in range(start + BLOCK_N, end, BLOCK_N):
            k, v = _cached_kv_tile(kv_base, bt_row, n0, end, new_pos, offs_d, mask_d, stride_bt_b,
                                   stride_c_kv, stride_c_blk, stride_c_off, stride_c_d, BLOCK_SIZE, BLOCK_N)
            m_i, l_i, acc = _attend_tile(q, k, v, n0, end, m_i, l_i, acc, new_pos, new_k, new_v, qk_scale,
                                         BLOCK_N, SOFTCAP, IEEE)

    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    if NUM_SPLITS == 1:  # one split: its normalised output is the answer
        tl.store(
            out_ptr + s * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :],
        )
    else:
        lse = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
        # the combiner reads live splits only (the condition is broadcast to the head axis
        # first: the interpreter refuses a tensor & scalar mask)
        keep = mask_h & (offs_h * 0 + start < end)
        mo = mid_o_ptr + s * stride_mo_s + heads[:, None] * stride_mo_h + split * stride_mo_p + offs_d[None, :]
        tl.store(mo, out, mask=keep[:, None] & mask_d[None, :])
        tl.store(mid_lse_ptr + s * stride_ml_s + heads * stride_ml_h + split, lse, mask=keep)
        tl.debug_barrier()  # every thread's partial stores precede the release below
        counter = counter_ptr + s * tl.num_programs(0) + kvh
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == NUM_SPLITS - 1:  # the last program of (s, kvh): all partials are in
            tl.debug_barrier()
            n_live = tl.cdiv(seq_len - lo, tl.maximum(per_split, 1))
            _combine_splits(
                mid_o_ptr, mid_lse_ptr, out_ptr, s, kvh, n_live,
                stride_mo_s, stride_mo_h, stride_mo_p, stride_ml_s, stride_ml_h,
                stride_ot, stride_oh, stride_od,
                GROUP, HEAD_DIM, BLOCK_G, BLOCK_P, BLOCK_D,
            )
            tl.store(counter, 0)  # zero for the next launch (kernel boundaries order it)



# ---------------------------------------------------------------------------------------------
# prefill / mixed
# ---------------------------------------------------------------------------------------------


@triton.jit
def _prefill_tile(
    q, acc, m_i, l_i, kv_base, bt_row, n0, q_pos, lo, end, offs_d, mask_d, qk_scale,
    stride_bt_b, stride_c_kv, stride_c_blk, stride_c_off, stride_c_d,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
):
    """One BLOCK_N-key step of the online softmax. MASKED: a tile some row sees only part of
    (the causal limit, the window of a sliding layer and the end of the keys apply, and keys
    below ``lo``, the block's first visible one, are not loaded); otherwise every key is visible
    to every row and nothing is masked. Without a window the first tile a program runs holds
    key 0, visible to all rows, so m_i is finite after it; with one, a row may see no key of
    its first tiles, and the running max is guarded as in decode."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        mask_n = (offs_n < end) & (offs_n >= lo)
        blk = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_bt_b, mask=mask_n, other=0)
    else:
        blk = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_bt_b)
    ptrs = kv_base + (blk.to(tl.int64) * stride_c_blk + (offs_n % BLOCK_SIZE) * stride_c_off)[:, None] \
        + offs_d[None, :] * stride_c_d
    if MASKED:
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(ptrs, mask=kv_mask, other=0.0)
        v = tl.load(ptrs + stride_c_kv, mask=kv_mask, other=0.0)
    elif EVEN_D:
        k = tl.load(ptrs)
        v = tl.load(ptrs + stride_c_kv)
    else:
        k = tl.load(ptrs, mask=mask_d[None, :], other=0.0)
        v = tl.load(ptrs + stride_c_kv, mask=mask_d[None, :], other=0.0)
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    scores = _scores(q, k, qk_scale, SOFTCAP, IEEE)
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        if WINDOW > 0:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    if WINDOW > 0:
        m_use = tl.where(m_new > float("-inf"), m_new, 0.0)  # no key yet: exp2(-inf) = 0, not NaN
    else:
        m_use = m_new
    p = tl.exp2(scores - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    return acc, m_new, l_i


# NUM_SEQS and the block-table row stride (the step's widest table) change from step to step:
# left unspecialised, so a new value never costs a compile in the middle of serving
@triton.jit(do_not_specialize=["NUM_SEQS", "stride_bt_s", "T"])
def _prefill_kernel(
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    qk_scale, T, NUM_SEQS,
    stride_qt, stride_qh, stride_qd,
    stride_c_kv, stride_c_blk, stride_c_off, stride_c_h, stride_c_d,
    stride_bt_s, stride_bt_b,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0,
):
    # grid (T // TOKENS + S + 1, Hkv), sized from shapes alone (no host read of the longest
    # query): sequence s owns tiles [first(s), first(s + 1)) with
    # first(s) = query_start_loc[s] // TOKENS + s, which is at least cdiv(q_len, TOKENS)
    # tiles; a program binary-searches its sequence and surplus tiles exit
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    lo = 0
    hi = NUM_SEQS
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // TOKENS + mid <= tile:
            lo = mid
        else:
            hi = mid
    s = lo
    mb = tile - (tl.load(qsl_ptr + s) // TOKENS + s)
    q_start = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_start
    n_tiles = tl.cdiv(q_len, TOKENS)
    if (s == NUM_SEQS - 1) & (mb >= n_tiles):
        # a surplus tile of the last sequence: zero (its kv head's share of) the rows past
        # the batch, which belong to no sequence (a CUDA-graph bucket's padding), so `out`
        # needs no separate fill. The last sequence has at least one surplus tile (the
        # grid's last), and about one per TOKENS padding rows; they stride over the rows.
        helpers = tl.num_programs(0) - (q_start // TOKENS + s) - n_tiles
        offs_r = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        head = kvh * GROUP + offs_r // TOKENS
        zeros = tl.zeros([BLOCK_M, BLOCK_D], out_ptr.dtype.element_ty)
        for r0 in range(q_start + q_len + (mb - n_tiles) * TOKENS, T, helpers * TOKENS):
            rows = r0 + offs_r % TOKENS
            mask = ((offs_r // TOKENS < GROUP) & (rows < T))[:, None] & (offs_d < HEAD_DIM)[None, :]
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
                     + offs_d[None, :] * stride_od, zeros, mask=mask)
    if mb * TOKENS < q_len:
        seq_len = tl.load(seq_lens_ptr + s)
        ctx_before = seq_len - q_len  # tokens cached before this step's rows
        # stacked rows: the GROUP heads of kv head kvh x TOKENS query tokens
        offs_r = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        g = offs_r // TOKENS
        i = mb * TOKENS + offs_r % TOKENS
        mask_r = (g < GROUP) & (i < q_len)
        mask_d = offs_d < HEAD_DIM
        tok = (q_start + i).to(tl.int64)
        head = kvh * GROUP + g
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=mask_r[:, None] & mask_d[None, :], other=0.0,
        )
        q_pos = ctx_before + i  # causal limit of each row (inclusive)
        first = ctx_before + mb * TOKENS  # the block's smallest query position
        end = ctx_before + tl.minimum((mb + 1) * TOKENS, q_len)  # one past its largest
        full_end = (first + 1) // BLOCK_N * BLOCK_N  # keys below: causally visible to every row
        # a sliding layer: keys from win_lo on are in some row's window, keys from window_all on
        # in every row's (the last row's window starts at end - WINDOW); tiles [win_lo, in_all)
        # are masked, [in_all, full_end) are not, [full_end, end) are masked (the diagonal)
        win_lo = _window_start(seq_len, first, WINDOW)
        if WINDOW > 0:
            window_all = tl.cdiv(tl.maximum(end - WINDOW, 0), BLOCK_N) * BLOCK_N
        else:
            window_all = win_lo
        in_all = tl.minimum(window_all, full_end)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv_base = cache_ptr + kvh * stride_c_h
        bt_row = bt_ptr + s * stride_bt_s
        if WINDOW > 0:
            for n0 in range(win_lo // BLOCK_N * BLOCK_N, in_all, BLOCK_N):
                acc, m_i, l_i = _prefill_tile(
                    q, acc, m_i, l_i, kv_base, bt_row, n0, q_pos, win_lo, end, offs_d, mask_d, qk_scale,
                    stride_bt_b, stride_c_kv, stride_c_blk, stride_c_off, stride_c_d,
                    BLOCK_SIZE, BLOCK_N, True, HEAD_DIM == BLOCK_D, WINDOW, SOFTCAP, IEEE,
                )
        for n0 in range(in_all, full_end, BLOCK_N):
            acc, m_i, l_i = _prefill_tile(
                q, acc, m_i, l_i, kv_base, bt_row, n0, q_pos, win_lo, end, offs_d, mask_d, qk_scale,
                stride_bt_b, stride_c_kv, stride_c_blk, stride_c_off, stride_c_d,
                BLOCK_SIZE, BLOCK_N, False, HEAD_DIM == BLOCK_D, WINDOW, SOFTCAP, IEEE,
            )
        for n0 in range(full_end, end, BLOCK_N):
            acc, m_i, l_i = _prefill_tile(
                q, acc, m_i, l_i, kv_base, bt_row, n0, q_pos, win_lo, end, offs_d, mask_d, qk_scale,
                stride_bt_b, stride_c_kv, stride_c_blk, stride_c_off, stride_c_d,
                BLOCK_SIZE, BLOCK_N, True, HEAD_DIM == BLOCK_D, WINDOW, SOFTCAP, IEEE,
            )
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty), mask=mask_r[:, None] & mask_d[None, :],
        )


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------


# the decode grid's sequence axis is CUDA's y, which holds at most 65,535 programs
MAX_DECODE_SEQS = 65_535


def is_decode_batch(q: torch.Tensor, query_start_loc: torch.Tensor) -> bool:
    """Decode steps have one row per sequence: T == S, known from shapes alone (a batch of more
    sequences than the decode grid holds takes the prefill path, which handles any T)."""
    return q.shape[0] == query_start_loc.shape[0] - 1 and q.shape[0] <= MAX_DECODE_SEQS


def num_decode_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, max_splits: int,
                      device: torch.device, programs_per_sm: int = 2) -> int:
    """Splits of each sequence's context so that the grid has ~programs_per_sm programs per SM;
    a function of shapes and the device only (never of seq_lens values), so CUDA graphs can
    capture it. Each program sizes its slice from its own seq_len, so at a short context the
    extra splits are empty programs that exit after a few loads, not wasted bandwidth."""
    want = math.ceil(programs_per_sm * sm_count(device) / max(num_seqs * num_kv_heads, 1))
    return max(1, min(want, max_splits, math.ceil(max_context / block_n)))


# Ticket counters of the fused split reduce, one zeroed int32 buffer per device. Every launch
# leaves them at 0, so one buffer serves every layer and every step. It is allocated (and, when a
# batch needs more counters than it has, replaced) on an eager call: CUDA graphs replay the
# address they captured, so replaced buffers are kept alive in _RETIRED, and growing inside a
# capture is refused (the runtime runs every bucket eagerly before capturing).
MIN_COUNTERS = 1 << 16  # 256 KiB: 4096 sequences x 16 kv heads before any growth
_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """The device's counter buffer, with at least n counters."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"paged attention needs {n} split counters on {device} but has "
                f"{0 if buf is None else buf.numel()}; run the decode step once before capturing CUDA graphs"
            )
        if buf is not None:
            _RETIRED.append(buf)  # captured graphs may still use it
        size = max(n, MIN_COUNTERS, 2 * (0 if buf is None else buf.numel()))
        buf = torch.zeros(size, dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def for_head_dim(cfg: dict[str, int], head_dim: int) -> dict[str, int]:
    """A launch config (tuned at head_dim 64/128) at ``head_dim``: past 128 (Gemma's 256) the
    key tile shrinks in proportion and the decode prefetch is off, so a program holds the same
    bytes of K/V in registers as at 128 (without it they spill: test_attention_interpret)."""
    if head_dim <= 128:
        return cfg
    return dict(cfg, BLOCK_N=max(16, cfg["BLOCK_N"] * 128 // next_pow2(head_dim)), PREFETCH=0)


def decode_plan(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device,
                head_dim: int = 128) -> dict[str, int]:
    """The decode launch for these shapes: the config plus NUM_SPLITS."""
    cfg = for_head_dim(launch_configs.get("paged_attention_decode", num_seqs), head_dim)
    splits = num_decode_splits(num_seqs, num_kv_heads, max_context, cfg["BLOCK_N"], cfg["MAX_SPLITS"], device,
                               cfg.get("PROGRAMS_PER_SM", 2))
    return dict(cfg, NUM_SPLITS=splits)


def paged_attention_decode(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_tables,
                           scale: float, sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """cllm::paged_attention of a decode batch (row s = sequence s's new token): one launch, no
    host syncs, shapes-only launch (CUDA-graph capturable). A sliding layer's splits share its
    window, so its launch is sized by the window, not the block table."""
    T, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    block_size = kv_cache.shape[2]
    out = torch.empty((T, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    max_context = block_tables.shape[1] * block_size
    plan = decode_plan(T, num_kv_heads, min(max_context, sliding_window) if sliding_window else max_context,
                       q.device, head_dim)
    splits = plan["NUM_SPLITS"]
    if splits == 1:  # the program writes the output itself: no partials, no counters
        mid_o = mid_lse = out  # not read
        mo_strides, ml_strides = (0, 0, 0), (0, 0)
        counters = seq_lens  # not read
    else:
        mid_o = torch.empty((T, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((T, num_heads, splits), dtype=torch.float32, device=q.device)
        mo_strides, ml_strides = mid_o.stride()[:3], mid_lse.stride()[:2]
        counters = split_counters(q.device, T * num_kv_heads)
    block_d = max(16, next_pow2(head_dim))
    block_g = next_pow2(group)
    # PDL pays where the neighbours are PDL kernels too (the GEMV forms, a few rows); next to
    # cuBLAS (larger batches) it is slower (benchmarks/NOTES.md)
    pdl = use_pdl(q) and T <= 4
    _decode_kernel[(num_kv_heads, T, splits)](
        q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
        out, mid_o, mid_lse, counters,
        scale * LOG2E,
        *q.stride(), *k.stride(), *v.stride(), *kv_cache.stride(), *block_tables.stride(), *out.stride(),
        *mo_strides, *ml_strides,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, NUM_SPLITS=splits,
        BLOCK_H=max(16, next_pow2(group)), BLOCK_N=plan["BLOCK_N"], BLOCK_D=block_d,
        BLOCK_G=block_g, BLOCK_P=min(next_pow2(splits), next_pow2(plan.get("COMBINE_SPLITS", 16))),
        IEEE=is_fp32(q), PDL=pdl, PREFETCH=bool(plan.get("PREFETCH", 0)), WINDOW=int(sliding_window),
        SOFTCAP=float(softcap), num_warps=plan["num_warps"], num_stages=plan["num_stages"], **pdl_launch(pdl),
    )
    return out


def prefill_tile(num_heads: int, num_kv_heads: int, block_m: int) -> tuple[int, int]:
    """(tile rows, query tokens per program) of the GQA-stacked prefill tile: at least
    ``block_m`` rows (a power of two >= 16 that holds one token of every head of the group),
    filled with as many tokens of the whole group as fit."""
    group = num_heads // num_kv_heads
    rows = max(16, next_pow2(block_m), next_pow2(group))
    return rows, rows // group


def paged_attention_prefill(q, kv_cache, query_start_loc, seq_lens, block_tables, scale: float,
                            sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of packed query rows over the paged cache (their k/v already stored).
    No host sync (prefill steps run on while the host prepares the next; graphs capture it):
    the programs find their sequences themselves."""
    T, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    S = seq_lens.shape[0]
    # rows past query_start_loc[-1] belong to no sequence and are 0, as in the reference: the
    # grid's surplus tiles write them (no fill launch)
    out = (torch.empty if S > 0 else torch.zeros)((T, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if T == 0 or S == 0:
        return out
    cfg = for_head_dim(launch_configs.get("paged_attention_prefill", T), head_dim)
    block_m, tokens = prefill_tile(num_heads, num_kv_heads, cfg["BLOCK_M"])
    _prefill_kernel[(T // tokens + S + 1, num_kv_heads)](
        q, kv_cache, block_tables, seq_lens, query_start_loc, out,
        scale * LOG2E, T, S,
        *q.stride(), *kv_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=kv_cache.shape[2], TOKENS=tokens,
        BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_D=max(16, next_pow2(head_dim)),
        IEEE=is_fp32(q), WINDOW=int(sliding_window), SOFTCAP=float(softcap), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


def paged_attention(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_tables, scale: float,
                    sliding_window: int = 0, softcap: float = 0.0):
    """cllm::paged_attention: store k/v at slot_mapping, then causal attention of each
    sequence's rows over its paged context (over its window only, for a sliding layer; with
    soft-capped scores for Gemma 2). Decode-shaped batches take the one-launch split-K path (no
    host sync, capturable; it stores k/v itself); others kv_store + the prefill kernel."""
    if is_decode_batch(q, query_start_loc):
        return paged_attention_decode(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_tables,
                                      scale, sliding_window, softcap)
    kv_store(k, v, kv_cache, slot_mapping)
    return paged_attention_prefill(q, kv_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window,
                                   softcap)
