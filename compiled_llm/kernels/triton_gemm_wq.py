"""Weight-only quantized matmul past the decode forms: ``out = x @ W^T (+ bias) (+ residual)``
with W int8 or int4 (graph/quantized_ops.py), in one of two ways.

- ``gemm_wq`` (up to MAX_TOKENS rows of "gemm_wq_dispatch"): one Triton GEMM that dequantizes W
  tile by tile in registers and multiplies on tensor cores (tl.dot, fp32 accumulation).
- ``dequantize`` then cuBLAS (more rows): W dequantized once per call into a scratch weight of
  x's dtype by a streaming kernel, then the same cuBLAS GEMM as the unquantized model. Where the
  step is compute-bound the Triton GEMM runs at a third of cuBLAS's rate, while the scratch costs
  a read of the codes and a write and read of the weight, which past about 128 rows is the
  smaller cost (benchmarks/NOTES.md).

The GEMM's tiling is the classic one. A program owns a [BLOCK_M, BLOCK_N] output tile and walks
K in BLOCK_K steps; programs are ordered in groups of GROUP_M row tiles so that the ones running
together share their weight tiles in L2. Each step loads a [BLOCK_M, BLOCK_K] tile of x and the weight
tile's codes, dequantizes them to x's dtype and accumulates ``x_tile @ w_tile^T``.

Dequantization is the reference's, so both ways multiply by exactly the weights the reference
does:
- int4 (``qweight`` uint8 [N, K / 2], even k in the low nibble; fp32 ``scale``/``zero``
  [N, K / G]): ``W = ((q - zero) * scale)`` in fp32, rounded to x's dtype. BLOCK_K divides the
  group G, so each step reads one scale and one zero point a row.
- int8 (``qweight`` int8 [N, K], fp32 ``scale`` [N]): q is exact in every dtype, so the step
  multiplies by q and the accumulator takes each output channel's scale once, after the K loop
  (as the GEMV does).

Rounding as the unfused graph's: fp32 accumulator + bias, rounded to the dtype (F.linear), then
+ residual in fp32, rounded (aten.add).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from compiled_llm.kernels import launch_configs
from compiled_llm.kernels.triton_common import dot, is_fp32, next_pow2, store_linear_output

MIN_BLOCK_K = 16  # tl.dot's smallest K


@triton.jit
def _int4_tile(w_ptr, s_ptr, z_ptr, offs_n, mask_n, k0, K, stride_w, dtype,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at columns [k0, k0 + BLOCK_K), dequantized to ``dtype``:
    bytes [k0 / 2, (k0 + BLOCK_K) / 2) of each row, both nibbles, (q - zero) * scale in fp32."""
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    mask = mask_n[:, None] & (offs_b < K // 2)[None, :]
    b = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + offs_b[None, :], mask=mask, other=0)
    b = b.to(tl.int32)
    # [BLOCK_N, BLOCK_K / 2, 2] with the low nibble (even column) first, read as [BLOCK_N, BLOCK_K]
    q = tl.reshape(tl.join(b & 0xF, b >> 4), [BLOCK_N, BLOCK_K]).to(tl.float32)
    groups = K // GROUP
    g = k0 // GROUP
    s = tl.load(s_ptr + offs_n.to(tl.int64) * groups + g, mask=mask_n, other=0.0)
    z = tl.load(z_ptr + offs_n.to(tl.int64) * groups + g, mask=mask_n, other=0.0)
    return ((q - z[:, None]) * s[:, None]).to(dtype)


@triton.jit
def _gemm_wq_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, r_ptr, out_ptr,
    M, N, K,
    stride_x, stride_w, stride_r, stride_o,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, INT4: tl.constexpr, GROUP: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # programs in groups of GROUP_M row tiles: those running at once share weight tiles in L2
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    dtype = x_ptr.dtype.element_ty
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if INT4:
            w = _int4_tile(w_ptr, s_ptr, z_ptr, offs_n, mask_n, k0, K, stride_w, dtype, BLOCK_N, BLOCK_K, GROUP)
        else:
            w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + offs_k[None, :],
                        mask=mask_n[:, None] & mask_k[None, :], other=0).to(tl.float32).to(dtype)
        acc = dot(x, tl.trans(w), IEEE) + acc
    if not INT4:  # int8: the output channel's scale, once, after the K loop
        acc *= tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    store_linear_output(acc, offs_m, offs_n, mask_m, mask_n, b_ptr, r_ptr, out_ptr, stride_r, stride_o,
                        HAS_BIAS, HAS_RESIDUAL)


def int4_group(qweight: torch.Tensor, scale: torch.Tensor) -> int:
    """G, the columns a scale and zero point of an int4 weight cover."""
    return 2 * qweight.shape[-1] // scale.shape[-1]


def supports(qweight: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor]) -> bool:
    """Weights this kernel takes: int8 with a scale per row, or int4 whose groups are a power of
    two of at least MIN_BLOCK_K columns (a K step lies in one group and is tl.dot-sized)."""
    if zero is None:
        return qweight.dtype == torch.int8 and scale.dim() == 1
    if qweight.dtype != torch.uint8 or scale.dim() != 2 or scale.shape[-1] == 0:
        return False
    if (2 * qweight.shape[-1]) % scale.shape[-1]:
        return False
    group = int4_group(qweight, scale)
    return group >= MIN_BLOCK_K and group & (group - 1) == 0


def gemm_wq(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
            bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ W^T (+ bias) (+ residual)`` for x [..., K] and an int8 or int4 weight (``supports``;
    module docstring), residual [..., N]; out in x's dtype."""
    K = x.shape[-1]
    N = qweight.shape[0]
    out = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    M = math.prod(x.shape[:-1])
    if M == 0:
        return out
    x2 = x.reshape(M, K)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    w = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    r2 = residual.reshape(M, N) if residual is not None else x2
    r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    o2 = out.view(M, N)
    cfg = launch_configs.get("gemm_wq", M)
    int4 = zero is not None
    group = int4_group(w, scale) if int4 else K
    block_k = min(next_pow2(cfg["BLOCK_K"]), group) if int4 else max(MIN_BLOCK_K, min(next_pow2(cfg["BLOCK_K"]), next_pow2(K)))
    block_m = max(16, min(next_pow2(cfg["BLOCK_M"]), next_pow2(M)))
    block_n = max(16, min(next_pow2(cfg["BLOCK_N"]), next_pow2(N)))
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _gemm_wq_kernel[grid](
        x2, w, scale, zero if int4 else scale, bias if bias is not None else x2, r2, o2,
        M, N, K,
        x2.stride(0), w.stride(0), r2.stride(0), o2.stride(0),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, INT4=int4, GROUP=group,
        IEEE=is_fp32(x2),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_w,
                       INT4: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows [BLOCK_N] x columns [BLOCK_K] of the dequantized weight, written in out's dtype; an
    int4 tile is viewed as [BLOCK_N, BLOCK_K / GROUP, GROUP], so each group's scale and zero
    point are loaded once and broadcast over its columns."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)[:, None]
    mask = mask_n[:, None] & (offs_k < K)[None, :]
    if INT4:
        offs_b = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        b = tl.load(w_ptr + rows * stride_w + offs_b[None, :], mask=mask_n[:, None] & (offs_b < K // 2)[None, :],
                    other=0, eviction_policy="evict_first").to(tl.int32)
        q = tl.reshape(tl.join(b & 0xF, b >> 4), [BLOCK_N, BLOCK_K // GROUP, GROUP]).to(tl.float32)
        groups = K // GROUP
        offs_g = tl.program_id(1) * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
        g = rows[:, :, None] * groups + offs_g[None, :, None]
        mask_g = mask_n[:, None, None] & (offs_g < groups)[None, :, None]
        z = tl.load(z_ptr + g, mask=mask_g, other=0.0)
        s = tl.load(s_ptr + g, mask=mask_g, other=0.0)
        w = tl.reshape((q - z) * s, [BLOCK_N, BLOCK_K])
    else:
        q = tl.load(w_ptr + rows * stride_w + offs_k[None, :], mask=mask, other=0, eviction_policy="evict_first")
        w = q.to(tl.float32) * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
    tl.store(out_ptr + rows * K + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
               dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight an int8 or int4 encoding holds (int4: groups of a power of two columns,
    as quantized_ops.quantize makes them), in ``dtype``: exactly quantized_ops.dequantize's values
    (fp32 arithmetic, one rounding), in one streaming launch."""
    int4 = zero is not None
    N = qweight.shape[0]
    K = 2 * qweight.shape[-1] if int4 else qweight.shape[-1]
    group = K // scale.shape[-1] if int4 else 1
    if int4 and (group * scale.shape[-1] != K or group & (group - 1)):
        raise ValueError(f"dequantize takes int4 groups of a power of two columns, not {K} / {scale.shape[-1]}")
    out = torch.empty((N, K), dtype=dtype, device=qweight.device)
    if N == 0 or K == 0:
        return out
    w = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    block_n, block_k = 8, min(1024, max(16, next_pow2(K)))
    _dequantize_kernel[(triton.cdiv(N, block_n), triton.cdiv(K, block_k))](
        w, scale, zero if int4 else scale, out, N, K, w.stride(0),
        INT4=int4, GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return out


def use_gemm(num_tokens: int) -> bool:
    """Whether ``num_tokens`` rows run the Triton GEMM (else: dequantize, then cuBLAS)."""
    return num_tokens <= launch_configs.get("gemm_wq_dispatch", num_tokens)["MAX_TOKENS"]
