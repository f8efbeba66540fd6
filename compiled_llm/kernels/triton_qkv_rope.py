"""Triton QKV epilogue: per-head q/k RMSNorm (Qwen3) + neox RoPE, and the q/k/v split, in one
launch after the QKV projection.

The projection itself is ``F.linear(x, qkv_weight, qkv_bias)``: cuBLAS adds the bias in its own
epilogue with one rounding, exactly as the reference does, so the Triton kernel starts from the
biased [T, (Hq + 2 Hkv) * D] rows. Grid (T, Hq + 2 Hkv): a program owns one head of one token,
holds its two halves (rotate-halves RoPE pairs x[i] with x[i + D/2]) in registers, normalises,
rotates and writes it to its own contiguous q/k/v output. v heads are copied.

The same kernel serves ``cllm::rotary_embedding`` (q and k given as separate tensors, no v).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from compiled_llm.kernels import launch_configs
from compiled_llm.kernels.triton_common import next_pow2


@triton.jit
def _head_epilogue(
    src, dst, w_ptr, cs_row, stride_d, eps,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_ROPE: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    x1 = tl.load(src + offs * stride_d, mask=mask, other=0.0)
    x2 = tl.load(src + (offs + HALF) * stride_d, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / HEAD_DIM + eps)
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        # the reference rounds the normalised row, then the weight product, to the input dtype
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    if HAS_ROPE:
        cos = tl.load(cs_row + offs, mask=mask, other=0.0)
        sin = tl.load(cs_row + HALF + offs, mask=mask, other=0.0)
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
    else:
        y1 = x1
        y2 = x2
    tl.store(dst + offs, y1.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + offs, y2.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _qkv_epilogue_kernel(
    q_src, k_src, v_src, q_out, k_out, v_out,
    q_norm_ptr, k_norm_ptr, pos_ptr, cs_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cs, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HAS_V: tl.constexpr,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_ROPE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cs_row = cs_ptr
    if HAS_ROPE:
        cs_row = cs_ptr + tl.load(pos_ptr + t).to(tl.int64) * stride_cs
    if h < NUM_HEADS:
        _head_epilogue(
            q_src + t * stride_qt + h * stride_qh, q_out + (t * NUM_HEADS + h) * HEAD_DIM,
            q_norm_ptr, cs_row, stride_qd, eps, HEAD_DIM, HALF, BLOCK_HALF, HAS_NORM, HAS_ROPE,
        )
    elif h < NUM_HEADS + NUM_KV_HEADS:
        hk = h - NUM_HEADS
        _head_epilogue(
            k_src + t * stride_kt + hk * stride_kh, k_out + (t * NUM_KV_HEADS + hk) * HEAD_DIM,
            k_norm_ptr, cs_row, stride_kd, eps, HEAD_DIM, HALF, BLOCK_HALF, HAS_NORM, HAS_ROPE,
        )
    else:
        if HAS_V:
            hv = h - NUM_HEADS - NUM_KV_HEADS
            _head_epilogue(
                v_src + t * stride_vt + hv * stride_vh, v_out + (t * NUM_KV_HEADS + hv) * HEAD_DIM,
                k_norm_ptr, cs_row, stride_vd, eps, HEAD_DIM, HALF, BLOCK_HALF, False, False,
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
    _qkv_epilogue_kernel[(T, heads)](
        q_src, k_src, v_in, q, k, v if v is not None else k,
        q_norm_weight if has_norm else q_src, k_norm_weight if has_norm else q_src,
        positions, cos_sin if has_rope else q_src,
        *q_src.stride(), *k_src.stride(), *v_in.stride(),
        cos_sin.stride(0) if has_rope else 0, eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HAS_V=v_src is not None,
        HEAD_DIM=head_dim, HALF=half, BLOCK_HALF=next_pow2(half),
        HAS_NORM=has_norm, HAS_ROPE=has_rope, num_warps=cfg["num_warps"],
    )
    return q, k, v


def supports_shape(head_dim: int, has_q_norm: bool, has_k_norm: bool) -> bool:
    """The kernel pairs halves of a head and normalises q and k together or not at all."""
    return head_dim % 2 == 0 and has_q_norm == has_k_norm


def fused_qkv_rope(x, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight, positions, cos_sin,
                   num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
    T = x.shape[0]
    qkv = F.linear(x, qkv_weight, qkv_bias)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q_src = qkv[:, :q_size].view(T, num_heads, head_dim)
    k_src = qkv[:, q_size:q_size + kv_size].view(T, num_kv_heads, head_dim)
    v_src = qkv[:, q_size + kv_size:].view(T, num_kv_heads, head_dim)
    return _epilogue(q_src, k_src, v_src, q_norm_weight, k_norm_weight, positions, cos_sin, eps)


def rotary_embedding(q, k, positions, cos_sin):
    q_out, k_out, _ = _epilogue(q, k, None, None, None, positions, cos_sin, 0.0)
    return q_out, k_out
