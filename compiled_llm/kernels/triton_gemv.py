"""Weight-streaming GEMV for decode: ``out = x @ W^T (+ bias) (+ residual)`` for a few rows of x.

At batch-1 decode a linear layer does ~1 FMA per weight element it reads, so its time is the time
to stream W once. tl.dot needs >= 16 rows, and a kernel that padded a few rows to 16 streamed W
far below the copy bandwidth (benchmarks/NOTES.md); with a few rows there is nothing for tensor
cores to do, so this kernel uses plain FMAs and spends its effort on keeping loads in flight.

Tiling. W is [N, K] with K contiguous. A program owns BLOCK_N rows of W and BLOCK_T rows of x and
walks K in BLOCK_K chunks: it loads a [1, BLOCK_N, BLOCK_K] tile of W (16-byte vectors along K,
``evict_first``: W is read once per call and should not push x or the activations out) and
a [BLOCK_T, 1, BLOCK_K] chunk of x (tiny, cached: the weights are marked evict-first in L1 and
L2, so x stays cached for all the programs on an SM), and accumulates their broadcast product in a
[BLOCK_T, BLOCK_N, BLOCK_K] fp32 register tile. Each weight element is loaded once and used for
every row of x, the loop body is FMAs only, and the reduction over K happens once, at the end.

Warps lie along K only (``warps_along_k``). When BLOCK_K holds fewer 16-byte vectors than the
program has threads, Triton spreads warps over T or N, the x and W tiles get different layouts,
and every weight tile makes a round trip through shared memory to be converted (visible as a
``convert_layout`` inside the loop in the TTGIR). With all threads along K the tiles share the
accumulator's layout.

No split-K. The bytes a GPU has in flight per SM are about N * BLOCK_K * itemsize / SMs whatever
BLOCK_N is (all programs are resident at once at these sizes), so a tall-K shape (down: K = 4864,
N = 896) is fed by a larger BLOCK_K rather than by splitting K over programs. The sum order is fixed,
with no atomics, so greedy decoding repeats exactly.

Rounding is the unfused graph's: fp32 accumulator + bias, rounded to the dtype (what F.linear
returns), then + residual in fp32, rounded (what aten.add returns).

One row (batch-1 decode) runs ``_gemv_one_row_kernel`` instead: the same streaming, with the tile
laid out [BLOCK_N, BLOCK_K / 8, 8] so each thread sums its own 16-byte vector every step and the
accumulator is one fp32 per weight row and thread (8x fewer registers), which streams faster in
PDL chains (benchmarks/NOTES.md).

The norm + MLP and q/k/v kernels reuse this structure and the helpers below (``norm_stats``,
``input_chunk``, ``weight_tile``, ``tile_config``). Large T goes to cuBLAS (``dense_linear``): once
there are enough rows to fill tensor-core tiles the GEMM is compute-bound and cuBLAS wins.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from compiled_llm.kernels import launch_configs
from compiled_llm.kernels.triton_common import next_pow2, pdl_launch, pdl_open, pdl_wait, use_pdl

VECTOR_BYTES = 16  # one 128-bit load per thread and step along K


# ---------------------------------------------------------------------------------------------
# building blocks shared with the norm + MLP and q/k/v kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def norm_stats(x_rows, mask_t, K, eps, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, IS_RMS: tl.constexpr):
    """(mean, rstd), each [BLOCK_T, 1, 1] fp32, of the rows that start at ``x_rows``
    ([BLOCK_T, 1, 1] pointers; ``mask_t`` says which exist). RMSNorm's mean is 0; LayerNorm's
    variance takes a second pass over the (tiny, cached) rows so it is exact, as torch's is."""
    mean = tl.zeros([BLOCK_T, 1, 1], tl.float32)
    if not IS_RMS:
        s1 = tl.zeros([BLOCK_T, 1, 1], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)[None, None, :]
            xf = tl.load(x_rows + offs_k, mask=mask_t & (offs_k < K), other=0.0).to(tl.float32)
            s1 += tl.sum(xf, 2)[:, :, None]
        mean = s1 / K
    s2 = tl.zeros([BLOCK_T, 1, 1], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)[None, None, :]
        m = mask_t & (offs_k < K)
        xc = tl.where(m, tl.load(x_rows + offs_k, mask=m, other=0.0).to(tl.float32) - mean, 0.0)
        s2 += tl.sum(xc * xc, 2)[:, :, None]
    return mean, tl.rsqrt(s2 / K + eps)


@triton.jit
def input_chunk(x_rows, mask_t, offs_k, mask_k, nw_ptr, nb_ptr, mean, rstd,
                HAS_NORM: tl.constexpr, IS_RMS: tl.constexpr):
    """The fp32 [BLOCK_T, 1, BLOCK_K] chunk of the x rows at columns ``offs_k`` ([1, 1, BLOCK_K])
    as the projection sees it: raw, or normalised and rounded to the dtype exactly as the separate
    norm op's output was (RMSNorm: the normalised row, then its product with the weight; LayerNorm:
    once, at the end). Columns outside ``mask_k`` come out 0."""
    dtype = x_rows.dtype.element_ty
    xf = tl.load(x_rows + offs_k, mask=mask_t & mask_k, other=0.0).to(tl.float32)
    if HAS_NORM:
        w = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        if IS_RMS:
            xf = ((xf * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        else:
            b = tl.load(nb_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            xf = ((xf - mean) * rstd * w + b).to(dtype).to(tl.float32)
    return xf


@triton.jit
def weight_tile(w_rows, offs_k, mask):
    """fp32 [1, BLOCK_N, BLOCK_K] tile of weight rows ``w_rows`` ([1, BLOCK_N, 1] pointers) at
    columns ``offs_k``; streamed once per call, so it goes first when L1 or L2 evicts (the
    ``L1::evict_first`` / ``L2::evict_first`` hints in the PTX), keeping x cached."""
    return tl.load(w_rows + offs_k, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)


def warps_along_k(block_k: int, itemsize: int, cap: int) -> int:
    """Warps (a power of two <= cap) such that every thread holds whole 16-byte vectors of one
    BLOCK_K chunk: all threads lie along K, so x and W tiles share one register layout."""
    lanes = max(1, block_k // max(1, VECTOR_BYTES // itemsize))
    warps = 1
    while warps * 2 <= min(cap, lanes // 32):
        warps *= 2
    return warps


def tile_config(cfg: Mapping[str, int], T: int, rows: int, K: int, itemsize: int,
                rows_key: str = "BLOCK_N", k_key: str = "BLOCK_K") -> dict[str, int]:
    """Block sizes of a launch: the config's values rounded up to powers of two (tl.arange needs
    them) and capped by the problem (no block wider than the next power of two of its extent),
    warps laid along K."""

    def block(value: int, extent: int, least: int = 1) -> int:
        return min(next_pow2(value), max(least, next_pow2(extent)))

    block_k = block(cfg[k_key], K, least=16)
    return {
        "BLOCK_T": block(cfg["BLOCK_T"], T),
        "BLOCK_ROWS": block(cfg[rows_key], rows),
        "BLOCK_K": block_k,
        "num_warps": warps_along_k(block_k, itemsize, cfg["num_warps"]),
        "num_stages": cfg.get("num_stages", 1),
    }


def per_weight_bytes(cfg: Mapping[str, int], k_key: str, x: torch.Tensor, weight: torch.Tensor) -> Mapping[str, int]:
    """A launch config tuned for weights of x's dtype, its K block widened so that narrower
    (int8) weights stream as many bytes per step."""
    if weight.element_size() == x.element_size():
        return cfg
    return {**cfg, k_key: cfg[k_key] * x.element_size() // weight.element_size()}


def unit_stride_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., K] as a [rows, K] matrix with unit stride along K (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


# ---------------------------------------------------------------------------------------------
# the GEMV kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, r_ptr, out_ptr, s_ptr,
    T, N, K,
    stride_x, stride_w, stride_r, stride_o,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
    SCALED: tl.constexpr = False,
):
    pdl_open(PDL)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_t = offs_t < T
    mask_n = offs_n < N
    x_rows = x_ptr + offs_t.to(tl.int64)[:, None, None] * stride_x
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :, None] * stride_w

    # the first weight tile needs nothing from the previous kernel: stream it while that kernel
    # finishes (PDL), then wait before touching x
    offs_k = tl.arange(0, BLOCK_K)[None, None, :]
    mask_k = offs_k < K
    w_first = weight_tile(w_rows, offs_k, mask_n[None, :, None] & mask_k)
    pdl_wait(PDL)
    xk = tl.load(x_rows + offs_k, mask=mask_t[:, None, None] & mask_k, other=0.0).to(tl.float32)
    acc = xk * w_first
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)[None, None, :]
        mask_k = offs_k < K
        xk = tl.load(x_rows + offs_k, mask=mask_t[:, None, None] & mask_k, other=0.0).to(tl.float32)
        acc += xk * weight_tile(w_rows, offs_k, mask_n[None, :, None] & mask_k)
    y = tl.sum(acc, 2)  # [BLOCK_T, BLOCK_N]
    if SCALED:  # int8 weights: the output channel's scale, once, after the K loop
        y *= tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]

    dtype = out_ptr.dtype.element_ty
    mask = mask_t[:, None] & mask_n[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:
        # the linear output is rounded before the add, as the unfused graph rounds it
        r = tl.load(r_ptr + offs_t.to(tl.int64)[:, None] * stride_r + offs_n[None, :], mask=mask, other=0.0)
        y = y.to(dtype).to(tl.float32) + r.to(tl.float32)
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * stride_o + offs_n[None, :], y.to(dtype), mask=mask)


@triton.jit
def _gemv_one_row_kernel(
    x_ptr, w_ptr, b_ptr, r_ptr, out_ptr, s_ptr, N, K, stride_w,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, PDL: tl.constexpr = False,
    SCALED: tl.constexpr = False,
):
    """The one-row form (batch-1 decode): the weight tile is loaded as [BLOCK_N, BLOCK_K / VEC, VEC]
    with a thread's 16-byte vector on the last axis, and each step sums its product with x over
    that axis inside the thread. The accumulator holds one fp32 per weight row and thread instead
    of one per element (the general kernel's [BLOCK_T, BLOCK_N, BLOCK_K] tile): 8x fewer registers
    in bf16, and a shorter final reduction. Same sum order along K within a thread, same
    roundings."""
    pdl_open(PDL)
    KC: tl.constexpr = BLOCK_K // VEC
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_c = tl.arange(0, KC)[None, :, None] * VEC + tl.arange(0, VEC)[None, None, :]  # [1, KC, VEC]
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None, None] * stride_w
    mask_w = mask_n[:, None, None]
    # the first weight tile needs nothing from the previous kernel: stream it while that kernel
    # finishes (PDL), then wait before touching x
    w_first = tl.load(w_rows + offs_c, mask=mask_w & (offs_c < K), other=0.0, eviction_policy="evict_first")
    bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    x = tl.load(x_ptr + offs_c, mask=offs_c < K, other=0.0).to(tl.float32)
    acc = tl.sum(w_first.to(tl.float32) * x, 2)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + offs_c
        mask_k = offs_k < K
        w = tl.load(w_rows + offs_k, mask=mask_w & mask_k, other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x, 2)
    y = tl.sum(acc, 1)
    if SCALED:  # int8 weights: the output channel's scale, once, after the K loop
        y *= tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    y += bias

    dtype = out_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        # the linear output is rounded before the add, as the unfused graph rounds it
        r = tl.load(r_ptr + offs_n, mask=mask_n, other=0.0)
        y = y.to(dtype).to(tl.float32) + r.to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(dtype), mask=mask_n)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
         residual: Optional[torch.Tensor] = None, config: str = "gemv",
         scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T (+ bias) (+ residual)`` by the weight-streaming kernel, for any number of
    rows (meant for few: each BLOCK_T rows stream W again). x [..., K], weight [N, K], residual
    [..., N]; ``config`` names the launch-config table (one per call site: shapes differ). With
    ``scale`` [N] (fp32), ``weight`` is int8 and row n of W is ``weight[n] * scale[n]``
    (graph/quantized_ops.py): a thread's 16-byte vector then holds 16 weights."""
    K, N = x.shape[-1], weight.shape[0]
    out = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    x2 = unit_stride_rows(x)
    T = x2.shape[0]
    if T == 0:
        return out
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    r2 = unit_stride_rows(residual) if residual is not None else x2
    o2 = out.view(T, N)
    itemsize = w.element_size()
    tile = tile_config(per_weight_bytes(launch_configs.get(config, T), "BLOCK_K", x, w), T, N, K, itemsize)
    pdl = use_pdl(x)
    s = scale if scale is not None else w
    if T == 1:
        _gemv_one_row_kernel[(triton.cdiv(N, tile["BLOCK_ROWS"]),)](
            x2, w, bias if bias is not None else w, r2, o2, s, N, K, w.stride(0),
            HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
            BLOCK_N=tile["BLOCK_ROWS"], BLOCK_K=tile["BLOCK_K"], VEC=VECTOR_BYTES // itemsize, PDL=pdl,
            SCALED=scale is not None,
            num_warps=tile["num_warps"], num_stages=tile["num_stages"], **pdl_launch(pdl),
        )
        return out
    grid = (triton.cdiv(N, tile["BLOCK_ROWS"]), triton.cdiv(T, tile["BLOCK_T"]))
    _gemv_kernel[grid](
        x2, w, bias if bias is not None else w, r2, o2, s,
        T, N, K,
        x2.stride(0), w.stride(0), r2.stride(0), o2.stride(0),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        BLOCK_T=tile["BLOCK_T"], BLOCK_N=tile["BLOCK_ROWS"], BLOCK_K=tile["BLOCK_K"], PDL=pdl,
        SCALED=scale is not None,
        num_warps=tile["num_warps"], num_stages=tile["num_stages"], **pdl_launch(pdl),
    )
    return out


def dense_linear(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 residual2: Optional[torch.Tensor]) -> torch.Tensor:
    """The cuBLAS form for many rows: ``x2 @ weight.T (+ bias) (+ residual2)`` on [T, *]
    matrices. Without a bias the residual rides in addmm's epilogue (one launch; it rounds once
    where the unfused graph rounds twice, a difference accepted at prefill sizes)."""
    if residual2 is None:
        return F.linear(x2, weight, bias)
    if bias is None:
        return torch.addmm(residual2, x2, weight.t())
    return F.linear(x2, weight, bias).add_(residual2)


def use_gemv(num_tokens: int) -> bool:
    return num_tokens <= launch_configs.get("gemv_dispatch", num_tokens)["MAX_TOKENS"]


def linear_residual(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    residual: torch.Tensor) -> torch.Tensor:
    """``residual + linear(x, weight, bias)``: x [..., K], weight [N, K], residual [..., N].
    One GEMV launch for up to MAX_TOKENS rows, cuBLAS above."""
    T = math.prod(x.shape[:-1])
    if use_gemv(T):
        return gemv(x, weight, bias, residual)
    N = weight.shape[0]
    out = dense_linear(x.reshape(-1, x.shape[-1]), weight, bias, residual.reshape(-1, N))
    return out.view(*x.shape[:-1], N)


# ---------------------------------------------------------------------------------------------
# weight-only int8 (graph/quantized_ops.py): int8 weights streamed, the scale applied per output
# ---------------------------------------------------------------------------------------------


def linear_wq(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``linear_wq`` (the lm_head) with an int8 weight, decode-sized x (the provider sends
    other calls to the op's reference)."""
    return gemv(x, qweight, bias, scale=scale)


def linear_residual_wq(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
                       bias: Optional[torch.Tensor], residual: torch.Tensor) -> torch.Tensor:
    """``fused_linear_residual_wq`` with an int8 weight, decode-sized x."""
    return gemv(x, qweight, bias, residual, scale=scale)
