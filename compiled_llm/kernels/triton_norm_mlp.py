"""Triton fused norm + MLP, in two forms chosen by the number of tokens T.

Decode form (small T): ``_norm_mlp_decode_kernel``, grid (cdiv(I, BLOCK_I), cdiv(T, BLOCK_T)).
Decode is bound by reading the weights, so each program streams its own chunk of the
intermediate dimension exactly once: it recomputes the norm statistics of its BLOCK_T rows of x
(x is tiny and stays in L2), multiplies the normalised rows by its gate/up (or fc) rows,
applies silu·mul (or bias + gelu-tanh) and writes its [T, chunk] activation; one cuBLAS GEMM
then applies down (or proj). Deterministic: no atomics, so greedy decoding repeats exactly.
Rows are padded to BLOCK_T >= 16 so tl.dot runs on tensor cores.

Prefill form (large T): Triton norm -> cuBLAS matmul -> Triton activation -> cuBLAS matmul.
At large T the matmuls are compute-bound and cuBLAS beats a hand-written Triton GEMM.

Both round intermediates (the gate/up outputs, silu, the product) to the input dtype where the
unfused graph does, so they agree with the references to within accumulation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from compiled_llm.kernels import launch_configs
from compiled_llm.kernels.triton_common import dot, is_fp32, next_pow2
from compiled_llm.kernels.triton_norm import layer_norm as tr_layer_norm
from compiled_llm.kernels.triton_norm import rms_norm as tr_rms_norm

SQRT_2_OVER_PI = 0.7978845608028654
SQRT_2_OVER_PI_C = tl.constexpr(SQRT_2_OVER_PI)


@triton.jit
def _gelu_tanh(h):
    # tanh(z) = 2 sigmoid(2z) - 1 (tl has no portable tanh across Triton versions)
    z = SQRT_2_OVER_PI_C * (h + 0.044715 * h * h * h)
    return 0.5 * h * (1.0 + (2.0 * tl.sigmoid(2.0 * z) - 1.0))


@triton.jit
def _norm_mlp_decode_kernel(
    x_ptr, nw_ptr, nb_ptr, w1_ptr, b1_ptr, act_ptr,
    T, H, I, eps,
    stride_x, stride_w1, stride_a,
    IS_RMS: tl.constexpr, IS_GLU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, IEEE: tl.constexpr,
):
    pid_i = tl.program_id(0)
    pid_t = tl.program_id(1)
    dtype = x_ptr.dtype.element_ty
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_t = offs_t < T
    mask_i = offs_i < I
    x_rows = x_ptr + offs_t.to(tl.int64)[:, None] * stride_x

    # norm statistics of this program's rows (two passes for LayerNorm: exact variance)
    mean = tl.zeros([BLOCK_T], tl.float32)
    if not IS_RMS:
        s1 = tl.zeros([BLOCK_T], tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            xm = mask_t[:, None] & (offs_h < H)[None, :]
            s1 += tl.sum(tl.load(x_rows + offs_h[None, :], mask=xm, other=0.0).to(tl.float32), 1)
        mean = s1 / H
    s2 = tl.zeros([BLOCK_T], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        xm = mask_t[:, None] & (offs_h < H)[None, :]
        xc = tl.load(x_rows + offs_h[None, :], mask=xm, other=0.0).to(tl.float32) - mean[:, None]
        xc = tl.where(xm, xc, 0.0)
        s2 += tl.sum(xc * xc, 1)
    rstd = tl.rsqrt(s2 / H + eps)

    # first projection(s) of the normalised rows: [BLOCK_T, BLOCK_I]
    acc1 = tl.zeros([BLOCK_T, BLOCK_I], tl.float32)
    acc3 = tl.zeros([BLOCK_T, BLOCK_I], tl.float32)
    w1_rows = w1_ptr + offs_i.to(tl.int64)[None, :] * stride_w1
    w3_rows = w1_ptr + (offs_i + I).to(tl.int64)[None, :] * stride_w1
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        xm = mask_t[:, None] & mask_h[None, :]
        xf = tl.load(x_rows + offs_h[None, :], mask=xm, other=0.0).to(tl.float32)
        nw = tl.load(nw_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        if IS_RMS:
            n = (xf * rstd[:, None]).to(dtype).to(tl.float32) * nw[None, :]
        else:
            nb = tl.load(nb_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
            n = (xf - mean[:, None]) * rstd[:, None] * nw[None, :] + nb[None, :]
        n = tl.where(xm, n, 0.0).to(dtype)
        wm = mask_h[:, None] & mask_i[None, :]
        w1 = tl.load(w1_rows + offs_h[:, None], mask=wm, other=0.0)  # [BLOCK_H, BLOCK_I]
        acc1 = acc1 + dot(n, w1, IEEE)
        if IS_GLU:
            w3 = tl.load(w3_rows + offs_h[:, None], mask=wm, other=0.0)
            acc3 = acc3 + dot(n, w3, IEEE)

    if IS_GLU:
        g = acc1.to(dtype).to(tl.float32)
        u = acc3.to(dtype).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(dtype).to(tl.float32) * u
    else:
        b1 = tl.load(b1_ptr + offs_i, mask=mask_i, other=0.0).to(tl.float32)
        hdn = (acc1 + b1[None, :]).to(dtype).to(tl.float32)
        act = _gelu_tanh(hdn)
    act = tl.where(mask_t[:, None] & mask_i[None, :], act, 0.0).to(dtype)

    # the activation chunk goes to memory ([T, I] is tiny at decode sizes); the second
    # projection is one cuBLAS GEMM over it. Accumulating it here with atomics would save that
    # round trip but makes the sum order (and so greedy decoding in bf16) vary run to run.
    act_rows = act_ptr + offs_t.to(tl.int64)[:, None] * stride_a
    tl.store(act_rows + offs_i[None, :], act, mask=mask_t[:, None] & mask_i[None, :])


@triton.jit
def _act_kernel(
    in_ptr, out_ptr, I, stride_in, stride_out,
    IS_GLU: tl.constexpr, BLOCK: tl.constexpr,
):
    """silu(gate) * up from rows [gate | up] of width 2I, or gelu-tanh(h) of width I."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    dtype = out_ptr.dtype.element_ty
    a = tl.load(in_ptr + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    if IS_GLU:
        u = tl.load(in_ptr + row * stride_in + I + offs, mask=mask, other=0.0).to(tl.float32)
        y = (a * tl.sigmoid(a)).to(dtype).to(tl.float32) * u
    else:
        y = _gelu_tanh(a)
    tl.store(out_ptr + row * stride_out + offs, y.to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    return _act(gate_up, True)


def gelu_tanh(h: torch.Tensor) -> torch.Tensor:
    return _act(h, False)


def _act(inp: torch.Tensor, is_glu: bool) -> torch.Tensor:
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
        IS_GLU=is_glu, BLOCK=block, num_warps=cfg["num_warps"],
    )
    return out


def _decode(x, norm_weight, norm_bias, eps, w1, b1, w2, b2, is_rms: bool, is_glu: bool):
    T, H = x.shape
    inter = w2.shape[1]
    cfg = launch_configs.get("norm_mlp_decode", T)
    act = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    grid = (triton.cdiv(inter, cfg["BLOCK_I"]), triton.cdiv(T, cfg["BLOCK_T"]))
    _norm_mlp_decode_kernel[grid](
        x, norm_weight, norm_bias if norm_bias is not None else norm_weight,
        w1, b1 if b1 is not None else norm_weight, act,
        T, H, inter, eps,
        x.stride(0), w1.stride(0), act.stride(0),
        IS_RMS=is_rms, IS_GLU=is_glu,
        BLOCK_T=cfg["BLOCK_T"], BLOCK_I=cfg["BLOCK_I"], BLOCK_H=min(cfg["BLOCK_H"], max(16, next_pow2(H))),
        IEEE=is_fp32(x), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return F.linear(act, w2, b2)


def use_decode_form(num_tokens: int) -> bool:
    return num_tokens <= launch_configs.get("norm_mlp_dispatch", num_tokens)["MAX_DECODE_TOKENS"]


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def fused_rms_norm_glu_mlp(x, norm_weight, eps: float, gate_up_weight, down_weight, form: str | None = None):
    """out = down(silu(gate(n)) * up(n)), n = rms_norm(x); ``form`` forces "decode"/"prefill"."""
    x2 = _flat(x)
    T = x2.shape[0]
    out_shape = (*x.shape[:-1], down_weight.shape[0])
    if T == 0:
        return x.new_empty(out_shape)
    if (form or ("decode" if use_decode_form(T) else "prefill")) == "decode":
        out = _decode(x2, norm_weight, None, eps, gate_up_weight, None, down_weight, None, True, True)
    else:
        n = tr_rms_norm(x2, norm_weight, eps)
        out = F.linear(silu_mul(F.linear(n, gate_up_weight)), down_weight)
    return out.view(out_shape)


def fused_layer_norm_gelu_mlp(x, norm_weight, norm_bias, eps: float, fc_weight, fc_bias, proj_weight, proj_bias,
                              form: str | None = None):
    """out = proj(gelu_tanh(fc(n))), n = layer_norm(x); ``form`` forces "decode"/"prefill"."""
    x2 = _flat(x)
    T = x2.shape[0]
    out_shape = (*x.shape[:-1], proj_weight.shape[0])
    if T == 0:
        return x.new_empty(out_shape)
    if (form or ("decode" if use_decode_form(T) else "prefill")) == "decode":
        out = _decode(x2, norm_weight, norm_bias, eps, fc_weight, fc_bias, proj_weight, proj_bias, False, False)
    else:
        n = tr_layer_norm(x2, norm_weight, norm_bias, eps)
        # fc bias inside the cuBLAS epilogue: one rounding, as in the reference
        out = F.linear(gelu_tanh(F.linear(n, fc_weight, fc_bias)), proj_weight, proj_bias)
    return out.view(out_shape)
