"""Triton mixture of SwiGLU experts (``cllm::fused_moe``): route each token to its top_k experts
and sum their weighted outputs, reading only the chosen experts' weights, in two forms chosen by
the number of (token, slot) pairs T * top_k.

Every launch is sized from shapes alone and nothing is read back to the host (no .item(), no
nonzero, no boolean indexing), so both forms run inside a CUDA graph: which experts a step uses
is data, and lives only in device tensors that the kernels read.

The op takes the layer's RMSNorm weight and its residual too (the passes fold the norm before
the mixture and the add after it into the op): x is normalised first, as the separate norm op
rounds it, and the output is ``residual + mixture``, the mixture rounded first.

Routing: the router's logits rounded to x's dtype (as F.linear's are), their softmax in fp32,
the top_k by repeated arg-max (the highest weight first, the lowest expert id among equal
weights), renormalised when asked. It writes weights [T, top_k] fp32 and expert ids [T, top_k]
int32; pair p = t * top_k + k is token t's k-th choice.

Decode form (T * top_k <= MAX_DECODE_PAIRS of "fused_moe_dispatch"): three weight-streaming
launches in triton_gemv's one-row layout (a thread's 16-byte vector summed inside the thread each
step, one fp32 accumulator per weight row and thread; no tl.dot, whose tiles would be padding at
one row).
  0. ``_route_decode_kernel``, grid (cdiv(E, BLOCK_R), T): the norm, the router and the top_k in
     one launch. A program normalises its token's row (programs of router block 0 store it for
     the experts), streams BLOCK_R router rows and stores those logits; the token's last program
     to finish, by an atomic count per token, reads all E logits back, writes the routing and
     resets the count. The counts live in one zeroed buffer per device (``_route_counters``),
     which every call leaves zero.
  1. ``_gate_up_decode_kernel``, grid (cdiv(I, BLOCK_I), T * top_k): a program owns one pair and
     BLOCK_I intermediate rows; it reads the pair's expert id, streams that expert's gate rows i
     and up rows i + I along H against the token's (normalised) row, and writes act
     [T * top_k, I] = silu(gate) * up. Pairs of tokens that chose the same expert stream its rows
     again, from L2.
  2. ``_down_decode_kernel``, grid (cdiv(H, BLOCK_N), T): a program owns one token and BLOCK_N
     output rows; for each of the token's top_k experts it streams the down rows against the
     pair's act row, weights the result and adds it to an fp32 accumulator, and stores once, plus
     the residual. The weighted sum is the epilogue: no [T, top_k, H] buffer, no atomics, a fixed
     sum order.

Prefill form (more pairs): the norm (triton_norm), the router by F.linear and ``_route_kernel``
(one program per token), then grouped GEMMs over the pairs sorted by expert, vLLM's fused_moe
design.
  1. Dispatch layout: the pairs' expert ids sorted (torch.sort, stable), then ``_align_kernel``
     lays the pairs out by expert, each expert's run padded to whole blocks of BLOCK_M rows, into
     a buffer of the worst-case size (T * top_k + E * (BLOCK_M - 1) rows, rounded up to whole
     blocks): sorted_pairs (a pair index per row, T * top_k on padding rows), block_expert (the
     expert of each block) and num_padded (the rows in use, on the device). Its programs each
     find every expert's run by binary search in the sorted ids, so they need no scratch and no
     second pass.
  2. ``_gate_up_gemm_kernel``: a program per (block, BLOCK_N intermediate columns), tl.dot of the
     block's rows of x (gathered by token) with the block's expert's gate and up columns, the
     silu(gate) * up epilogue, act stored at the pairs' rows of [T * top_k, I].
  3. ``_down_gemm_kernel``: the same over act and the expert's down rows, the routing weight in
     the epilogue, stored at the pairs' rows of [T * top_k, H].
  4. ``_sum_slots_kernel``: each token's top_k rows summed in fp32 (a fixed order, no atomics),
     plus the residual.
  Blocks past num_padded (the buffer is sized for the worst case) exit before reading anything,
  so only the chosen experts' weights are read. Programs run GROUP_M blocks against each weight
  tile before the next (triton_gemm_wq's ordering), so consecutive blocks of an expert share its
  tiles in L2.

Rounding is the reference's (fused_ops.fused_moe_ref, torch's bf16 arithmetic): the gate and up
outputs rounded to the dtype, silu's output rounded, the product rounded; each expert's down output
rounded, times the routing weight rounded to the dtype, that product rounded; the top_k products
summed in fp32 and rounded once. Both forms agree with the reference up to accumulation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from compiled_llm.kernels import launch_configs
from compiled_llm.kernels.triton_common import (
    dot, is_fp32, next_pow2, pdl_launch, pdl_open, pdl_wait, row_warps, use_pdl,
)
from compiled_llm.kernels.triton_gemv import VECTOR_BYTES, input_chunk, norm_stats, tile_config, weight_tile
from compiled_llm.kernels.triton_norm import rms_norm as tr_rms_norm

FORMS = ("decode", "prefill")
MIN_DOT = 16  # tl.dot's smallest M, N and K
ALIGN_TILE = 8192  # elements of _align_kernel's [positions, experts] tiles (registers)
SUM_BLOCK = 1024  # columns per program of _sum_slots_kernel


# ---------------------------------------------------------------------------------------------
# shared epilogues: the reference's roundings
# ---------------------------------------------------------------------------------------------


@triton.jit
def _swiglu(gate, up, dtype):
    """silu(gate) * up from fp32 sums, rounded where torch rounds: each linear's output, silu's
    output and the product are tensors of ``dtype``."""
    g = gate.to(dtype).to(tl.float32)
    u = up.to(dtype).to(tl.float32)
    return ((g * tl.sigmoid(g)).to(dtype).to(tl.float32) * u).to(dtype).to(tl.float32)


@triton.jit
def _weighted(y, routing_weight, dtype):
    """An expert's fp32 down sums times the pair's fp32 routing weight, as the reference's
    ``experts * dense``: both factors rounded to ``dtype``, then their product."""
    return (y.to(dtype).to(tl.float32) * routing_weight.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)


# ---------------------------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------------------------


@triton.jit
def _top_k(logits, mask_e, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
           BLOCK_K: tl.constexpr):
    """(weights, ids), [BLOCK_K] each (slots past TOP_K hold 0): the softmax of one token's fp32
    logits [BLOCK_E] (``mask_e`` the real experts), its top_k (the highest first; the lowest id
    among equal weights), renormalised to sum to 1 when RENORMALIZE."""
    offs_e = tl.arange(0, BLOCK_E)
    logits = tl.where(mask_e, logits, float("-inf"))
    p = tl.exp(logits - tl.max(logits, 0))
    p = tl.where(mask_e, p, 0.0)
    p = p / tl.sum(p, 0)

    # top_k by repeated arg-max over what is left: probabilities are >= 0, so -1 marks a lane
    # taken or past E
    left = tl.where(mask_e, p, -1.0)
    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], tl.float32)
    top_id = tl.zeros([BLOCK_K], tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(left, 0)
        pick = tl.min(tl.where(left == best, offs_e, BLOCK_E), 0)
        top_w = tl.where(slots == k, best, top_w)
        top_id = tl.where(slots == k, pick, top_id)
        left = tl.where(offs_e == pick, -1.0, left)
    if RENORMALIZE:  # slots past TOP_K hold 0
        top_w = top_w / tl.sum(top_w, 0)
    return top_w, top_id


@triton.jit
def _store_routing(weights_ptr, ids_ptr, t, top_w, top_id, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    slots = tl.arange(0, BLOCK_K)
    tl.store(weights_ptr + t * TOP_K + slots, top_w, mask=slots < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slots, top_id, mask=slots < TOP_K)


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_l,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """One token's routing from its logits (``_top_k``)."""
    pdl_open(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    logits = tl.load(logits_ptr + t * stride_l + offs_e, mask=mask_e, other=0.0).to(tl.float32)
    top_w, top_id = _top_k(logits, mask_e, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_K)
    _store_routing(weights_ptr, ids_ptr, t, top_w, top_id, TOP_K, BLOCK_K)


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool,
          pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] fp32, expert ids [T, top_k] int32) of x [T, H]: what
    fused_ops.moe_routing_ref returns (its ids int64), the logits from F.linear in x's dtype."""
    T, E = x.shape[0], router_weight.shape[0]
    weights, ids = _routing_buffers(T, top_k, x.device)
    if T == 0:
        return weights, ids
    logits = F.linear(x, router_weight)
    block_e = next_pow2(E)
    _route_kernel[(T,)](
        logits, weights, ids, E, logits.stride(0),
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=block_e, BLOCK_K=next_pow2(top_k), PDL=pdl,
        num_warps=row_warps(block_e), **pdl_launch(pdl),
    )
    return weights, ids


def _norm_and_route(x, norm_weight, norm_eps: float, router_weight, top_k: int, renormalize: bool, pdl: bool = False):
    """(normalised x, routing weights, expert ids) in separate launches: the Triton norm when
    there is one, then ``route``."""
    if norm_weight is not None:
        x = tr_rms_norm(x, norm_weight, norm_eps)
    return (x, *route(x, router_weight, top_k, renormalize, pdl=pdl))


def _routing_buffers(T: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((T, top_k), dtype=torch.float32, device=device),
            torch.empty((T, top_k), dtype=torch.int32, device=device))


@triton.jit
def _route_decode_kernel(
    x_ptr, nw_ptr, w_ptr, logits_ptr, xn_ptr, weights_ptr, ids_ptr, count_ptr,
    H, E, stride_x, stride_w, stride_xn, norm_eps,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, VEC: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):
    """The decode form's routing in one launch, grid (cdiv(E, BLOCK_R), T): a program normalises
    its token's row of x (the layer's RMSNorm, when HAS_NORM; the programs of router block 0
    store it to xn for the experts), streams BLOCK_R router rows against it (triton_gemv's one-row
    layout) and stores those logits, rounded to the dtype as F.linear's are. The token's last
    program to finish (a counter per token, which it resets) reads all E logits back and writes
    the routing (``_top_k``)."""
    pdl_open(PDL)
    KC: tl.constexpr = BLOCK_H // VEC
    t = tl.program_id(1).to(tl.int64)
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < E
    mask_r3 = mask_r[:, None, None]
    offs_c = tl.arange(0, KC)[None, :, None] * VEC + tl.arange(0, VEC)[None, None, :]  # [1, KC, VEC]
    w_rows = w_ptr + offs_r.to(tl.int64)[:, None, None] * stride_w
    # the router's first tile needs nothing from the previous kernel: stream it while that
    # kernel finishes (PDL)
    w_first = weight_tile(w_rows, offs_c, mask_r3 & (offs_c < H))
    pdl_wait(PDL)
    dtype = xn_ptr.dtype.element_ty
    x_row = x_ptr + t * stride_x + tl.zeros([1, 1, 1], tl.int64)
    row_exists = tl.full([1, 1, 1], 1, tl.int1)
    mean = tl.zeros([1, 1, 1], tl.float32)
    rstd = mean
    if HAS_NORM:
        mean, rstd = norm_stats(x_row, row_exists, H, norm_eps, 1, BLOCK_H, True)
    keeps_x = HAS_NORM and tl.program_id(0) == 0  # without a norm the experts read x itself
    xk = input_chunk(x_row, row_exists, offs_c, offs_c < H, nw_ptr, nw_ptr, mean, rstd, HAS_NORM, True)
    if keeps_x:
        tl.store(xn_ptr + t * stride_xn + offs_c, xk.to(dtype), mask=offs_c < H)
    acc = tl.sum(xk * w_first, 2)
    for h0 in range(BLOCK_H, H, BLOCK_H):
        offs_h = h0 + offs_c
        mask_h = offs_h < H
        xk = input_chunk(x_row, row_exists, offs_h, mask_h, nw_ptr, nw_ptr, mean, rstd, HAS_NORM, True)
        if keeps_x:
            tl.store(xn_ptr + t * stride_xn + offs_h, xk.to(dtype), mask=mask_h)
        acc += tl.sum(xk * weight_tile(w_rows, offs_h, mask_r3 & mask_h), 2)
    logits = tl.sum(acc, 1).to(dtype).to(tl.float32)
    tl.store(logits_ptr + t * E + offs_r, logits, mask=mask_r)

    # acq_rel: this program's logits are visible before its count is, and the last program sees
    # every other program's logits after reading the count
    done = tl.atomic_add(count_ptr + t, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        offs_e = tl.arange(0, BLOCK_E)
        mask_e = offs_e < E
        every = tl.load(logits_ptr + t * E + offs_e, mask=mask_e, other=0.0, cache_modifier=".cg")
        top_w, top_id = _top_k(every, mask_e, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_K)
        _store_routing(weights_ptr, ids_ptr, t, top_w, top_id, TOP_K, BLOCK_K)
        tl.store(count_ptr + t, 0)  # ready for the next call: every program of this one has counted


# Tokens the decode form's one-launch routing counts for (its per-token counters). Decode steps
# have far fewer (MAX_DECODE_PAIRS / top_k); a call with more routes in two launches.
ROUTE_COUNTERS = 4096
_route_counts: dict[torch.device, torch.Tensor] = {}


def _route_counters(device: torch.device) -> torch.Tensor:
    """The device's routing counters: zeros, made once per process and device and kept for
    good, since captured graphs hold their address (each call leaves them zero again). Calls on
    one device run one at a time (a stream's order), as an engine's steps do."""
    counts = _route_counts.get(device)
    if counts is None:
        counts = _route_counts[device] = torch.zeros(ROUTE_COUNTERS, dtype=torch.int32, device=device)
    return counts


def _route_decode(x, norm_weight, norm_eps: float, router_weight, top_k: int, renormalize: bool, pdl: bool):
    """(normalised x, routing weights, expert ids) of the decode form, in one launch
    (``_route_decode_kernel``)."""
    T, H = x.shape
    E = router_weight.shape[0]
    itemsize = x.element_size()
    xn = torch.empty_like(x) if norm_weight is not None else x
    logits = torch.empty((T, E), dtype=torch.float32, device=x.device)
    weights, ids = _routing_buffers(T, top_k, x.device)
    tile = _streaming_tile("fused_moe_route", T, (E, H), E, H, itemsize, "BLOCK_R", "BLOCK_H")
    block_e = next_pow2(E)
    _route_decode_kernel[(triton.cdiv(E, tile["BLOCK_ROWS"]), T)](
        x, norm_weight if norm_weight is not None else x, router_weight, logits, xn, weights, ids,
        _route_counters(x.device),
        H, E, x.stride(0), router_weight.stride(0), xn.stride(0), norm_eps,
        TOP_K=top_k, RENORMALIZE=renormalize, HAS_NORM=norm_weight is not None,
        BLOCK_R=tile["BLOCK_ROWS"], BLOCK_H=tile["BLOCK_K"], VEC=VECTOR_BYTES // itemsize, BLOCK_E=block_e,
        BLOCK_K=next_pow2(top_k), PDL=pdl,
        num_warps=tile["num_warps"], num_stages=tile["num_stages"], **pdl_launch(pdl),
    )
    return xn, weights, ids


# ---------------------------------------------------------------------------------------------
# decode form: two weight-streaming launches
# ---------------------------------------------------------------------------------------------


@triton.jit
def _gate_up_decode_kernel(
    x_ptr, w_ptr, ids_ptr, act_ptr,
    H, I, stride_x, stride_we, stride_wr, stride_a,
    TOP_K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, VEC: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """act[p, i] = silu(gate_i . x_t) * (up_i . x_t) for pair p (token t = p // TOP_K) and
    BLOCK_I rows i of its expert, weight tiles [BLOCK_I, BLOCK_H / VEC, VEC] (one-row layout)."""
    pdl_open(PDL)
    pdl_wait(PDL)  # the expert id is the routing kernel's output: nothing to read before it
    KC: tl.constexpr = BLOCK_H // VEC
    pair = tl.program_id(1)
    token = (pair // TOP_K).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < I
    mask_i3 = mask_i[:, None, None]
    offs_c = tl.arange(0, KC)[None, :, None] * VEC + tl.arange(0, VEC)[None, None, :]  # [1, KC, VEC]
    gate_rows = w_ptr + expert * stride_we + offs_i.to(tl.int64)[:, None, None] * stride_wr
    up_rows = gate_rows + I * stride_wr
    x_row = x_ptr + token * stride_x

    acc_gate = tl.zeros([BLOCK_I, KC], tl.float32)
    acc_up = tl.zeros([BLOCK_I, KC], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + offs_c
        mask_h = offs_h < H
        xv = tl.load(x_row + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        acc_gate += tl.sum(xv * weight_tile(gate_rows, offs_h, mask_i3 & mask_h), 2)
        acc_up += tl.sum(xv * weight_tile(up_rows, offs_h, mask_i3 & mask_h), 2)

    dtype = act_ptr.dtype.element_ty
    act = _swiglu(tl.sum(acc_gate, 1), tl.sum(acc_up, 1), dtype)
    # act goes to memory ([pairs, I] is tiny at decode sizes) for the down kernel, which sums the
    # token's experts in a fixed order (summing partial products here with atomics would not be)
    tl.store(act_ptr + pair.to(tl.int64) * stride_a + offs_i, act.to(dtype), mask=mask_i)


@triton.jit
def _down_decode_kernel(
    act_ptr, w_ptr, ids_ptr, weights_ptr, r_ptr, out_ptr,
    H, I, stride_a, stride_we, stride_wr, stride_r, stride_o,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """out[t, n] for BLOCK_N output rows n of token t: the sum over the token's top_k experts of
    routing weight x (down_n . act_pair), each term rounded as the reference rounds it, summed in
    fp32 and stored once (rounded, plus the residual row when HAS_RESIDUAL)."""
    pdl_open(PDL)
    # everything read here is an earlier launch's output: act the previous kernel's, the ids and
    # weights the routing kernel's, which finished before the previous kernel could (it waits
    # on the routing kernel before doing anything)
    pdl_wait(PDL)
    KC: tl.constexpr = BLOCK_K // VEC
    token = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    mask_n3 = mask_n[:, None, None]
    offs_c = tl.arange(0, KC)[None, :, None] * VEC + tl.arange(0, VEC)[None, None, :]  # [1, KC, VEC]
    dtype = out_ptr.dtype.element_ty

    out = tl.zeros([BLOCK_N], tl.float32)
    # unrolled: the experts' rows are independent loads, all in flight at once (one expert at a
    # time left a program a few KB in flight, and a one-token step 64% of the copy bandwidth)
    for k in tl.static_range(TOP_K):
        pair = token * TOP_K + k
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        down_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None, None] * stride_wr
        act_row = act_ptr + pair.to(tl.int64) * stride_a
        acc = tl.zeros([BLOCK_N, KC], tl.float32)
        for i0 in range(0, I, BLOCK_K):
            offs_k = i0 + offs_c
            mask_k = offs_k < I
            a = tl.load(act_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            acc += tl.sum(a * weight_tile(down_rows, offs_k, mask_n3 & mask_k), 2)
        out += _weighted(tl.sum(acc, 1), tl.load(weights_ptr + pair), dtype)
    if HAS_RESIDUAL:  # the mixture rounded before the add, as the unfused graph rounds it
        r = tl.load(r_ptr + token.to(tl.int64) * stride_r + offs_n, mask=mask_n, other=0.0)
        out = out.to(dtype).to(tl.float32) + r.to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * stride_o + offs_n, out.to(dtype), mask=mask_n)


def _streaming_tile(table: str, T: int, shape: tuple[int, int], rows: int, K: int, itemsize: int,
                    rows_key: str, k_key: str) -> dict[str, int]:
    """A decode kernel's blocks (triton_gemv.tile_config: powers of two capped by the problem,
    warps along K) from its table, for an expert weight of ``shape``; one row of x a program."""
    cfg = launch_configs.get(table, T, shape=shape)
    return tile_config({**cfg, "BLOCK_T": 1}, 1, rows, K, itemsize, rows_key=rows_key, k_key=k_key)


def _decode(x, router_weight, gate_up_weight, down_weight, top_k: int, renormalize: bool, norm_weight, norm_eps: float,
            residual) -> torch.Tensor:
    """Routing (with the input norm) per (token, block of router rows), gate/up + activation per
    (pair, block of I rows), then down + weighted sum (+ residual) per (token, block of H rows)."""
    T, H = x.shape
    inter = down_weight.shape[2]
    itemsize = x.element_size()
    pdl = use_pdl(x)
    routing = _route_decode if T <= ROUTE_COUNTERS else _norm_and_route
    x, weights, ids = routing(x, norm_weight, norm_eps, router_weight, top_k, renormalize, pdl)
    act = torch.empty((T * top_k, inter), dtype=x.dtype, device=x.device)
    tile = _streaming_tile("fused_moe_decode", T, (2 * inter, H), inter, H, itemsize, "BLOCK_I", "BLOCK_H")
    _gate_up_decode_kernel[(triton.cdiv(inter, tile["BLOCK_ROWS"]), T * top_k)](
        x, gate_up_weight, ids, act,
        H, inter, x.stride(0), gate_up_weight.stride(0), gate_up_weight.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_I=tile["BLOCK_ROWS"], BLOCK_H=tile["BLOCK_K"], VEC=VECTOR_BYTES // itemsize, PDL=pdl,
        num_warps=tile["num_warps"], num_stages=tile["num_stages"], **pdl_launch(pdl),
    )
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    r = residual if residual is not None else out
    tile = _streaming_tile("fused_moe_down", T, (H, inter), H, inter, itemsize, "BLOCK_N", "BLOCK_K")
    _down_decode_kernel[(triton.cdiv(H, tile["BLOCK_ROWS"]), T)](
        act, down_weight, ids, weights, r, out,
        H, inter, act.stride(0), down_weight.stride(0), down_weight.stride(1), r.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_N=tile["BLOCK_ROWS"], BLOCK_K=tile["BLOCK_K"], VEC=VECTOR_BYTES // itemsize,
        HAS_RESIDUAL=residual is not None, PDL=pdl,
        num_warps=tile["num_warps"], num_stages=tile["num_stages"], **pdl_launch(pdl),
    )
    return out


# ---------------------------------------------------------------------------------------------
# prefill form: the pairs laid out by expert in padded blocks, then two grouped GEMMs
# ---------------------------------------------------------------------------------------------


@triton.jit
def _lower_bound(sorted_ptr, n, values, STEPS):
    """For each of ``values``, the first index of the sorted int32 array at ``sorted_ptr``
    (length n) whose entry is >= it; STEPS = n.bit_length() halvings of [0, n) always suffice."""
    lo = tl.zeros(values.shape, tl.int32)
    hi = lo + n
    for _ in range(STEPS):
        open_ = lo < hi
        mid = (lo + hi) // 2
        below = open_ & (tl.load(sorted_ptr + mid, mask=open_, other=0) < values)
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(open_ & ~below, mid, hi)
    return lo


@triton.jit
def _pick(values, onehot):
    """values[e] of each row's expert e ([BLOCK_D]), ``onehot`` [BLOCK_D, BLOCK_E] marking it:
    a register vector cannot be indexed, so the row sums its one lane (0 where none is marked)."""
    return tl.sum(tl.where(onehot, values[None, :], 0), 1)


@triton.jit(do_not_specialize=["num_pairs", "num_rows", "STEPS"])
def _align_kernel(
    sorted_ids_ptr, order_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, num_rows, E, STEPS,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Rows [pid * BLOCK_D, + BLOCK_D) of the padded layout: each row's pair (``num_pairs`` on
    padding), the expert of each block that starts among them, and (program 0) the rows in use.
    ``sorted_ids`` are the pairs' expert ids sorted, ``order`` the pairs in that order: expert
    e's pairs are order[start_e : start_e + count_e], start_e found by binary search."""
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    start = _lower_bound(sorted_ids_ptr, num_pairs, offs_e, STEPS)
    count = tl.where(mask_e, _lower_bound(sorted_ids_ptr, num_pairs, offs_e + 1, STEPS) - start, 0)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    padded_start = padded_end - padded
    total = tl.sum(padded, 0)

    rows = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    # a row's expert: how many experts' padded runs end at or before it (E past the last run)
    ended = (padded_end[None, :] <= rows[:, None]) & mask_e[None, :]
    expert = tl.sum(ended.to(tl.int32), 1)
    onehot = offs_e[None, :] == expert[:, None]
    rank = rows - _pick(padded_start, onehot)
    real = rank < _pick(count, onehot)  # never past E: no lane is marked there
    pair = tl.load(order_ptr + _pick(start, onehot) + rank, mask=real, other=0).to(tl.int32)
    in_buffer = rows < num_rows
    tl.store(sorted_pairs_ptr + rows, tl.where(real, pair, num_pairs), mask=in_buffer)
    tl.store(block_expert_ptr + rows // BLOCK_M, expert, mask=in_buffer & (rows % BLOCK_M == 0))
    if tl.program_id(0) == 0:
        tl.store(num_padded_ptr, total)


def expert_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prefill form's layout of the pairs of ``ids`` [T, top_k] by expert, each expert's run
    padded to whole blocks of ``block_m`` rows, in a buffer of the worst-case number of blocks:
    (sorted_pairs [blocks * block_m] int32, a pair index per row and T * top_k on padding;
    block_expert [blocks] int32, the expert of each block in use; num_padded [1] int32, the rows
    in use). Shapes depend on T, top_k, E and block_m only."""
    num_pairs = ids.numel()
    blocks = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    num_rows = blocks * block_m
    sorted_pairs = torch.empty(num_rows, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    # stable: within an expert the pairs stay in token order (the layout is deterministic)
    sorted_ids, order = torch.sort(ids.view(-1), stable=True)
    block_e = next_pow2(num_experts)
    block_d = max(MIN_DOT, min(1024, ALIGN_TILE // block_e))
    _align_kernel[(triton.cdiv(num_rows, block_d),)](
        sorted_ids, order, sorted_pairs, block_expert, num_padded,
        num_pairs, num_rows, num_experts, num_pairs.bit_length(),
        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_D=block_d, num_warps=4,
    )
    return sorted_pairs, block_expert, num_padded


@triton.jit
def _block_and_tile(num_blocks, tiles_n, GROUP_M: tl.constexpr):
    """(row block, column tile) of this program: GROUP_M blocks take each column tile in turn,
    so blocks running together share the weight tile in L2 (triton_gemm_wq's ordering)."""
    pid = tl.program_id(0)
    in_group = GROUP_M * tiles_n
    first = (pid // in_group) * GROUP_M
    group_blocks = tl.minimum(num_blocks - first, GROUP_M)
    return first + (pid % in_group) % group_blocks, (pid % in_group) // group_blocks


@triton.jit
def _block_pairs(sorted_pairs_ptr, block, num_pairs, BLOCK_M: tl.constexpr):
    """The pairs of a block's rows ([BLOCK_M] int64) and which are real (not padding)."""
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return pairs.to(tl.int64), pairs < num_pairs


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _gate_up_gemm_kernel(
    x_ptr, w_ptr, act_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, num_blocks, H, I,
    stride_x, stride_we, stride_wr, stride_a,
    TOP_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """act[p, n] = silu(gate_n . x_t) * (up_n . x_t) for the BLOCK_M pairs p of one block (all of
    one expert; tokens t = p // TOP_K gathered from x) and BLOCK_N intermediate columns n."""
    block, tile_n = _block_and_tile(num_blocks, tl.cdiv(I, BLOCK_N), GROUP_M)
    if block * BLOCK_M < tl.load(num_padded_ptr):  # blocks past the layout's end read nothing
        pairs, real = _block_pairs(sorted_pairs_ptr, block, num_pairs, BLOCK_M)
        expert = tl.load(block_expert_ptr + block).to(tl.int64)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < I
        x_rows = x_ptr + (pairs // TOP_K)[:, None] * stride_x
        # the dot's right operand [BLOCK_K, BLOCK_N]: weight rows n as columns, read along K
        gate_cols = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wr
        up_cols = gate_cols + I * stride_wr
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < H
            xt = tl.load(x_rows + offs_k[None, :], mask=real[:, None] & mask_k[None, :], other=0.0)
            mask_w = mask_k[:, None] & mask_n[None, :]
            acc_gate = dot(xt, tl.load(gate_cols + offs_k[:, None], mask=mask_w, other=0.0), IEEE) + acc_gate
            acc_up = dot(xt, tl.load(up_cols + offs_k[:, None], mask=mask_w, other=0.0), IEEE) + acc_up
        dtype = act_ptr.dtype.element_ty
        act = _swiglu(acc_gate, acc_up, dtype)
        tl.store(act_ptr + pairs[:, None] * stride_a + offs_n[None, :], act.to(dtype),
                 mask=real[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _down_gemm_kernel(
    act_ptr, w_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, num_blocks, H, I,
    stride_a, stride_we, stride_wr, stride_o,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """pair_out[p, n] = routing weight of p x (down_n . act_p), rounded as the reference rounds,
    for the BLOCK_M pairs p of one block and BLOCK_N output columns n."""
    block, tile_n = _block_and_tile(num_blocks, tl.cdiv(H, BLOCK_N), GROUP_M)
    if block * BLOCK_M < tl.load(num_padded_ptr):
        pairs, real = _block_pairs(sorted_pairs_ptr, block, num_pairs, BLOCK_M)
        expert = tl.load(block_expert_ptr + block).to(tl.int64)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < H
        act_rows = act_ptr + pairs[:, None] * stride_a
        down_cols = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wr
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < I
            a = tl.load(act_rows + offs_k[None, :], mask=real[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(down_cols + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc = dot(a, w, IEEE) + acc
        dtype = out_ptr.dtype.element_ty
        routing_weight = tl.load(weights_ptr + pairs, mask=real, other=0.0)
        y = _weighted(acc, routing_weight[:, None], dtype)
        tl.store(out_ptr + pairs[:, None] * stride_o + offs_n[None, :], y.to(dtype),
                 mask=real[:, None] & mask_n[None, :])


@triton.jit
def _sum_slots_kernel(pair_out_ptr, r_ptr, out_ptr, H, stride_r, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                      HAS_RESIDUAL: tl.constexpr = False):
    """out[t] = the sum of token t's TOP_K rows of pair_out ([T * TOP_K, H], already weighted and
    rounded) in fp32, in slot order, rounded once (then plus the residual row when HAS_RESIDUAL)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], tl.float32)
    for k in range(TOP_K):
        acc += tl.load(pair_out_ptr + (t * TOP_K + k) * H + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        acc = acc.to(dtype).to(tl.float32) + tl.load(r_ptr + t * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, acc.to(dtype), mask=mask)


def _dot_block(value: int, extent: int) -> int:
    """A tl.dot block: the config's value as a power of two, no wider than the problem needs,
    at least tl.dot's minimum."""
    return max(MIN_DOT, min(next_pow2(value), next_pow2(extent)))


def gemm_blocks(T: int, top_k: int, H: int, inter: int) -> dict[str, int]:
    """The grouped GEMMs' blocks from "fused_moe_gemm": BLOCK_M (rows of one expert a block,
    which also pads the layout), BLOCK_N and BLOCK_K for each GEMM's N and K."""
    cfg = launch_configs.get("fused_moe_gemm", T)
    return {
        "BLOCK_M": _dot_block(cfg["BLOCK_M"], T * top_k),
        "GATE_UP_N": _dot_block(cfg["BLOCK_N"], inter), "GATE_UP_K": _dot_block(cfg["BLOCK_K"], H),
        "DOWN_N": _dot_block(cfg["BLOCK_N"], H), "DOWN_K": _dot_block(cfg["BLOCK_K"], inter),
        "GROUP_M": cfg["GROUP_M"], "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
    }


def _prefill(x, router_weight, gate_up_weight, down_weight, top_k: int, renormalize: bool, norm_weight,
             norm_eps: float, residual) -> torch.Tensor:
    """The input norm, routing, layout by expert, gate/up grouped GEMM with the activation, down
    grouped GEMM with the routing weight, sum over each token's slots (+ residual)."""
    x, weights, ids = _norm_and_route(x, norm_weight, norm_eps, router_weight, top_k, renormalize)
    T, H = x.shape
    num_experts, inter = down_weight.shape[0], down_weight.shape[2]
    num_pairs = T * top_k
    blk = gemm_blocks(T, top_k, H, inter)
    block_m = blk["BLOCK_M"]
    sorted_pairs, block_expert, num_padded = expert_blocks(ids, num_experts, block_m)
    num_blocks = block_expert.shape[0]
    ieee = is_fp32(x)
    launch = {"num_warps": blk["num_warps"], "num_stages": blk["num_stages"]}

    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    _gate_up_gemm_kernel[(num_blocks * triton.cdiv(inter, blk["GATE_UP_N"]),)](
        x, gate_up_weight, act, sorted_pairs, block_expert, num_padded,
        num_pairs, num_blocks, H, inter,
        x.stride(0), gate_up_weight.stride(0), gate_up_weight.stride(1), act.stride(0),
        TOP_K=top_k, IEEE=ieee,
        BLOCK_M=block_m, BLOCK_N=blk["GATE_UP_N"], BLOCK_K=blk["GATE_UP_K"], GROUP_M=blk["GROUP_M"], **launch,
    )
    pair_out = torch.empty((num_pairs, H), dtype=x.dtype, device=x.device)
    _down_gemm_kernel[(num_blocks * triton.cdiv(H, blk["DOWN_N"]),)](
        act, down_weight, weights, pair_out, sorted_pairs, block_expert, num_padded,
        num_pairs, num_blocks, H, inter,
        act.stride(0), down_weight.stride(0), down_weight.stride(1), pair_out.stride(0),
        IEEE=ieee,
        BLOCK_M=block_m, BLOCK_N=blk["DOWN_N"], BLOCK_K=blk["DOWN_K"], GROUP_M=blk["GROUP_M"], **launch,
    )
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    block = min(SUM_BLOCK, next_pow2(H))
    r = residual if residual is not None else out
    _sum_slots_kernel[(T, triton.cdiv(H, block))](pair_out, r, out, H, r.stride(0), TOP_K=top_k, BLOCK=block,
                                                  HAS_RESIDUAL=residual is not None,
                                                  num_warps=row_warps(block, cap=4))
    return out


# ---------------------------------------------------------------------------------------------
# the op
# ---------------------------------------------------------------------------------------------


def use_decode_form(num_tokens: int, top_k: int) -> bool:
    """Whether T tokens of top_k experts each run the decode form (few pairs: streaming the
    chosen experts' rows beats padding each expert's rows to a tensor-core block)."""
    limit = launch_configs.get("fused_moe_dispatch", num_tokens)["MAX_DECODE_PAIRS"]
    return num_tokens * top_k <= limit


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its last dim (the kernels' K), a view when it has one."""
    return t if t.stride(-1) == 1 else t.contiguous()


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension (the decode form's pairs)


def _check_shapes(x, router_weight, gate_up_weight, down_weight, top_k: int, norm_weight, residual) -> None:
    """A one-line ValueError for arguments the kernels would read past (the reference raises its
    own errors for them)."""
    E, H = router_weight.shape
    if x.dim() != 2 or x.shape[1] != H:
        raise ValueError(f"fused_moe: x is {tuple(x.shape)}, the router {tuple(router_weight.shape)}: x must be [T, {H}]")
    if gate_up_weight.shape[0] != E or down_weight.shape[0] != E:
        raise ValueError(f"fused_moe: the router has {E} experts, gate_up {gate_up_weight.shape[0]}, "
                         f"down {down_weight.shape[0]}")
    if gate_up_weight.shape[2] != H or down_weight.shape[1] != H or gate_up_weight.shape[1] != 2 * down_weight.shape[2]:
        raise ValueError(f"fused_moe: gate_up {tuple(gate_up_weight.shape)} and down {tuple(down_weight.shape)} are "
                         f"not [E, 2I, {H}] and [E, {H}, I]")
    if not 0 < top_k <= E:
        raise ValueError(f"fused_moe: top_k is {top_k}; it must be in 1..{E} (the experts)")
    if norm_weight is not None and tuple(norm_weight.shape) != (H,):
        raise ValueError(f"fused_moe: the norm weight is {tuple(norm_weight.shape)}, not [{H}]")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"fused_moe: the residual is {tuple(residual.shape)}, x {tuple(x.shape)}: they must match")
    given = [t for t in (x, router_weight, gate_up_weight, down_weight, norm_weight, residual) if t is not None]
    if len({t.dtype for t in given}) != 1:
        raise ValueError("fused_moe: x, the weights and the residual must share one dtype")


def fused_moe(x, router_weight, gate_up_weight, down_weight, top_k: int, renormalize: bool,
              norm_weight=None, norm_eps: float = 0.0, residual=None, form: str | None = None):
    """fused_ops.fused_moe_ref's mixture of SwiGLU experts over x [T, H]: router_weight [E, H],
    gate_up_weight [E, 2I, H] (each expert's gate rows, then its up rows), down_weight [E, H, I];
    x RMS-normalised first when ``norm_weight`` is given, ``residual`` [T, H] added to the
    output when given; out [T, H] in x's dtype. ``form`` forces "decode" or "prefill" (default:
    by the number of pairs, ``use_decode_form``)."""
    if form not in (None, *FORMS):
        raise ValueError(f"form must be None, 'decode' or 'prefill', not {form!r}")
    _check_shapes(x, router_weight, gate_up_weight, down_weight, top_k, norm_weight, residual)
    T = x.shape[0]
    if T == 0:
        return x.new_empty(x.shape)
    x = _rows(x)
    residual = _rows(residual) if residual is not None else None
    norm_weight = _rows(norm_weight) if norm_weight is not None else None
    args = (_rows(router_weight), _rows(gate_up_weight), _rows(down_weight), top_k, renormalize, norm_weight, norm_eps,
            residual)
    decode = (form or ("decode" if use_decode_form(T, top_k) else "prefill")) == "decode"
    if decode and T * top_k > MAX_GRID_Y:
        raise ValueError(f"fused_moe: the decode form takes at most {MAX_GRID_Y} (token, expert) pairs, "
                         f"not {T} x {top_k}")
    return _decode(x, *args) if decode else _prefill(x, *args)
