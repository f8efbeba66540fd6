"""Triton row norms: RMSNorm, LayerNorm, and their residual-add fused forms.

One program per row holds the whole row in registers (hidden sizes up to a few 10k), so each
element is read once and written once. Numerics mirror the references in graph/ops.py:
statistics in fp32; RMSNorm rounds the normalised row to the input dtype before the weight
multiply (as Hugging Face does); the fused add rounds ``residual + x`` to the input dtype before
normalising it, exactly like the unfused graph; ``fused_rms_norm_residual`` adds the residual
after the norm (Gemma's post-norms). ``rms_norm_and_copy`` also writes the input row
to a fresh tensor, for a caller that needs a copy of it (the prefill MLP's residual).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compiled_llm.kernels import launch_configs
from compiled_llm.kernels.triton_common import next_pow2, row_warps


@triton.jit
def _norm_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, sum_ptr,
    stride_x, stride_r, stride_o, stride_s,
    N, eps,
    IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, STORE_INPUT: tl.constexpr = False,
    ADD_AFTER: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    if HAS_RESIDUAL or STORE_INPUT:  # the (summed) input row, which the caller keeps
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        rstd = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
        y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w
    else:
        mean = tl.sum(xf, 0) / N
        xc = tl.where(mask, xf - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, 0) / N + eps)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = xc * rstd * w + b
    y = y.to(out_ptr.dtype.element_ty)
    if ADD_AFTER:  # residual + norm(x), the norm rounded to the dtype first
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., N] as a [rows, N] matrix with unit stride along N (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x, residual, weight, bias, eps, is_rms, store_input: bool = False, add_after: bool = False):
    shape = x.shape
    x2 = _rows(x)
    rows, n = x2.shape
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    keep = (residual is not None and not add_after) or store_input
    summed = torch.empty(shape, dtype=x.dtype, device=x.device) if keep else None
    if rows == 0:
        return out, summed
    r2 = _rows(residual) if residual is not None else x2
    o2 = out.view(rows, n)
    s2 = summed.view(rows, n) if summed is not None else o2
    block = next_pow2(n)
    cap = launch_configs.get("norm", rows)["MAX_WARPS"]
    _norm_kernel[(rows,)](
        x2, r2, weight, bias if bias is not None else weight, o2, s2,
        x2.stride(0), r2.stride(0), o2.stride(0), s2.stride(0),
        n, eps,
        IS_RMS=is_rms, HAS_RESIDUAL=residual is not None and not add_after, BLOCK_N=block,
        STORE_INPUT=store_input, ADD_AFTER=add_after, num_warps=row_warps(block, cap),
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, None, eps, True)[0]


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, bias, eps, False)[0]


def rms_norm_and_copy(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x), a fresh copy of x) in one launch: the norm reads every row anyway, so the
    copy costs one more write instead of a memcpy launch. The prefill MLP accumulates its down
    projection into the copy in place (``addmm_``), where ``addmm(x, ...)`` would copy x itself."""
    return _launch(x, None, weight, None, eps, True, store_input=True)


def fused_add_rms_norm(x, residual, weight, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, None, eps, True)


def fused_rms_norm_residual(x, weight, eps: float, residual) -> torch.Tensor:
    """``residual + rms_norm(x)`` in one launch (Gemma's post-norms)."""
    return _launch(x, residual, weight, None, eps, True, add_after=True)[0]


def fused_add_layer_norm(x, residual, weight, bias, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, bias, eps, False)
