"""Triton fused q/k/v projection: optional input RMSNorm, projection + bias, per-head q/k RMSNorm
(Qwen3), neox RoPE, and the q/k/v split into fresh contiguous outputs.

Decode form (T <= MAX_TOKENS of "qkv_dispatch"): one weight-streaming launch (two with q/k
norms, below), ``_qkv_decode_kernel``, grid (heads * SPLITS, cdiv(T, BLOCK_T)) over the Hq + 2 Hkv heads. A
program owns BLOCK_P rotation pairs of one head: rows i and i + D/2, which RoPE mixes, so the pair
stays in one program's registers. It computes the input-norm statistics of its x rows itself (x is
tiny), streams its weight rows once along H as triton_gemv does, adds the bias, rounds to the dtype
(the reference rounds the F.linear output), rotates and stores. Under programmatic dependent
launch the first weight chunk, the bias and cos/sin (none of them the previous kernel's output)
are loaded before the wait, and each pair block's first chunk one block ahead. At one row
(batch-1 decode) the ONE_ROW form keeps one fp32 accumulator per weight row and thread, as
triton_gemv._gemv_one_row_kernel does. Splitting heads into pairs keeps
enough programs to fill the GPU (Qwen2.5-0.5B has 18 heads). With q/k norm the statistics need the
whole head, so the kernel stores the rounded projection unrotated and the prefill form's epilogue
kernel normalises and rotates q and k in a second launch (a head's norm inside the GEMV would need
a program to own the whole head: Gemma-3-1B's six heads would be six programs). Weight-only quantized weights:
int8 (SCALED) in either form, int4 in the INT4 form (triton_gemv.int4_step; no one-block-ahead
pipeline).

Prefill form (large T): Triton rms_norm when there is an input norm, the projection in cuBLAS
(which adds the bias in its own epilogue with one rounding, as the reference does), then
``_qkv_epilogue_kernel``, grid (T / BLOCK_T, Hq + 2 Hkv): one head of BLOCK_T tokens per program, normalised,
rotated and written to its own contiguous q/k/v output; v heads are copied. Weight-only
quantized weights project through triton_gemv.matmul_wq (the quantized GEMM, or dequantize +
cuBLAS).

The epilogue kernel also serves ``cllm::rotary_embedding`` (q and k given as separate tensors,
no v).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from compiled_llm.kernels import launch_configs
from compiled_llm.kernels.triton_common import next_pow2, pdl_launch, pdl_open, pdl_wait, use_pdl
from compiled_llm.kernels.triton_gemv import (
    input_chunk, int4_chunk, int4_constants, int4_step, matmul_wq, norm_stats, pair_aligned, row_stats,
    weight_config, tile_config, weight_itemsize, weight_tile,
)
from compiled_llm.kernels.triton_norm import rms_norm as tr_rms_norm


@triton.jit
def _norm_rope(x1, x2, w1, w2, cos, sin, eps,
               HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, HAS_ROPE: tl.constexpr):
    """Rows of a head as halves x1 = x[..., :D/2], x2 = x[..., D/2:] ([R, C] in the storage
    dtype; a row's masked lanes hold 0) -> fp32 (y1, y2): the per-head RMSNorm with weight halves
    w1, w2, then the rotate-halves RoPE with cos, sin ([R, C] fp32)."""
    dtype = x1.dtype
    y1 = x1.to(tl.float32)
    y2 = x2.to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(y1 * y1, 1) + tl.sum(y2 * y2, 1)) / HEAD_DIM + eps)[:, None]
        # the reference rounds the normalised row, then the weight product, to the input dtype
        y1 = ((y1 * rstd).to(dtype).to(tl.float32) * w1.to(tl.float32)).to(dtype).to(tl.float32)
        y2 = ((y2 * rstd).to(dtype).to(tl.float32) * w2.to(tl.float32)).to(dtype).to(tl.float32)
    if HAS_ROPE:
        r1 = y1 * cos - y2 * sin
        r2 = y2 * cos + y1 * sin
        y1 = r1
        y2 = r2
    return y1, y2


# ---------------------------------------------------------------------------------------------
# decode form: one launch from x to q/k/v
# ---------------------------------------------------------------------------------------------


@triton.jit
def _chunk_offsets(BLOCK_K: tl.constexpr, VEC: tl.constexpr, ONE_ROW: tl.constexpr):
    """Column offsets of one k chunk: [1, 1, BLOCK_K] (general form), or [1, BLOCK_K / VEC, VEC]
    with a thread's 16-byte vector on the last axis (one-row form, see
    triton_gemv._gemv_one_row_kernel)."""
    if ONE_ROW:
        offs = tl.arange(0, BLOCK_K // VEC)[None, :, None] * VEC + tl.arange(0, VEC)[None, None, :]
    else:
        offs = tl.arange(0, BLOCK_K)[None, None, :]
    return offs


@triton.jit
def _rows3(v, ONE_ROW: tl.constexpr):
    """A per-weight-row vector on the weight-row axis: 0 in the one-row form, 1 otherwise."""
    if ONE_ROW:
        r = v[:, None, None]
    else:
        r = v[None, :, None]
    return r


@triton.jit
def _product(xk, w, ONE_ROW: tl.constexpr):
    """What one k chunk adds to the accumulator: the one-row form sums each thread's vector at
    once ([BLOCK_P, BLOCK_K / VEC]), the general form keeps the whole tile."""
    if ONE_ROW:
        p = tl.sum(xk * w, 2)
    else:
        p = xk * w
    return p


@triton.jit
def _row_sums(acc, ONE_ROW: tl.constexpr):
    """The accumulator reduced over K as [BLOCK_T, BLOCK_P] (BLOCK_T = 1 in the one-row form)."""
    if ONE_ROW:
        y = tl.sum(acc, 1)[None, :]
    else:
        y = tl.sum(acc, 2)
    return y


@triton.jit
def _pair_constants(b_ptr, cs_rows, rows1, offs_p, mask_p, HALF: tl.constexpr,
                    HAS_BIAS: tl.constexpr, ROTATE: tl.constexpr):
    """What a block of rotation pairs needs besides x and the weights: the fp32 bias of rows
    rows1 and rows1 + HALF ([BLOCK_P]) and cos/sin at the rows' positions ([BLOCK_T, BLOCK_P]),
    zeros for what the kernel does not use."""
    b1 = tl.zeros(offs_p.shape, tl.float32)
    b2 = b1
    if HAS_BIAS:
        b1 = tl.load(b_ptr + rows1, mask=mask_p, other=0.0).to(tl.float32)
        b2 = tl.load(b_ptr + rows1 + HALF, mask=mask_p, other=0.0).to(tl.float32)
    cos = tl.zeros(offs_p.shape, tl.float32)[None, :]
    sin = cos
    if ROTATE:
        cos = tl.load(cs_rows + offs_p[None, :], mask=mask_p[None, :], other=0.0)
        sin = tl.load(cs_rows + HALF + offs_p[None, :], mask=mask_p[None, :], other=0.0)
    return b1, b2, cos, sin


@triton.jit
def _pair_rows_int4(x_ptr, w_ptr, s_ptr, z_ptr, nw_ptr, rows1, mask_p, t0, T, K, stride_x, stride_w, mean, rstd,
                    HALF: tl.constexpr, HAS_INPUT_NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP: tl.constexpr, VB: tl.constexpr):
    """The projection sums [BLOCK_T, BLOCK_P] of rows ``rows1`` and rows1 + HALF (a block of
    rotation pairs) for int4 weights, over all of K: one pass over x serves both halves
    (triton_gemv.int4_step)."""
    KB = K // 2
    groups = K // GROUP
    r1 = rows1.to(tl.int64)
    r2 = (rows1 + HALF).to(tl.int64)
    mean, rstd = row_stats(mean, BLOCK_T), row_stats(rstd, BLOCK_T)
    acc1 = tl.zeros([rows1.shape[0], BLOCK_K // (2 * VB), BLOCK_T], tl.float32)
    acc2 = acc1
    for kb in range(0, KB, BLOCK_K // 2):
        w1, s1, z1 = int4_chunk(w_ptr + r1 * stride_w, s_ptr + r1 * groups, z_ptr + r1 * groups, mask_p, kb, KB,
                                GROUP, BLOCK_K, VB)
        w2, s2, z2 = int4_chunk(w_ptr + r2 * stride_w, s_ptr + r2 * groups, z_ptr + r2 * groups, mask_p, kb, KB,
                                GROUP, BLOCK_K, VB)
        step1, step2 = int4_step(x_ptr, stride_x, t0, T, kb, KB, w1, s1, z1, w2, s2, z2, nw_ptr, nw_ptr, mean, rstd,
                                 HAS_INPUT_NORM, True, True, BLOCK_T, BLOCK_K, VB)
        acc1 += step1
        acc2 += step2
    return tl.trans(tl.sum(acc1, 1)), tl.trans(tl.sum(acc2, 1))


@triton.jit
def _qkv_decode_kernel(
    x_ptr, w_ptr, b_ptr, nw_ptr, pos_ptr, cs_ptr, s_ptr, z_ptr,
    q_out, k_out, v_out,
    T, K, stride_x, stride_w, stride_cs, stride_qt, stride_kt, stride_vt,
    norm_eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INPUT_NORM: tl.constexpr, HAS_ROPE: tl.constexpr,
    PDL: tl.constexpr = False, ONE_ROW: tl.constexpr = False, VEC: tl.constexpr = 8,
    SCALED: tl.constexpr = False, INT4: tl.constexpr = False, GROUP: tl.constexpr = 128, VB: tl.constexpr = 16,
):
    # PDL: launched while the previous kernel runs. The weights, bias, positions and cos/sin
    # need nothing from it, so the first weight tiles and the rotation factors are loaded before
    # the wait; x (its output) and every store come after.
    pdl_open(PDL)
    pid = tl.program_id(0)
    head = pid // SPLITS
    p_lo = (pid % SPLITS) * BLOCK_P
    p_hi = tl.minimum(p_lo + BLOCK_P, HALF)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    dtype = x_ptr.dtype.element_ty

    # where this head goes: rows of qkv_weight are [q heads | k heads | v heads] x HEAD_DIM
    is_qk = head < NUM_HEADS + NUM_KV_HEADS
    dst = q_out + head * HEAD_DIM
    stride_dt = stride_qt
    if head >= NUM_HEADS + NUM_KV_HEADS:
        dst = v_out + (head - NUM_HEADS - NUM_KV_HEADS) * HEAD_DIM
        stride_dt = stride_vt
    elif head >= NUM_HEADS:
        dst = k_out + (head - NUM_HEADS) * HEAD_DIM
        stride_dt = stride_kt
    dst_rows = dst + offs_t.to(tl.int64)[:, None] * stride_dt  # [BLOCK_T, 1]
    cs_rows = cs_ptr
    if HAS_ROPE:
        pos = tl.load(pos_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
        cs_rows = cs_ptr + pos[:, None] * stride_cs  # [BLOCK_T, 1]

    # software pipeline over the pairs: the first k chunk of each pair block's weight rows is
    # loaded one block ahead (the first block's before the PDL wait; int4 weights stream in
    # _pair_rows_int4, without it)
    offs_k0 = _chunk_offsets(BLOCK_K, VEC, ONE_ROW)
    mask_k0 = offs_k0 < K
    offs_p = p_lo + tl.arange(0, BLOCK_P)
    rows1 = head * HEAD_DIM + offs_p
    if not INT4:
        mask_w = _rows3(offs_p < p_hi, ONE_ROW) & mask_k0
        w1_next = weight_tile(w_ptr + _rows3(rows1.to(tl.int64), ONE_ROW) * stride_w, offs_k0, mask_w)
        w2_next = weight_tile(w_ptr + _rows3((rows1 + HALF).to(tl.int64), ONE_ROW) * stride_w, offs_k0, mask_w)
    b1_next, b2_next, cos_next, sin_next = _pair_constants(
        b_ptr, cs_rows, rows1, offs_p, offs_p < p_hi, HALF, HAS_BIAS, HAS_ROPE)
    pdl_wait(PDL)

    x_rows = x_ptr + offs_t.to(tl.int64)[:, None, None] * stride_x
    mask_t3 = mask_t[:, None, None]
    mean = tl.zeros([BLOCK_T, 1, 1], tl.float32)
    rstd = mean
    if HAS_INPUT_NORM:
        mean, rstd = norm_stats(x_rows, mask_t3, K, norm_eps, BLOCK_T, BLOCK_K, True)
    if not INT4:
        x_first = input_chunk(x_rows, mask_t3, offs_k0, mask_k0, nw_ptr, nw_ptr, mean, rstd, HAS_INPUT_NORM, True)

    for p0 in range(p_lo, p_hi, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        mask_p = offs_p < p_hi
        rows1 = head * HEAD_DIM + offs_p
        if INT4:  # int4 weights with groups of GROUP columns
            y1, y2 = _pair_rows_int4(x_ptr, w_ptr, s_ptr, z_ptr, nw_ptr, rows1, mask_p, tl.program_id(1) * BLOCK_T, T,
                                     K, stride_x, stride_w, mean, rstd, HALF, HAS_INPUT_NORM, BLOCK_T, BLOCK_K,
                                     GROUP, VB)
        else:
            w1_rows = w_ptr + _rows3(rows1.to(tl.int64), ONE_ROW) * stride_w
            w2_rows = w_ptr + _rows3((rows1 + HALF).to(tl.int64), ONE_ROW) * stride_w
            acc1 = _product(x_first, w1_next, ONE_ROW)
            acc2 = _product(x_first, w2_next, ONE_ROW)
            for k0 in range(BLOCK_K, K, BLOCK_K):
                offs_k = k0 + offs_k0
                mask_k = offs_k < K
                xk = input_chunk(x_rows, mask_t3, offs_k, mask_k, nw_ptr, nw_ptr, mean, rstd, HAS_INPUT_NORM, True)
                mask_w = _rows3(mask_p, ONE_ROW) & mask_k
                acc1 += _product(xk, weight_tile(w1_rows, offs_k, mask_w), ONE_ROW)
                acc2 += _product(xk, weight_tile(w2_rows, offs_k, mask_w), ONE_ROW)
            # the next block's first chunk streams while this block finishes (masked off past p_hi)
            mask_next = _rows3((offs_p + BLOCK_P) < p_hi, ONE_ROW) & mask_k0
            w1_next = weight_tile(w1_rows + BLOCK_P * stride_w, offs_k0, mask_next)
            w2_next = weight_tile(w2_rows + BLOCK_P * stride_w, offs_k0, mask_next)
        b1, b2, cos, sin = b1_next, b2_next, cos_next, sin_next
        b1_next, b2_next, cos_next, sin_next = _pair_constants(
            b_ptr, cs_rows, rows1 + BLOCK_P, offs_p + BLOCK_P, (offs_p + BLOCK_P) < p_hi, HALF,
            HAS_BIAS, HAS_ROPE)
        if not INT4:
            y1 = _row_sums(acc1, ONE_ROW)
            y2 = _row_sums(acc2, ONE_ROW)
        if SCALED:  # int8 weights: each output row's scale, once, after the K loop
            y1 *= tl.load(s_ptr + rows1, mask=mask_p, other=0.0)[None, :]
            y2 *= tl.load(s_ptr + rows1 + HALF, mask=mask_p, other=0.0)[None, :]
        if HAS_BIAS:
            y1 += b1[None, :]
            y2 += b2[None, :]
        # the reference rounds the projection (F.linear's output) before anything else
        y1 = y1.to(dtype)
        y2 = y2.to(dtype)
        if HAS_ROPE:  # the pair is complete here: rotate q/k in registers
            r1, r2 = _norm_rope(y1, y2, y1, y2, cos, sin, 0.0, HEAD_DIM, False, True)
            y1 = tl.where(is_qk, r1, y1.to(tl.float32)).to(dtype)
            y2 = tl.where(is_qk, r2, y2.to(tl.float32)).to(dtype)
        mask = mask_t[:, None] & mask_p[None, :]
        tl.store(dst_rows + offs_p[None, :], y1, mask=mask)
        tl.store(dst_rows + HALF + offs_p[None, :], y2, mask=mask)


def _decode(x, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight, positions, cos_sin,
            num_heads, num_kv_heads, head_dim, eps, norm_weight, norm_eps, scale=None, zero=None):
    """The decode form: one GEMV launch, with the per-head q/k norms (and so RoPE) in a second,
    the epilogue's: a head's norm needs all of its rows, and one program a head was 6 programs
    for Gemma-3-1B's q/k/v (69 us a layer, 1.8 of its 2.8 ms step). With ``scale`` (one fp32
    per row of the weight) the weight is int8, with ``zero`` too it is int4 [rows, H / 2] with a
    scale and zero point per group of columns, run by the kernel's INT4 form at every T
    (weight-only quantized, graph/quantized_ops.py)."""
    if q_norm_weight is not None:
        q, k, v = _decode(x, qkv_weight, qkv_bias, None, None, positions, None, num_heads, num_kv_heads, head_dim,
                          eps, norm_weight, norm_eps, scale, zero)
        q, k, _ = _epilogue(q, k, None, q_norm_weight, k_norm_weight, positions, cos_sin, eps)
        return q, k, v
    T, H = x.shape
    q = torch.empty((T, num_heads, head_dim), dtype=x.dtype, device=x.device)
    k = torch.empty((T, num_kv_heads, head_dim), dtype=x.dtype, device=x.device)
    v = torch.empty((T, num_kv_heads, head_dim), dtype=x.dtype, device=x.device)
    if T == 0:
        return q, k, v
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = qkv_weight if qkv_weight.stride(-1) == 1 else qkv_weight.contiguous()
    half = head_dim // 2
    has_rope = cos_sin is not None
    cfg = weight_config("qkv_decode", T, (w.shape[0], H), x, w, "BLOCK_K")
    tile = tile_config(cfg, T, half, H, weight_itemsize(w), rows_key="BLOCK_P")
    int4 = {}
    if zero is not None:  # the INT4 form reads x and the input norm's weight two columns to a word
        x = pair_aligned(x)
        norm_weight = pair_aligned(norm_weight) if norm_weight is not None else None
        int4 = int4_constants(H, scale, tile, x, row_sets=2)
    splits = triton.cdiv(half, tile["BLOCK_ROWS"])
    heads = num_heads + 2 * num_kv_heads
    grid = (heads * splits, triton.cdiv(T, tile["BLOCK_T"]))
    one_row = T == 1 and zero is None  # batch-1 decode: one fp32 accumulator per weight row and thread
    _qkv_decode_kernel[grid](
        x, w, qkv_bias if qkv_bias is not None else w,
        norm_weight if norm_weight is not None else w,
        positions, cos_sin if has_rope else w, scale if scale is not None else w, zero if zero is not None else w,
        q, k, v,
        T, H, x.stride(0), w.stride(0), cos_sin.stride(0) if has_rope else 0,
        q.stride(0), k.stride(0), v.stride(0),
        norm_eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        SPLITS=splits, BLOCK_T=tile["BLOCK_T"], BLOCK_P=tile["BLOCK_ROWS"], BLOCK_K=tile["BLOCK_K"],
        HAS_BIAS=qkv_bias is not None, HAS_INPUT_NORM=norm_weight is not None,
        HAS_ROPE=has_rope, PDL=use_pdl(x),
        ONE_ROW=one_row, VEC=16 // w.element_size(), SCALED=scale is not None and zero is None, **int4,
        num_warps=tile["num_warps"], num_stages=tile["num_stages"], **pdl_launch(use_pdl(x)),
    )
    return q, k, v


# ---------------------------------------------------------------------------------------------
# prefill form: epilogue after the cuBLAS projection (also rotary_embedding)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _head_epilogue(
    src, dst, mask_t, w_ptr, cs_rows, stride_d, eps,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_ROPE: tl.constexpr,
):
    """One head of BLOCK_T tokens: src/dst/cs_rows are [BLOCK_T, 1] row pointers, mask_t
    [BLOCK_T, 1] the rows that exist."""
    offs = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    mask = mask_t & (offs < HALF)
    x1 = tl.load(src + offs * stride_d, mask=mask, other=0.0)
    x2 = tl.load(src + (offs + HALF) * stride_d, mask=mask, other=0.0)
    w1 = x1  # placeholders, unused without the norm
    w2 = x2
    if HAS_NORM:
        w1 = tl.load(w_ptr + offs, mask=offs < HALF, other=0.0)
        w2 = tl.load(w_ptr + HALF + offs, mask=offs < HALF, other=0.0)
    cos = x1.to(tl.float32)  # placeholders, unused without RoPE
    sin = x2.to(tl.float32)
    if HAS_ROPE:
        cos = tl.load(cs_rows + offs, mask=mask, other=0.0)
        sin = tl.load(cs_rows + HALF + offs, mask=mask, other=0.0)
    y1, y2 = _norm_rope(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM, HAS_NORM, HAS_ROPE)
    tl.store(dst + offs, y1.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + offs, y2.to(dst.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T"])  # the step's token count: no compile per new value
def _qkv_epilogue_kernel(
    q_src, k_src, v_src, q_out, k_out, v_out,
    q_norm_ptr, k_norm_ptr, pos_ptr, cs_ptr,
    T,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cs, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HAS_V: tl.constexpr,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_ROPE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    # one head of BLOCK_T tokens per program: a program per (token, head) at prefill sizes
    # was thousands of one-warp programs doing 64 elements each
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = (offs_t < T)[:, None]
    t = offs_t.to(tl.int64)[:, None]
    h = tl.program_id(1)
    cs_rows = cs_ptr + t * 0
    if HAS_ROPE:
        pos = tl.load(pos_ptr + t, mask=mask_t, other=0).to(tl.int64)
        cs_rows = cs_ptr + pos * stride_cs
    if h < NUM_HEADS:
        _head_epilogue(
            q_src + t * stride_qt + h * stride_qh, q_out + (t * NUM_HEADS + h) * HEAD_DIM, mask_t,
            q_norm_ptr, cs_rows, stride_qd, eps, HEAD_DIM, HALF, BLOCK_HALF, HAS_NORM, HAS_ROPE,
        )
    elif h < NUM_HEADS + NUM_KV_HEADS:
        hk = h - NUM_HEADS
        _head_epilogue(
            k_src + t * stride_kt + hk * stride_kh, k_out + (t * NUM_KV_HEADS + hk) * HEAD_DIM, mask_t,
            k_norm_ptr, cs_rows, stride_kd, eps, HEAD_DIM, HALF, BLOCK_HALF, HAS_NORM, HAS_ROPE,
        )
    else:
        if HAS_V:
            hv = h - NUM_HEADS - NUM_KV_HEADS
            _head_epilogue(
                v_src + t * stride_vt + hv * stride_vh, v_out + (t * NUM_KV_HEADS + hv) * HEAD_DIM, mask_t,
                k_norm_ptr, cs_rows, stride_vd, eps, HEAD_DIM, HALF, BLOCK_HALF, False, False,
            )


def _epilogue(q_src, k_src, v_src, q_norm_weight, k_norm_weight, positions, cos_sin, eps):
    """q_src [T, Hq, D], k_src/v_src [T, Hkv, D] (any strides; v_src may be None) → fresh
    contiguous outputs."""
    T, num_heads, head_dim = q_src.shape
    num_kv_heads = k_src.shape[1]
    q = torch.empty((T, num_heads, head_dim), dtype=q_src.dtype, device=q_src.device)
    k = torch.empty((T, num_kv_heads, head_dim), dtype=k_src.dtype, device=k_src.device)
    v = torch.empty((T, num_kv_heads, head_dim), dtype=k_src.dtype, device=k_src.device) if v_src is not None else None
    if T == 0:
        return q, k, v
    has_norm = q_norm_weight is not None
    has_rope = cos_sin is not None
    v_in = v_src if v_src is not None else k_src
    heads = num_heads + num_kv_heads + (num_kv_heads if v_src is not None else 0)
    half = head_dim // 2
    cfg = launch_configs.get("qkv_epilogue", T)
    block_t = min(next_pow2(cfg.get("BLOCK_T", 1)), next_pow2(T))
    _qkv_epilogue_kernel[(triton.cdiv(T, block_t), heads)](
        q_src, k_src, v_in, q, k, v if v is not None else k,
        q_norm_weight if has_norm else q_src, k_norm_weight if has_norm else q_src,
        positions, cos_sin if has_rope else q_src,
        T,
        *q_src.stride(), *k_src.stride(), *v_in.stride(),
        cos_sin.stride(0) if has_rope else 0, eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HAS_V=v_src is not None,
        HEAD_DIM=head_dim, HALF=half, BLOCK_HALF=next_pow2(half),
        HAS_NORM=has_norm, HAS_ROPE=has_rope, BLOCK_T=block_t, num_warps=cfg["num_warps"],
    )
    return q, k, v


# ---------------------------------------------------------------------------------------------
# the ops
# ---------------------------------------------------------------------------------------------


def supports_shape(head_dim: int, has_q_norm: bool, has_k_norm: bool) -> bool:
    """The kernels pair halves of a head and normalise q and k together or not at all."""
    return head_dim % 2 == 0 and has_q_norm == has_k_norm


def use_decode_form(num_tokens: int) -> bool:
    return num_tokens <= launch_configs.get("qkv_dispatch", num_tokens)["MAX_TOKENS"]


def fused_qkv_rope(x, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight, positions, cos_sin,
                   num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                   norm_weight=None, norm_eps: float = 0.0, form: str | None = None):
    """(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) of x [T, H], as fused_ops.fused_qkv_rope_ref:
    x RMS-normalised first when ``norm_weight`` is given (eps ``norm_eps``), then projected, q/k
    normalised per head when q/k norm weights are given (eps ``eps``), q/k rotated when
    ``cos_sin`` is given. ``form`` forces "decode" (one GEMV kernel) or "prefill" (cuBLAS)."""
    T = x.shape[0]
    if form not in (None, "decode", "prefill"):
        raise ValueError(f"form must be None, 'decode' or 'prefill', not {form!r}")
    if (form or ("decode" if use_decode_form(T) else "prefill")) == "decode":
        return _decode(x, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight, positions, cos_sin,
                       num_heads, num_kv_heads, head_dim, eps, norm_weight, norm_eps)
    if norm_weight is not None:
        x = tr_rms_norm(x, norm_weight, norm_eps)
    qkv = F.linear(x, qkv_weight, qkv_bias)
    return _split_heads(qkv, q_norm_weight, k_norm_weight, positions, cos_sin, num_heads, num_kv_heads, head_dim, eps)


def _split_heads(qkv, q_norm_weight, k_norm_weight, positions, cos_sin, num_heads, num_kv_heads, head_dim, eps):
    """The prefill form's epilogue over the projection's output [T, (Hq + 2 Hkv) D]."""
    T = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q_src = qkv[:, :q_size].view(T, num_heads, head_dim)
    k_src = qkv[:, q_size:q_size + kv_size].view(T, num_kv_heads, head_dim)
    v_src = qkv[:, q_size + kv_size:].view(T, num_kv_heads, head_dim)
    return _epilogue(q_src, k_src, v_src, q_norm_weight, k_norm_weight, positions, cos_sin, eps)


def rotary_embedding(q, k, positions, cos_sin):
    q_out, k_out, _ = _epilogue(q, k, None, None, None, positions, cos_sin, 0.0)
    return q_out, k_out


def fused_qkv_rope_wq(x, qkv_qweight, qkv_scale, qkv_zero, qkv_bias, q_norm_weight, k_norm_weight, positions,
                      cos_sin, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                      norm_weight=None, norm_eps: float = 0.0):
    """``fused_qkv_rope`` with an int8 or int4 weight (weight-only quantized): the one-launch
    decode form, or at prefill sizes the projection (matmul_wq) and the epilogue."""
    T = x.shape[0]
    if use_decode_form(T):
        return _decode(x, qkv_qweight, qkv_bias, q_norm_weight, k_norm_weight, positions, cos_sin,
                       num_heads, num_kv_heads, head_dim, eps, norm_weight, norm_eps, qkv_scale, qkv_zero)
    if norm_weight is not None:
        x = tr_rms_norm(x, norm_weight, norm_eps)
    qkv = matmul_wq(x, qkv_qweight, qkv_scale, qkv_zero, qkv_bias)
    return _split_heads(qkv, q_norm_weight, k_norm_weight, positions, cos_sin, num_heads, num_kv_heads, head_dim, eps)
