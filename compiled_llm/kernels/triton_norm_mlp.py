"""Triton fused norm + MLP, in two forms chosen by the number of tokens T, each with an optional
residual added after the MLP (``h + mlp(norm(h))`` in one op).

Decode form (T <= MAX_DECODE_TOKENS): two weight-streaming launches (see triton_gemv).
  1. ``_norm_mlp_decode_kernel``, grid (cdiv(I, BLOCK_I), cdiv(T, BLOCK_T)): a program owns
     BLOCK_I intermediate rows, i.e. gate rows i and the matching up rows i + I of the merged
     [2I, H] weight (or fc rows). It recomputes the norm statistics of its BLOCK_T rows of x (x is
     tiny and stays cached), streams its weight rows once along H in 16-byte vectors, multiplies
     them by the normalised rows with FMAs (no tl.dot: at a few rows tensor-core tiles are mostly
     padding), and writes act(gate) * up (or gelu-tanh(fc + b)) as act [T, I], act being silu
     (SwiGLU) or gelu-tanh (GeGLU), a constexpr of the kernel (GATE_GELU).
  2. the down (or proj) GEMV over act with bias and residual in its epilogue
     (``triton_gemv.gemv``, launch-config table "norm_mlp_down").
  At one row (batch-1 decode) both launches use the one-row forms (``_norm_mlp_one_row_kernel``
  and triton_gemv's): one fp32 accumulator per weight row and thread instead of a whole tile.
  Weight-only quantized weights (``*_wq``): int8 in either form, int4 in the general kernels' INT4
  forms (triton_gemv.int4_step).
Deterministic: no atomics, so greedy decoding repeats exactly.

Prefill form (large T): Triton norm -> cuBLAS matmul -> Triton activation -> cuBLAS matmul, the
residual folded into the last one (addmm) when there is no bias. When the residual is the MLP's
own input (``h + mlp(norm(h))``, every Llama/Qwen layer) the norm launch also writes the copy of h
that the last matmul accumulates into in place, which saves addmm's memcpy launch. At large T the matmuls are
compute-bound and cuBLAS beats a hand-written Triton GEMM. Weight-only quantized weights run
their two matmuls through triton_gemv.matmul_wq (the quantized GEMM, or dequantize + cuBLAS),
the residual in the second one's epilogue.

Both round intermediates (the gate/up outputs, the gate's activation, the product, the MLP output
before the residual) to the input dtype where the unfused graph does, so they agree with the
references to within accumulation order (the prefill addmm rounds the residual sum once instead of
twice).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from compiled_llm.graph.fused_ops import GLU_ACTIVATIONS
from compiled_llm.kernels import launch_configs
from compiled_llm.kernels.triton_common import pdl_launch, pdl_open, pdl_wait, use_pdl
from compiled_llm.kernels.triton_common import next_pow2
from compiled_llm.kernels.triton_gemm_wq import supports as gemm_supports
from compiled_llm.kernels.triton_gemv import (
    VECTOR_BYTES, dense_linear, gemv, input_chunk, int4_chunk, int4_constants, int4_step, matmul_wq, norm_stats,
    pair_aligned, row_stats, streams_quantized, tile_config, weight_config, weight_itemsize, weight_tile,
)
from compiled_llm.kernels.triton_norm import layer_norm as tr_layer_norm
from compiled_llm.kernels.triton_norm import rms_norm as tr_rms_norm
from compiled_llm.kernels.triton_norm import rms_norm_and_copy as tr_rms_norm_and_copy

SQRT_2_OVER_PI = 0.7978845608028654
SQRT_2_OVER_PI_C = tl.constexpr(SQRT_2_OVER_PI)


@triton.jit
def _gelu_tanh(h):
    # tanh(z) = 2 sigmoid(2z) - 1 (tl has no portable tanh across Triton versions)
    z = SQRT_2_OVER_PI_C * (h + 0.044715 * h * h * h)
    return 0.5 * h * (1.0 + (2.0 * tl.sigmoid(2.0 * z) - 1.0))


@triton.jit
def _gate_activation(g, GATE_GELU: tl.constexpr):
    """A GLU's gate activation in fp32: silu (SwiGLU) or gelu_tanh (GeGLU). A constexpr, so the
    SwiGLU kernels compile exactly as they did before GeGLU existed."""
    if GATE_GELU:
        a = _gelu_tanh(g)
    else:
        a = g * tl.sigmoid(g)
    return a


@triton.jit
def _activation(y1, y3, b1, act_ptr, IS_GLU: tl.constexpr, GATE_GELU: tl.constexpr = False):
    """fp32 activation of the first projection's fp32 sums, with the reference's roundings to
    act_ptr's dtype: act(gate) * up (GLU: y1 gate, y3 up; F.linear rounds both, F.silu or F.gelu
    rounds its output, the product rounds again) or gelu_tanh(fc + b1) (y1 fc, rounded once with
    its bias)."""
    dtype = act_ptr.dtype.element_ty
    if IS_GLU:
        g = y1.to(dtype).to(tl.float32)
        u = y3.to(dtype).to(tl.float32)
        act = _gate_activation(g, GATE_GELU).to(dtype).to(tl.float32) * u
    else:
        act = _gelu_tanh((y1 + b1).to(dtype).to(tl.float32))
    return act


@triton.jit
def _norm_mlp_int4(x_ptr, nw_ptr, nb_ptr, w1_ptr, s1_ptr, z1_ptr, offs_i, mask_i, T, H, I, eps, stride_x, stride_w1,
                   IS_RMS: tl.constexpr, IS_GLU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                   GROUP: tl.constexpr, VB: tl.constexpr, PDL: tl.constexpr):
    """``_norm_mlp_decode_kernel``'s first-projection sums for int4 weights: (gate, up) or
    (fc, fc), each [BLOCK_T, BLOCK_I]; one pass over norm(x) serves the gate and up rows
    (triton_gemv.int4_step)."""
    HB = H // 2
    groups = H // GROUP
    rows1 = offs_i.to(tl.int64)
    rows3 = (offs_i + I).to(tl.int64)
    t0 = tl.program_id(1) * BLOCK_T
    # the first chunks need nothing from the previous kernel: stream them while it finishes
    # (PDL), then wait before touching x
    w1, s1, z1 = int4_chunk(w1_ptr + rows1 * stride_w1, s1_ptr + rows1 * groups, z1_ptr + rows1 * groups, mask_i,
                            0, HB, GROUP, BLOCK_H, VB)
    w3, s3, z3 = w1, s1, z1
    if IS_GLU:
        w3, s3, z3 = int4_chunk(w1_ptr + rows3 * stride_w1, s1_ptr + rows3 * groups, z1_ptr + rows3 * groups,
                                mask_i, 0, HB, GROUP, BLOCK_H, VB)
    pdl_wait(PDL)
    offs_t = t0 + tl.arange(0, BLOCK_T)
    mean, rstd = norm_stats(x_ptr + offs_t.to(tl.int64)[:, None, None] * stride_x, (offs_t < T)[:, None, None],
                            H, eps, BLOCK_T, BLOCK_H, IS_RMS)
    mean, rstd = row_stats(mean, BLOCK_T), row_stats(rstd, BLOCK_T)
    acc1, acc3 = int4_step(x_ptr, stride_x, t0, T, 0, HB, w1, s1, z1, w3, s3, z3, nw_ptr, nb_ptr, mean, rstd,
                           True, IS_RMS, IS_GLU, BLOCK_T, BLOCK_H, VB)
    for hb in range(BLOCK_H // 2, HB, BLOCK_H // 2):
        w1, s1, z1 = int4_chunk(w1_ptr + rows1 * stride_w1, s1_ptr + rows1 * groups, z1_ptr + rows1 * groups,
                                mask_i, hb, HB, GROUP, BLOCK_H, VB)
        w3, s3, z3 = w1, s1, z1
        if IS_GLU:
            w3, s3, z3 = int4_chunk(w1_ptr + rows3 * stride_w1, s1_ptr + rows3 * groups, z1_ptr + rows3 * groups,
                                    mask_i, hb, HB, GROUP, BLOCK_H, VB)
        step1, step3 = int4_step(x_ptr, stride_x, t0, T, hb, HB, w1, s1, z1, w3, s3, z3, nw_ptr, nb_ptr, mean, rstd,
                                 True, IS_RMS, IS_GLU, BLOCK_T, BLOCK_H, VB)
        acc1 += step1
        if IS_GLU:
            acc3 += step3
    y1 = tl.trans(tl.sum(acc1, 1))
    y3 = y1
    if IS_GLU:
        y3 = tl.trans(tl.sum(acc3, 1))
    return y1, y3


@triton.jit
def _norm_mlp_decode_kernel(
    x_ptr, nw_ptr, nb_ptr, w1_ptr, b1_ptr, act_ptr, s1_ptr, z1_ptr,
    T, H, I, eps,
    stride_x, stride_w1, stride_a,
    IS_RMS: tl.constexpr, IS_GLU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False,
    SCALED: tl.constexpr = False, INT4: tl.constexpr = False, GROUP: tl.constexpr = 128, VB: tl.constexpr = 16,
    GATE_GELU: tl.constexpr = False,
):
    """act[t, i] for BLOCK_T rows t and BLOCK_I intermediate rows i: norm(x) against gate row i
    and up row i + I of w1 = [gate; up] (GLU; GATE_GELU: GeGLU rather than SwiGLU), or against
    fc row i (GELU), streamed along H."""
    pdl_open(PDL)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_t = offs_t < T
    mask_i = offs_i < I
    if INT4:  # int4 weights with groups of GROUP columns: see triton_gemv.int4_step
        dtype = act_ptr.dtype.element_ty
        y1, y3 = _norm_mlp_int4(x_ptr, nw_ptr, nb_ptr, w1_ptr, s1_ptr, z1_ptr, offs_i, mask_i, T, H, I, eps,
                                stride_x, stride_w1, IS_RMS, IS_GLU, BLOCK_T, BLOCK_H, GROUP, VB, PDL)
        b1 = tl.zeros([1, BLOCK_I], tl.float32)
        if not IS_GLU:
            b1 = tl.load(b1_ptr + offs_i, mask=mask_i, other=0.0).to(tl.float32)[None, :]
    else:
        x_rows = x_ptr + offs_t.to(tl.int64)[:, None, None] * stride_x
        mask_t3 = mask_t[:, None, None]
        mask_i3 = mask_i[None, :, None]
        w1_rows = w1_ptr + offs_i.to(tl.int64)[None, :, None] * stride_w1
        w3_rows = w1_ptr + (offs_i + I).to(tl.int64)[None, :, None] * stride_w1

        # the first weight tiles need nothing from the previous kernel: stream them while it
        # finishes (PDL), then wait before touching x
        offs_h = tl.arange(0, BLOCK_H)[None, None, :]
        mask_h = offs_h < H
        w1_first = weight_tile(w1_rows, offs_h, mask_i3 & mask_h)
        w3_first = w1_first
        if IS_GLU:
            w3_first = weight_tile(w3_rows, offs_h, mask_i3 & mask_h)
        pdl_wait(PDL)

        # x is a few rows, kept cached (the weight loads are evict-first): every program recomputes
        # their statistics rather than wait for another
        mean, rstd = norm_stats(x_rows, mask_t3, H, eps, BLOCK_T, BLOCK_H, IS_RMS)
        n = input_chunk(x_rows, mask_t3, offs_h, mask_h, nw_ptr, nb_ptr, mean, rstd, True, IS_RMS)
        acc1 = n * w1_first
        acc3 = tl.zeros([BLOCK_T, BLOCK_I, BLOCK_H], tl.float32)
        if IS_GLU:
            acc3 = n * w3_first
        for h0 in range(BLOCK_H, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)[None, None, :]
            mask_h = offs_h < H
            n = input_chunk(x_rows, mask_t3, offs_h, mask_h, nw_ptr, nb_ptr, mean, rstd, True, IS_RMS)
            acc1 += n * weight_tile(w1_rows, offs_h, mask_i3 & mask_h)
            if IS_GLU:
                acc3 += n * weight_tile(w3_rows, offs_h, mask_i3 & mask_h)

        dtype = act_ptr.dtype.element_ty
        y1 = tl.sum(acc1, 2)
        if SCALED:  # int8 weights: each output row's scale, once, after the H loop
            y1 *= tl.load(s1_ptr + offs_i, mask=mask_i, other=0.0)[None, :]
        y3 = y1
        b1 = tl.zeros([1, BLOCK_I], tl.float32)
        if IS_GLU:
            y3 = tl.sum(acc3, 2)
            if SCALED:
                y3 *= tl.load(s1_ptr + offs_i + I, mask=mask_i, other=0.0)[None, :]
        else:
            b1 = tl.load(b1_ptr + offs_i, mask=mask_i, other=0.0).to(tl.float32)[None, :]
    act = _activation(y1, y3, b1, act_ptr, IS_GLU, GATE_GELU)
    # the activation goes to memory ([T, I] is tiny at decode sizes) for the down GEMV; summing
    # down's partial products here with atomics would save that launch but make the sum order
    # (and so greedy decoding in bf16) vary from run to run
    act_rows = act_ptr + offs_t.to(tl.int64)[:, None] * stride_a
    tl.store(act_rows + offs_i[None, :], act.to(dtype), mask=mask_t[:, None] & mask_i[None, :])


@triton.jit
def _norm_mlp_one_row_kernel(
    x_ptr, nw_ptr, nb_ptr, w1_ptr, b1_ptr, act_ptr, s1_ptr,
    H, I, eps, stride_w1,
    IS_RMS: tl.constexpr, IS_GLU: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, VEC: tl.constexpr, PDL: tl.constexpr = False,
    SCALED: tl.constexpr = False, GATE_GELU: tl.constexpr = False,
):
    """``_norm_mlp_decode_kernel`` for one row of x (batch-1 decode), with the one-row GEMV's
    layout (see triton_gemv._gemv_one_row_kernel): weight tiles [BLOCK_I, BLOCK_H / VEC, VEC],
    each thread's 16-byte vector summed inside the thread every step, one fp32 accumulator per
    weight row and thread. Same norm, roundings and activation as the general kernel."""
    pdl_open(PDL)
    KC: tl.constexpr = BLOCK_H // VEC
    offs_i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < I
    mask_i3 = mask_i[:, None, None]
    offs_c = tl.arange(0, KC)[None, :, None] * VEC + tl.arange(0, VEC)[None, None, :]  # [1, KC, VEC]
    w1_rows = w1_ptr + offs_i.to(tl.int64)[:, None, None] * stride_w1
    w3_rows = w1_ptr + (offs_i + I).to(tl.int64)[:, None, None] * stride_w1
    # the norm helpers take [rows, 1, 1] pointers: here one row
    x_rows = x_ptr + tl.zeros([1, 1, 1], tl.int64)
    row_ok = tl.full([1, 1, 1], 1, tl.int1)

    # the first weight tiles (and the fc bias) need nothing from the previous kernel: stream them
    # while it finishes (PDL), then wait before touching x
    mask_h = offs_c < H
    w1_first = weight_tile(w1_rows, offs_c, mask_i3 & mask_h)
    w3_first = w1_first
    if IS_GLU:
        w3_first = weight_tile(w3_rows, offs_c, mask_i3 & mask_h)
    b1 = tl.zeros([BLOCK_I], tl.float32)
    if not IS_GLU:
        b1 = tl.load(b1_ptr + offs_i, mask=mask_i, other=0.0).to(tl.float32)
    pdl_wait(PDL)

    mean, rstd = norm_stats(x_rows, row_ok, H, eps, 1, BLOCK_H, IS_RMS)
    n = input_chunk(x_rows, row_ok, offs_c, mask_h, nw_ptr, nb_ptr, mean, rstd, True, IS_RMS)
    acc1 = tl.sum(n * w1_first, 2)
    acc3 = acc1
    if IS_GLU:
        acc3 = tl.sum(n * w3_first, 2)
    for h0 in range(BLOCK_H, H, BLOCK_H):
        offs_h = h0 + offs_c
        mask_h = offs_h < H
        n = input_chunk(x_rows, row_ok, offs_h, mask_h, nw_ptr, nb_ptr, mean, rstd, True, IS_RMS)
        acc1 += tl.sum(n * weight_tile(w1_rows, offs_h, mask_i3 & mask_h), 2)
        if IS_GLU:
            acc3 += tl.sum(n * weight_tile(w3_rows, offs_h, mask_i3 & mask_h), 2)

    y1 = tl.sum(acc1, 1)
    if SCALED:  # int8 weights: each output row's scale, once, after the H loop
        y1 *= tl.load(s1_ptr + offs_i, mask=mask_i, other=0.0)
    y3 = y1
    if IS_GLU:
        y3 = tl.sum(acc3, 1)
        if SCALED:
            y3 *= tl.load(s1_ptr + offs_i + I, mask=mask_i, other=0.0)
    act = _activation(y1, y3, b1, act_ptr, IS_GLU, GATE_GELU)
    tl.store(act_ptr + offs_i, act.to(act_ptr.dtype.element_ty), mask=mask_i)


@triton.jit
def _act_kernel(
    in_ptr, out_ptr, I, stride_in, stride_out,
    IS_GLU: tl.constexpr, BLOCK: tl.constexpr, GATE_GELU: tl.constexpr = False,
):
    """act(gate) * up from rows [gate | up] of width 2I (act silu, or gelu-tanh with GATE_GELU),
    or gelu-tanh(h) of width I."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    dtype = out_ptr.dtype.element_ty
    a = tl.load(in_ptr + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    if IS_GLU:
        u = tl.load(in_ptr + row * stride_in + I + offs, mask=mask, other=0.0).to(tl.float32)
        y = _gate_activation(a, GATE_GELU).to(dtype).to(tl.float32) * u
    else:
        y = _gelu_tanh(a)
    tl.store(out_ptr + row * stride_out + offs, y.to(dtype), mask=mask)


def gate_gelu(activation: str) -> bool:
    """The kernels' GATE_GELU for a GLU activation name (fused_ops.GLU_ACTIVATIONS): whether the
    gate's activation is gelu_tanh (GeGLU) rather than silu. An unknown name is a ValueError (a
    tampered program.json), never silently silu."""
    if activation not in GLU_ACTIVATIONS:
        raise ValueError(f"unknown GLU activation {activation!r}; known: {', '.join(GLU_ACTIVATIONS)}")
    return activation == "gelu_tanh"


def glu_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """[T, 2I] (gate | up) -> act(gate) * up [T, I], act named by ``activation``."""
    return _act(gate_up, True, gate_gelu(activation))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    return glu_mul(gate_up, "silu")


def gelu_tanh(h: torch.Tensor) -> torch.Tensor:
    return _act(h, False)


def _act(inp: torch.Tensor, is_glu: bool, gelu_gate: bool = False) -> torch.Tensor:
    T = inp.shape[0]
    width = inp.shape[1] // 2 if is_glu else inp.shape[1]
    out = torch.empty((T, width), dtype=inp.dtype, device=inp.device)
    if T == 0:
        return out
    inp = inp if inp.stride(-1) == 1 else inp.contiguous()
    cfg = launch_configs.get("act", T)
    block = min(cfg["BLOCK"], next_pow2(width))
    _act_kernel[(T, triton.cdiv(width, block))](
        inp, out, width, inp.stride(0), out.stride(0),
        IS_GLU=is_glu, BLOCK=block, GATE_GELU=gelu_gate, num_warps=cfg["num_warps"],
    )
    return out


def decode_activation(x2, norm_weight, norm_bias, eps: float, w1, b1, is_rms: bool, is_glu: bool,
                      scale1=None, zero1=None, activation: str = "silu") -> torch.Tensor:
    """The decode form's first kernel: act [T, I] = act(gate(n)) * up(n) (GLU; w1 = [gate; up]
    of [2I, H]; act named by ``activation``) or gelu_tanh(fc(n) + b1) (w1 = fc [I, H]), n =
    norm(x2). With ``scale1`` (one fp32 per row of w1), w1 is int8; with ``zero1`` too, w1 is
    int4 [rows, H / 2] with a scale and zero point per group of columns, run by the general
    kernel's INT4 form at every T (weight-only quantized, graph/quantized_ops.py)."""
    T, H = x2.shape
    gelu_gate = is_glu and gate_gelu(activation)
    inter = w1.shape[0] // 2 if is_glu else w1.shape[0]
    act = torch.empty((T, inter), dtype=x2.dtype, device=x2.device)
    if T == 0:
        return act
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    w1 = w1 if w1.stride(-1) == 1 else w1.contiguous()
    itemsize = weight_itemsize(w1)
    cfg = weight_config("norm_mlp_decode", T, (w1.shape[0], H), x2, w1, "BLOCK_H")
    tile = tile_config(cfg, T, inter, H, itemsize, rows_key="BLOCK_I", k_key="BLOCK_H")
    pdl = use_pdl(x2)
    s1 = scale1 if scale1 is not None else w1
    int4 = {}
    if zero1 is not None:  # the INT4 form reads x and the norm's weights two columns to a word
        x2, norm_weight = pair_aligned(x2), pair_aligned(norm_weight)
        norm_bias = pair_aligned(norm_bias) if norm_bias is not None else None
        int4 = int4_constants(H, scale1, tile, x2, row_sets=2 if is_glu else 1)
    elif T == 1:
        _norm_mlp_one_row_kernel[(triton.cdiv(inter, tile["BLOCK_ROWS"]),)](
            x2, norm_weight, norm_bias if norm_bias is not None else norm_weight,
            w1, b1 if b1 is not None else norm_weight, act, s1,
            H, inter, eps, w1.stride(0),
            IS_RMS=is_rms, IS_GLU=is_glu,
            BLOCK_I=tile["BLOCK_ROWS"], BLOCK_H=tile["BLOCK_K"], VEC=VECTOR_BYTES // itemsize, PDL=pdl,
            SCALED=scale1 is not None, GATE_GELU=gelu_gate,
            num_warps=tile["num_warps"], num_stages=tile["num_stages"], **pdl_launch(pdl),
        )
        return act
    grid = (triton.cdiv(inter, tile["BLOCK_ROWS"]), triton.cdiv(T, tile["BLOCK_T"]))
    _norm_mlp_decode_kernel[grid](
        x2, norm_weight, norm_bias if norm_bias is not None else norm_weight,
        w1, b1 if b1 is not None else norm_weight, act, s1, zero1 if zero1 is not None else w1,
        T, H, inter, eps,
        x2.stride(0), w1.stride(0), act.stride(0),
        IS_RMS=is_rms, IS_GLU=is_glu,
        BLOCK_T=tile["BLOCK_T"], BLOCK_I=tile["BLOCK_ROWS"], BLOCK_H=tile["BLOCK_K"], PDL=pdl,
        SCALED=scale1 is not None and zero1 is None, GATE_GELU=gelu_gate, **int4,
        num_warps=tile["num_warps"], num_stages=tile["num_stages"], **pdl_launch(pdl),
    )
    return act


def _decode(x2, norm_weight, norm_bias, eps, w1, b1, w2, b2, residual2, is_rms: bool, is_glu: bool,
            scale1=None, scale2=None, zero1=None, zero2=None, activation: str = "silu"):
    """Two launches: norm + first projection + activation (the GLU's named by ``activation``),
    then the down/proj GEMV with the bias and residual in its epilogue (int8 or int4 weights with
    their scales and zero points, when given)."""
    act = decode_activation(x2, norm_weight, norm_bias, eps, w1, b1, is_rms, is_glu, scale1, zero1, activation)
    return gemv(act, w2, b2, residual2, config="norm_mlp_down", scale=scale2, zero=zero2)


def use_decode_form(num_tokens: int) -> bool:
    return num_tokens <= launch_configs.get("norm_mlp_dispatch", num_tokens)["MAX_DECODE_TOKENS"]


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b are the same [T, H] rows in memory (the residual is the MLP's own input)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _pick_form(T: int, form: str | None) -> str:
    if form not in (None, "decode", "prefill"):
        raise ValueError(f"form must be None, 'decode' or 'prefill', not {form!r}")
    return form or ("decode" if use_decode_form(T) else "prefill")


def fused_rms_norm_glu_mlp(x, norm_weight, eps: float, gate_up_weight, down_weight, residual=None,
                           activation: str = "silu", form: str | None = None):
    """down(act(gate(n)) * up(n)) (+ residual), n = rms_norm(x), act "silu" or "gelu_tanh"
    (``activation``); ``form`` forces "decode"/"prefill". The MLP output is rounded to the dtype
    before the residual is added."""
    x2 = _flat(x)
    T = x2.shape[0]
    out_shape = (*x.shape[:-1], down_weight.shape[0])
    if T == 0:
        return x.new_empty(out_shape)
    r2 = _flat(residual) if residual is not None else None
    if _pick_form(T, form) == "decode":
        out = _decode(x2, norm_weight, None, eps, gate_up_weight, None, down_weight, None, r2, True, True,
                      activation=activation)
    elif r2 is not None and _same_rows(r2, x2):
        # h + mlp(norm(h)): the norm launch also copies h, and down accumulates into that copy in
        # place (beta = 1), so addmm does not copy the residual in a memcpy launch of its own
        n, out = tr_rms_norm_and_copy(x2, norm_weight, eps)
        out.addmm_(glu_mul(F.linear(n, gate_up_weight), activation), down_weight.t())
    else:
        n = tr_rms_norm(x2, norm_weight, eps)
        out = dense_linear(glu_mul(F.linear(n, gate_up_weight), activation), down_weight, None, r2)
    return out.view(out_shape)


def fused_layer_norm_gelu_mlp(x, norm_weight, norm_bias, eps: float, fc_weight, fc_bias, proj_weight, proj_bias,
                              residual=None, form: str | None = None):
    """proj(gelu_tanh(fc(n))) (+ residual), n = layer_norm(x); ``form`` forces
    "decode"/"prefill". The MLP output is rounded to the dtype before the residual is added."""
    x2 = _flat(x)
    T = x2.shape[0]
    out_shape = (*x.shape[:-1], proj_weight.shape[0])
    if T == 0:
        return x.new_empty(out_shape)
    r2 = _flat(residual) if residual is not None else None
    if _pick_form(T, form) == "decode":
        out = _decode(x2, norm_weight, norm_bias, eps, fc_weight, fc_bias, proj_weight, proj_bias, r2, False, False)
    else:
        n = tr_layer_norm(x2, norm_weight, norm_bias, eps)
        # fc bias inside the cuBLAS epilogue: one rounding, as in the reference
        out = dense_linear(gelu_tanh(F.linear(n, fc_weight, fc_bias)), proj_weight, proj_bias, r2)
    return out.view(out_shape)


# ---------------------------------------------------------------------------------------------
# weight-only int8 and int4 (graph/quantized_ops.py): both forms with quantized weights
# ---------------------------------------------------------------------------------------------


def takes_quantized(qweights: tuple, scales: tuple, zeros: tuple, T: int) -> bool:
    """Whether the kernels take a quantized MLP call: at decode sizes, weights the decode form
    streams (int8, or int4 in groups they tile; see triton_gemv.streams_quantized), at prefill
    sizes weights the quantized GEMM takes (triton_gemm_wq.supports); others run the op's
    reference (dequantize, then cuBLAS)."""
    takes = streams_quantized if use_decode_form(T) else gemm_supports
    return all(map(takes, qweights, scales, zeros))


def fused_rms_norm_glu_mlp_wq(x, norm_weight, eps: float, gate_up_qweight, gate_up_scale, gate_up_zero,
                              down_qweight, down_scale, down_zero, residual=None, activation: str = "silu"):
    """``fused_rms_norm_glu_mlp`` with int8 or int4 weights (``takes_quantized`` says which
    calls): the decode form, or at prefill sizes the norm kernel and two quantized matmuls
    (triton_gemv.matmul_wq)."""
    x2 = _flat(x)
    r2 = _flat(residual) if residual is not None else None
    if use_decode_form(x2.shape[0]):
        out = _decode(x2, norm_weight, None, eps, gate_up_qweight, None, down_qweight, None, r2, True, True,
                      gate_up_scale, down_scale, gate_up_zero, down_zero, activation)
    else:
        n = tr_rms_norm(x2, norm_weight, eps)
        act = glu_mul(matmul_wq(n, gate_up_qweight, gate_up_scale, gate_up_zero), activation)
        out = matmul_wq(act, down_qweight, down_scale, down_zero, None, r2)
    return out.view(*x.shape[:-1], down_qweight.shape[0])


def fused_layer_norm_gelu_mlp_wq(x, norm_weight, norm_bias, eps: float, fc_qweight, fc_scale, fc_zero, fc_bias,
                                 proj_qweight, proj_scale, proj_zero, proj_bias, residual=None):
    """``fused_layer_norm_gelu_mlp`` with int8 or int4 weights (``takes_quantized`` says which
    calls): the decode form, or at prefill sizes the norm kernel and two quantized matmuls
    (triton_gemv.matmul_wq)."""
    x2 = _flat(x)
    r2 = _flat(residual) if residual is not None else None
    if use_decode_form(x2.shape[0]):
        out = _decode(x2, norm_weight, norm_bias, eps, fc_qweight, fc_bias, proj_qweight, proj_bias, r2, False,
                      False, fc_scale, proj_scale, fc_zero, proj_zero)
    else:
        n = tr_layer_norm(x2, norm_weight, norm_bias, eps)
        act = gelu_tanh(matmul_wq(n, fc_qweight, fc_scale, fc_zero, fc_bias))
        out = matmul_wq(act, proj_qweight, proj_scale, proj_zero, proj_bias, r2)
    return out.view(*x.shape[:-1], proj_qweight.shape[0])
