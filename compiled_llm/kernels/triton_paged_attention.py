"""Triton paged attention over the block-table KV cache: a split-K decode kernel and a varlen
causal prefill kernel.

Decode (every sequence has exactly one query row, T == S, recognisable from shapes alone):
  * ``_decode_split_kernel``, grid (S, Hkv, NUM_SPLITS). One program owns one kv head and all the
    query heads that share it (GQA: the group is padded to >= 16 rows so tl.dot can use tensor
    cores), and one contiguous slice of the sequence's context. It streams that slice's keys and
    values once, runs an online softmax and writes a normalised partial output plus its
    log-sum-exp (base 2).
  * ``_decode_reduce_kernel``, grid (S, Hq), combines the splits weighted by exp2(lse - max).
  NUM_SPLITS comes from the block table's width and the batch size, never from seq_lens values,
  so the launch is the same for every step of a CUDA-graph bucket; each program derives its own
  slice from seq_lens on the device. Splits past a short context are empty (lse = -inf, weight 0);
  a padding row (seq_len 0) has only empty splits and its output is 0.

Prefill / mixed (any T): ``_prefill_kernel``, grid (cdiv(max_query_len, BLOCK_M), S, Hq). The
query rows of sequence s are the last q_len tokens of its seq_len-token context, so row i sees
keys 0 .. seq_len - q_len + i; earlier chunks are read from the cache through the block table
like the new ones (the new k/v are stored first). max_query_len is read on the host: prefill
steps run outside CUDA graphs.

Softmax runs in base 2 (scores pre-multiplied by scale * log2(e)), accumulation in fp32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from compiled_llm.kernels import launch_configs
from compiled_llm.kernels.triton_common import dot, is_fp32, next_pow2, sm_count
from compiled_llm.kernels.triton_kv_store import kv_store

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, mid_o_ptr, mid_lse_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_c_kv, stride_c_blk, stride_c_off, stride_c_h, stride_c_d,
    stride_bt_s, stride_bt_b,
    stride_mo_s, stride_mo_h, stride_mo_p,
    stride_ml_s, stride_ml_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + s)
    n_q = tl.load(qsl_ptr + s + 1) - tl.load(qsl_ptr + s)
    seq_len = tl.where(n_q > 0, seq_len, 0)
    # this split's slice of the context, a whole number of BLOCK_N tiles
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    # decode: row s of q is sequence s's only query row
    q = tl.load(
        q_ptr + s * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_g[:, None] & mask_d[None, :], other=0.0,
    )

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_base = cache_ptr + kvh * stride_c_h
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        blk = tl.load(bt_ptr + s * stride_bt_s + (offs_n // BLOCK_SIZE) * stride_bt_b, mask=mask_n, other=0)
        row = blk.to(tl.int64) * stride_c_blk + (offs_n % BLOCK_SIZE) * stride_c_off
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_base + row[:, None] + offs_d[None, :] * stride_c_d, mask=kv_mask, other=0.0)
        v = tl.load(k_base + stride_c_kv + row[:, None] + offs_d[None, :] * stride_c_d, mask=kv_mask, other=0.0)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        scores = dot(q, tl.trans(k), IEEE) * qk_scale
        scores = tl.where(mask_n[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
    mo = mid_o_ptr + s * stride_mo_s + heads[:, None] * stride_mo_h + split * stride_mo_p + offs_d[None, :]
    tl.store(mo, out, mask=mask_g[:, None] & mask_d[None, :])
    tl.store(mid_lse_ptr + s * stride_ml_s + heads * stride_ml_h + split, lse, mask=mask_g)


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr,
    stride_mo_s, stride_mo_h, stride_mo_p,
    stride_ml_s, stride_ml_h,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    mask_p = offs_p < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + s * stride_ml_s + h * stride_ml_h + offs_p, mask=mask_p, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)  # all splits empty: weights below are all 0
    w = tl.exp2(lse - m)
    o = tl.load(
        mid_o_ptr + s * stride_mo_s + h * stride_mo_h + offs_p[:, None] * stride_mo_p + offs_d[None, :],
        mask=mask_p[:, None] & mask_d[None, :], other=0.0,
    )
    den = tl.sum(w, 0)
    num = tl.sum(w[:, None] * o, 0)
    out = num / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + s * stride_ot + h * stride_oh + offs_d * stride_od, out.to(out_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _prefill_kernel(
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_c_kv, stride_c_blk, stride_c_off, stride_c_h, stride_c_d,
    stride_bt_s, stride_bt_b,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    mb = tl.program_id(0)
    s = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_start
    if mb * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + s)
        ctx_before = seq_len - q_len  # tokens cached before this step's rows
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < q_len
        mask_d = offs_d < HEAD_DIM
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
            mask=mask_m[:, None] & mask_d[None, :], other=0.0,
        )
        q_pos = ctx_before + offs_m  # causal limit of each row (inclusive)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv_base = cache_ptr + (h // GROUP) * stride_c_h
        end = tl.minimum(seq_len, ctx_before + (mb + 1) * BLOCK_M)
        for n0 in range(0, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            blk = tl.load(bt_ptr + s * stride_bt_s + (offs_n // BLOCK_SIZE) * stride_bt_b, mask=mask_n, other=0)
            row = blk.to(tl.int64) * stride_c_blk + (offs_n % BLOCK_SIZE) * stride_c_off
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(kv_base + row[:, None] + offs_d[None, :] * stride_c_d, mask=kv_mask, other=0.0)
            v = tl.load(kv_base + stride_c_kv + row[:, None] + offs_d[None, :] * stride_c_d, mask=kv_mask, other=0.0)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
            scores = dot(q, tl.trans(k), IEEE) * qk_scale
            valid = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
            scores = tl.where(valid, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_use = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows that see nothing yet
            p = tl.exp2(scores - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :],
        )


def is_decode_batch(q: torch.Tensor, query_start_loc: torch.Tensor) -> bool:
    """Decode steps have one row per sequence: T == S, known from shapes alone."""
    return q.shape[0] == query_start_loc.shape[0] - 1


def num_decode_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, max_splits: int,
                      device: torch.device) -> int:
    """Splits of each sequence's context so that the grid has ~2 programs per SM; a function of
    shapes and the device only (never of seq_lens values), so CUDA graphs can capture it."""
    want = math.ceil(2 * sm_count(device) / max(num_seqs * num_kv_heads, 1))
    return max(1, min(want, max_splits, math.ceil(max_context / block_n)))


def paged_attention_decode(q, kv_cache, query_start_loc, seq_lens, block_tables, scale: float) -> torch.Tensor:
    T, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    block_size = kv_cache.shape[2]
    cfg = launch_configs.get("paged_attention_decode", T)
    block_n = cfg["BLOCK_N"]
    splits = num_decode_splits(T, num_kv_heads, block_tables.shape[1] * block_size, block_n, cfg["MAX_SPLITS"], q.device)
    mid_o = torch.empty((T, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((T, num_heads, splits), dtype=torch.float32, device=q.device)
    out = torch.empty((T, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    _decode_split_kernel[(T, num_kv_heads, splits)](
        q, kv_cache, block_tables, seq_lens, query_start_loc, mid_o, mid_lse,
        scale * LOG2E,
        *q.stride(), *kv_cache.stride(), *block_tables.stride(),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, NUM_SPLITS=splits,
        BLOCK_H=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(head_dim)),
        IEEE=is_fp32(q), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    rcfg = launch_configs.get("paged_attention_reduce", T)
    _decode_reduce_kernel[(T, num_heads)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        *out.stride(),
        HEAD_DIM=head_dim, NUM_SPLITS=splits, BLOCK_P=max(2, next_pow2(splits)), BLOCK_D=next_pow2(head_dim),
        num_warps=rcfg["num_warps"],
    )
    return out


def paged_attention_prefill(q, kv_cache, query_start_loc, seq_lens, block_tables, scale: float,
                            max_query_len: int | None = None) -> torch.Tensor:
    T, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    S = seq_lens.shape[0]
    # rows past query_start_loc[-1] belong to no sequence and stay 0, as in the reference
    out = torch.zeros((T, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if T == 0 or S == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())  # host sync: prefill only
    if max_query_len <= 0:
        return out
    cfg = launch_configs.get("paged_attention_prefill", T)
    grid = (triton.cdiv(max_query_len, cfg["BLOCK_M"]), S, num_heads)
    _prefill_kernel[grid](
        q, kv_cache, block_tables, seq_lens, query_start_loc, out,
        scale * LOG2E,
        *q.stride(), *kv_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=max(16, next_pow2(head_dim)),
        IEEE=is_fp32(q), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def paged_attention(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_tables, scale: float):
    """cllm::paged_attention: store k/v at slot_mapping, then causal attention of each
    sequence's rows over its paged context. Decode-shaped batches take the split-K path (no host
    sync, capturable); others the prefill kernel."""
    kv_store(k, v, kv_cache, slot_mapping)
    if is_decode_batch(q, query_start_loc):
        return paged_attention_decode(q, kv_cache, query_start_loc, seq_lens, block_tables, scale)
    return paged_attention_prefill(q, kv_cache, query_start_loc, seq_lens, block_tables, scale)
