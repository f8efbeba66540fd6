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

Weight-only int8 weights stream through the same loops (SCALED: the row's scale after the K loop).
Int4 weights (graph/quantized_ops.py) run the general kernels' INT4 form at every T (``int4_step``
and the helpers around it): a thread streams 16 bytes (32 columns) of a weight row, all in one
group of the scale and zero point, and reads x as pairs of columns, one word a pair, so that its
x tile has the byte tile's shape and register layout. A code becomes a float by one AND, read as
a denormal (int4_codes), not by an int -> float conversion (a fraction of the FMA rate); x is
scaled once a chunk to match; each chunk's codes are decoded once for all the rows of x; and a
thread applies its group's terms once a chunk: sum x (q - z) s = s (sum x q - z sum x). The INT4
forms have launch-config tables of their own (weight_config).
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from compiled_llm.kernels import launch_configs
from compiled_llm.kernels.triton_common import (
    next_pow2, pdl_launch, pdl_open, pdl_wait, store_linear_output, use_pdl,
)
from compiled_llm.kernels.triton_gemm_wq import dequantize, gemm_wq, use_gemm

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
        b = w  # a placeholder: RMSNorm has no bias
        if not IS_RMS:
            b = tl.load(nb_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        xf = _normalized(xf, w, b, mean, rstd, dtype, IS_RMS)
    return xf


@triton.jit
def _normalized(xf, w, b, mean, rstd, dtype, IS_RMS: tl.constexpr):
    """fp32 x (masked columns 0) normalised with the norm's fp32 weight and bias, rounded to
    ``dtype`` where the separate norm op rounds (RMSNorm: the normalised row, then its product
    with the weight; LayerNorm: once, at the end)."""
    if IS_RMS:
        xf = ((xf * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
    else:
        xf = ((xf - mean) * rstd * w + b).to(dtype).to(tl.float32)
    return xf


@triton.jit
def weight_tile(w_rows, offs_k, mask):
    """fp32 [1, BLOCK_N, BLOCK_K] tile of weight rows ``w_rows`` ([1, BLOCK_N, 1] pointers) at
    columns ``offs_k``; streamed once per call, so it goes first when L1 or L2 evicts (the
    ``L1::evict_first`` / ``L2::evict_first`` hints in the PTX), keeping x cached."""
    return tl.load(w_rows + offs_k, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)


# ---------------------------------------------------------------------------------------------
# int4 weights (graph/quantized_ops.py): the building blocks of the kernels' INT4 forms
# ---------------------------------------------------------------------------------------------


@triton.jit
def int4_chunk(w_rows, s_rows, z_rows, mask_r, kb, KB, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
               VB: tl.constexpr):
    """One K chunk of int4 weight rows: bytes [kb, kb + BLOCK_K / 2) of the rows that start at
    ``w_rows`` ([R] byte pointers, ``mask_r`` says which exist; KB bytes a row) as an [R, KC, VB]
    uint8 tile, VB bytes (2 VB columns) a thread, KC = BLOCK_K / (2 VB); and the scale and zero
    point of each thread's group ([R, KC, 1] fp32, the tile's layout; ``s_rows``/``z_rows`` point
    at the rows' first groups). All three stream once per call, so they go first when a cache
    evicts."""
    KC: tl.constexpr = BLOCK_K // (2 * VB)
    first = kb + tl.arange(0, KC)[None, :, None] * VB  # each thread's first byte
    # VB divides a group and a group divides the row: a thread's bytes share one group, and lie
    # wholly inside the row or wholly past it, so a mask per thread keeps its loads whole vectors
    ok = mask_r[:, None, None] & (first < KB)
    w = tl.load(w_rows[:, None, None] + first + tl.arange(0, VB)[None, None, :], mask=ok, other=0,
                eviction_policy="evict_first")
    group = first // (GROUP // 2)
    s = tl.load(s_rows[:, None, None] + group, mask=ok, other=0.0, eviction_policy="evict_first")
    z = tl.load(z_rows[:, None, None] + group, mask=ok, other=0.0, eviction_policy="evict_first")
    return w, s, z


# int4_codes builds each code as the denormal float whose mantissa holds the nibble where it lies
# in the byte (no shift, no offset: one AND a weight), so a code is q * 2^-149 (low nibble) or
# q * 2^-145 (high); int4_step scales x by 2^(149 - CODE_SHIFT) and 2^(145 - CODE_SHIFT) to match,
# and a product is then x * q * 2^-CODE_SHIFT, exact. 64 keeps x * 2^85 finite for |x| < 2^43 and
# the products normal for |x| > 2^-62. FP32 FMAs take denormal inputs at full rate (no flush: the
# kernels are compiled without ftz).
CODE_SHIFT = 64
X_SCALE_LO = tl.constexpr(2.0 ** (149 - CODE_SHIFT))
X_SCALE_HI = tl.constexpr(2.0 ** (145 - CODE_SHIFT))
CODE_UNSCALE = tl.constexpr(2.0 ** CODE_SHIFT)


@triton.jit
def int4_codes(w):
    """fp32 (lo, hi) of an int4 byte tile: the code q of each byte's low (even column) and high
    (odd column) nibble as q * 2^-149 and q * 2^-145, the nibble masked in place and read as a
    denormal float (the GPU converts int to float at a fraction of its FMA rate; this is one AND)."""
    b = w.to(tl.int32)
    lo = (b & 0xF).to(tl.float32, bitcast=True)
    hi = (b & 0xF0).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def int4_dot(x_lo, x_hi, sx, v_lo, v_hi, s, z):
    """[R, KC, 1] fp32: each thread's share of one chunk's dot products, x . W with W = (q - z) s.
    x_lo/x_hi are x on the codes' scale (times X_SCALE_LO, X_SCALE_HI), v_lo/v_hi the codes
    (int4_codes) and sx the plain sum of the thread's x: sum x (q - z) = 2^CODE_SHIFT sum x' v -
    z sx, so the inner loop multiplies x by raw codes and the group's zero point and scale cost a
    few ops per thread and chunk."""
    p = tl.sum(x_lo * v_lo, 2, keep_dims=True) + tl.sum(x_hi * v_hi, 2, keep_dims=True)
    return s * (p * CODE_UNSCALE - z * sx)


@triton.jit
def _load_pairs(ptr, offs, mask):
    """fp32 (even, odd) values of the element pairs ``offs`` (pair indices) of the array at ``ptr``,
    loaded as one word a pair: 32-bit for 16-bit dtypes, 64-bit for fp32 (masked pairs are 0)."""
    dtype: tl.constexpr = ptr.dtype.element_ty
    if dtype == tl.float32:
        w = tl.load(ptr.to(tl.pointer_type(tl.int64)) + offs, mask=mask, other=0)
        lo = w.to(tl.int32).to(tl.float32, bitcast=True)
        hi = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    elif dtype == tl.bfloat16:  # bf16 is the top half of an fp32
        w = tl.load(ptr.to(tl.pointer_type(tl.int32)) + offs, mask=mask, other=0)
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & -65536).to(tl.float32, bitcast=True)
    else:
        w = tl.load(ptr.to(tl.pointer_type(tl.int32)) + offs, mask=mask, other=0)
        lo = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def input_pairs(x_row, x_mask, offs, mask, nw_ptr, nb_ptr, mean, rstd, HAS_NORM: tl.constexpr,
                IS_RMS: tl.constexpr):
    """``input_chunk`` for int4 weights, one row of x (``x_row``; ``x_mask`` is ``mask`` and the
    row's existence): columns 2b and 2b + 1 for the byte offsets ``offs`` of a weight tile, as two
    fp32 tiles of that tile's shape (even, odd). x is read a pair to a word: a pair tile with the
    byte tile's shape and index order gets its register layout, each thread holding the pairs of
    its own bytes (a tile of single columns would hold twice as many and need a layout conversion
    every step); its rows repeat one row of x, which the compiler loads once."""
    x_lo, x_hi = _load_pairs(x_row, offs, x_mask)
    if HAS_NORM:
        dtype = x_row.dtype.element_ty
        w_lo, w_hi = _load_pairs(nw_ptr, offs, mask)
        b_lo = w_lo  # placeholders, RMSNorm has no bias
        b_hi = w_hi
        if not IS_RMS:
            b_lo, b_hi = _load_pairs(nb_ptr, offs, mask)
        x_lo = _normalized(x_lo, w_lo, b_lo, mean, rstd, dtype, IS_RMS)
        x_hi = _normalized(x_hi, w_hi, b_hi, mean, rstd, dtype, IS_RMS)
    return x_lo, x_hi


@triton.jit
def row_stats(v, BLOCK_T: tl.constexpr):
    """A [BLOCK_T, 1, 1] per-row statistic (norm_stats) as int4_step takes it, [1, 1, BLOCK_T]:
    rows on the axis a thread holds whole, so that picking one row takes no shuffles."""
    return tl.reshape(v, [1, 1, BLOCK_T])


@triton.jit
def _row_value(v, t, BLOCK_T: tl.constexpr):
    """Row t's value ([1, 1, 1]) of a [1, 1, BLOCK_T] per-row statistic (row_stats)."""
    return tl.sum(tl.where(tl.arange(0, BLOCK_T)[None, None, :] == t, v, 0.0), 2, keep_dims=True)


@triton.jit
def int4_step(x_ptr, stride_x, t0, T, kb, KB, w1, s1, z1, w2, s2, z2, nw_ptr, nb_ptr, mean, rstd,
              HAS_NORM: tl.constexpr, IS_RMS: tl.constexpr, TWO: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, VB: tl.constexpr):
    """What one chunk (bytes [kb, kb + BLOCK_K / 2) of each row, from int4_chunk) of one or TWO
    sets of R int4 weight rows adds to their accumulators, for BLOCK_T rows of x from row t0 of
    x_ptr's [T, K] (normalised when HAS_NORM, with the rows' mean and rstd from row_stats):
    [R, KC, BLOCK_T] fp32 each (the second is the first when not TWO). The codes are decoded
    once and serve every row of x."""
    KC: tl.constexpr = BLOCK_K // (2 * VB)
    first = kb + tl.arange(0, KC) * VB
    mask = (first < KB)[None, :, None]
    # the weight tile's shape, so x's pair tile gets its layout (input_pairs)
    offs = first[None, :, None] + tl.arange(0, VB)[None, None, :] + tl.zeros(w1.shape, tl.int32)
    v1_lo, v1_hi = int4_codes(w1)
    v2_lo = v1_lo
    v2_hi = v1_hi
    if TWO:
        v2_lo, v2_hi = int4_codes(w2)
    rows = tl.arange(0, BLOCK_T)[None, None, :]
    acc1 = tl.zeros([w1.shape[0], KC, BLOCK_T], tl.float32)
    acc2 = acc1
    for t in tl.static_range(BLOCK_T):
        mean_t = mean
        rstd_t = rstd
        if HAS_NORM:
            mean_t = _row_value(mean, t, BLOCK_T)
            rstd_t = _row_value(rstd, t, BLOCK_T)
        x_mask = (first < tl.where(t0 + t < T, KB, 0))[None, :, None]  # past the last row: none
        x_lo, x_hi = input_pairs(x_ptr + (t0 + t).to(tl.int64) * stride_x, x_mask, offs, mask,
                                 nw_ptr, nb_ptr, mean_t, rstd_t, HAS_NORM, IS_RMS)
        sx = tl.sum(x_lo, 2, keep_dims=True) + tl.sum(x_hi, 2, keep_dims=True)
        x_lo *= X_SCALE_LO  # onto the codes' scale (int4_codes)
        x_hi *= X_SCALE_HI
        acc1 = tl.where(rows == t, int4_dot(x_lo, x_hi, sx, v1_lo, v1_hi, s1, z1), acc1)
        if TWO:
            acc2 = tl.where(rows == t, int4_dot(x_lo, x_hi, sx, v2_lo, v2_hi, s2, z2), acc2)
    if not TWO:
        acc2 = acc1
    return acc1, acc2


def warps_along_k(block_k: int, itemsize: float, cap: int) -> int:
    """Warps (a power of two <= cap) such that every thread holds whole 16-byte vectors of one
    BLOCK_K chunk (of weights of ``itemsize`` bytes, 0.5 for int4): all threads lie along K, so x
    and W tiles share one register layout."""
    lanes = max(1, block_k // max(1, VECTOR_BYTES // itemsize))
    warps = 1
    while warps * 2 <= min(cap, lanes // 32):
        warps *= 2
    return warps


def tile_config(cfg: Mapping[str, int], T: int, rows: int, K: int, itemsize: float,
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


def weight_itemsize(weight: torch.Tensor) -> float:
    """Bytes per weight: the element size, or 0.5 for int4 (uint8, two weights a byte)."""
    return 0.5 if weight.dtype == torch.uint8 else weight.element_size()


def per_weight_bytes(cfg: Mapping[str, int], k_key: str, x: torch.Tensor, weight: torch.Tensor) -> Mapping[str, int]:
    """A launch config tuned for weights of x's dtype, its K block widened so that narrower
    (int8) weights stream as many bytes per step."""
    itemsize = weight_itemsize(weight)
    if itemsize == x.element_size():
        return cfg
    return {**cfg, k_key: int(cfg[k_key] * x.element_size() / itemsize)}


def weight_config(kernel: str, T: int, shape: tuple[int, int], x: torch.Tensor, weight: torch.Tensor,
                  k_key: str) -> Mapping[str, int]:
    """The launch config of ``kernel`` for T rows of x over ``weight`` (rows x columns ``shape``):
    int4 weights run the INT4 forms, which have tables of their own (``<kernel>_int4``); others
    the kernel's table, its K block widened for int8 (per_weight_bytes)."""
    if weight.dtype == torch.uint8:
        return launch_configs.get(f"{kernel}_int4", T, shape=shape)
    return per_weight_bytes(launch_configs.get(kernel, T, shape=shape), k_key, x, weight)


INT4_VECTORS = 4  # weight vectors a thread decodes per step, over all its rows (more spill registers)


def int4_constants(K: int, scale: torch.Tensor, tile: dict[str, int], x: torch.Tensor,
                   row_sets: int = 1) -> dict[str, int]:
    """The INT4 form's constexprs for int4 weights whose ``scale`` is [N, K / GROUP]: GROUP, and
    VB, the bytes of a thread's vector (16, or half a group when groups are narrower, so that a
    thread's bytes share one group). ``tile``'s K block is fitted to them: at least one vector a
    row, at most INT4_VECTORS a thread over its BLOCK_ROWS x ``row_sets`` rows (each vector's 32
    codes are fp32 registers while they serve the rows of x), half as many for fp32 x (whose
    pairs take twice the registers)."""
    group = K // scale.shape[-1]
    vb = min(VECTOR_BYTES, group // 2)
    vectors = INT4_VECTORS // max(1, x.element_size() // 2)
    most = vectors * 32 * tile["num_warps"] * 2 * vb // (tile["BLOCK_ROWS"] * row_sets)
    tile["BLOCK_K"] = max(min(tile["BLOCK_K"], most), 2 * vb)
    return {"INT4": True, "GROUP": group, "VB": vb}


def streams_quantized(qweight: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor]) -> bool:
    """Whether the kernels stream a weight-only quantized weight (graph/quantized_ops.py): int8
    (no zero point), or int4 in groups of an even number of columns that the INT4 form tiles
    (``int4_constants``: a thread's bytes lie in one group)."""
    if zero is None:
        return qweight.dtype == torch.int8
    if qweight.dtype != torch.uint8 or scale.dim() != 2 or scale.shape[-1] == 0:
        return False
    K = 2 * qweight.shape[-1]
    group = K // scale.shape[-1]
    return K % scale.shape[-1] == 0 and group % 2 == 0 and (group // 2) % min(VECTOR_BYTES, group // 2) == 0


def pair_aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` (rows of x, or a norm weight) as the INT4 forms read it, two columns to a word
    (input_pairs): unit stride along K, rows at even columns of a pair-aligned address (a copy
    when it is not)."""
    t = t if t.stride(-1) == 1 else t.contiguous()
    if t.data_ptr() % (2 * t.element_size()) == 0 and (t.dim() == 1 or t.stride(0) % 2 == 0):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def unit_stride_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., K] as a [rows, K] matrix with unit stride along K (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


# ---------------------------------------------------------------------------------------------
# the GEMV kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _gemv_int4(x_ptr, w_ptr, s_ptr, z_ptr, offs_n, mask_n, T, K, stride_x, stride_w,
               BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, VB: tl.constexpr,
               PDL: tl.constexpr):
    """``_gemv_kernel``'s sums [BLOCK_T, BLOCK_N] for int4 weights (no bias yet): BLOCK_N weight
    rows streamed BLOCK_K columns a step, each step's codes decoded once for the BLOCK_T rows of
    x, the group terms applied per thread and step (int4_step)."""
    KB = K // 2
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_w
    s_rows = s_ptr + offs_n.to(tl.int64) * (K // GROUP)
    z_rows = z_ptr + offs_n.to(tl.int64) * (K // GROUP)
    t0 = tl.program_id(1) * BLOCK_T
    no_stats = tl.zeros([1, 1, BLOCK_T], tl.float32)
    # the first chunk needs nothing from the previous kernel: stream it while that kernel
    # finishes (PDL), then wait before touching x
    w, s, z = int4_chunk(w_rows, s_rows, z_rows, mask_n, 0, KB, GROUP, BLOCK_K, VB)
    pdl_wait(PDL)
    acc, _ = int4_step(x_ptr, stride_x, t0, T, 0, KB, w, s, z, w, s, z, x_ptr, x_ptr, no_stats, no_stats,
                       False, True, False, BLOCK_T, BLOCK_K, VB)
    for kb in range(BLOCK_K // 2, KB, BLOCK_K // 2):
        w, s, z = int4_chunk(w_rows, s_rows, z_rows, mask_n, kb, KB, GROUP, BLOCK_K, VB)
        step, _ = int4_step(x_ptr, stride_x, t0, T, kb, KB, w, s, z, w, s, z, x_ptr, x_ptr, no_stats, no_stats,
                            False, True, False, BLOCK_T, BLOCK_K, VB)
        acc += step
    return tl.trans(tl.sum(acc, 1))


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, r_ptr, out_ptr, s_ptr, z_ptr,
    T, N, K,
    stride_x, stride_w, stride_r, stride_o,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
    SCALED: tl.constexpr = False, INT4: tl.constexpr = False, GROUP: tl.constexpr = 128, VB: tl.constexpr = 16,
):
    pdl_open(PDL)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_t = offs_t < T
    mask_n = offs_n < N
    if INT4:  # int4 weights with groups of GROUP columns: see int4_step
        y = _gemv_int4(x_ptr, w_ptr, s_ptr, z_ptr, offs_n, mask_n, T, K, stride_x, stride_w,
                       BLOCK_T, BLOCK_K, GROUP, VB, PDL)
    else:
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

    store_linear_output(y, offs_t, offs_n, mask_t, mask_n, b_ptr, r_ptr, out_ptr, stride_r, stride_o,
                        HAS_BIAS, HAS_RESIDUAL)


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
         scale: Optional[torch.Tensor] = None, zero: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T (+ bias) (+ residual)`` by the weight-streaming kernel, for any number of
    rows (meant for few: each BLOCK_T rows stream W again). x [..., K], weight [N, K], residual
    [..., N]; ``config`` names the launch-config table (one per call site: shapes differ). With
    ``scale`` [N] (fp32), ``weight`` is int8 and row n of W is ``weight[n] * scale[n]``
    (graph/quantized_ops.py): a thread's 16-byte vector then holds 16 weights. With ``zero`` too,
    ``weight`` is int4, [N, K / 2] uint8 (graph/quantized_ops.py), and ``scale``/``zero`` are
    [N, K / G], W = (q - zero) * scale by groups of G columns: the general kernel's INT4 form
    runs for every number of rows, 32 weights a thread's 16-byte vector."""
    K, N = x.shape[-1], weight.shape[0]
    out = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    x2 = unit_stride_rows(x)
    T = x2.shape[0]
    if T == 0:
        return out
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    r2 = unit_stride_rows(residual) if residual is not None else x2
    o2 = out.view(T, N)
    itemsize = weight_itemsize(w)
    tile = tile_config(weight_config(config, T, (N, K), x, w, "BLOCK_K"), T, N, K, itemsize)
    pdl = use_pdl(x)
    s = scale if scale is not None else w
    int4 = {}
    if zero is not None:
        x2 = pair_aligned(x2)
        int4 = int4_constants(K, scale, tile, x2)
    elif T == 1:
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
        x2, w, bias if bias is not None else w, r2, o2, s, zero if zero is not None else w,
        T, N, K,
        x2.stride(0), w.stride(0), r2.stride(0), o2.stride(0),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        BLOCK_T=tile["BLOCK_T"], BLOCK_N=tile["BLOCK_ROWS"], BLOCK_K=tile["BLOCK_K"], PDL=pdl,
        SCALED=scale is not None and zero is None, **int4,
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``cllm::linear``: one GEMV launch for up to MAX_TOKENS rows, cuBLAS above."""
    T = math.prod(x.shape[:-1])
    if use_gemv(T):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


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
# weight-only int8 and int4 (graph/quantized_ops.py): int8 weights streamed with the scale applied
# per output, int4 weights with the group terms applied per thread and step; many rows go to the
# quantized GEMM or to dequantize + cuBLAS (matmul_wq)
# ---------------------------------------------------------------------------------------------


def linear_wq(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``linear_wq`` (the lm_head) with an int8 or int4 weight: the GEMV for up to MAX_TOKENS
    rows, ``matmul_wq`` above."""
    if use_gemv(math.prod(x.shape[:-1])):
        return gemv(x, qweight, bias, scale=scale, zero=zero)
    return matmul_wq(x, qweight, scale, zero, bias)


def linear_residual_wq(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
                       bias: Optional[torch.Tensor], residual: torch.Tensor) -> torch.Tensor:
    """``fused_linear_residual_wq`` with an int8 or int4 weight: the GEMV for up to MAX_TOKENS
    rows, ``matmul_wq`` above."""
    if use_gemv(math.prod(x.shape[:-1])):
        return gemv(x, qweight, bias, residual, scale=scale, zero=zero)
    return matmul_wq(x, qweight, scale, zero, bias, residual)


def matmul_wq(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
              bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ W^T (+ bias) (+ residual)`` for many rows of x and an int8 or int4 weight
    (triton_gemm_wq.supports): the quantized GEMM, or past its MAX_TOKENS the weight dequantized
    into a scratch of x's dtype and cuBLAS (``dense_linear``, the unquantized prefill's GEMM)."""
    T = math.prod(x.shape[:-1])
    if use_gemm(T):
        return gemm_wq(x, qweight, scale, zero, bias, residual)
    N = qweight.shape[0]
    x2 = x.reshape(T, x.shape[-1])
    r2 = residual.reshape(T, N) if residual is not None else None
    out = dense_linear(x2, dequantize(qweight, scale, zero, x.dtype), bias, r2)
    return out.view(*x.shape[:-1], N)
