"""Probe: is a grid barrier inside one persistent kernel cheaper than a kernel boundary?

Batch-1 decode is bound by fixed per-kernel costs (benchmarks/NOTES.md), so the question behind a
merged MLP kernel or a persistent per-layer kernel is what one synchronisation point costs in each
form. This chains PHASES dependent GEMVs (y_{i+1} = W_i y_i, W_i [N, K]) three ways and times the
chain inside a CUDA graph:

  kernels      one GEMV launch per phase (triton_gemv, the engine's decode kernel)
  kernels+pdl  the same with programmatic dependent launch (what the engine does)
  barrier      one persistent launch; programs loop over the rows of each phase and meet at a grid
               barrier (an arrival counter in global memory) between phases; each program streams
               its next phase's first weight tile before it waits, as the PDL kernels do

Prints microseconds per phase and GB/s. Needs a CUDA GPU; not part of the engine.
    python3 benchmarks/barrier_probe.py [--phases 48] [--n 896]

Measured on an H200 (2026-11-22, BENCHMARKS.md): 48 phases of [896, 896] took 1.55 us a phase as
PDL kernels, 2.15 us as plain kernels and 2.1-2.7 us with the grid barrier, so the engine keeps
kernel boundaries (with PDL) rather than barriers.
"""

from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl

from compiled_llm.kernels import triton_common
from compiled_llm.kernels.triton_common import sm_count
from compiled_llm.kernels.triton_gemv import gemv


@triton.jit
def _grid_barrier(counter_ptr, num_programs):
    # every thread's stores are issued before the arrival (CTA barrier), the arrival releases them
    # at GPU scope, and the spin acquires everyone else's; the counter only grows, so a program's
    # ticket says which round it is in and nothing has to reset it
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    target = (ticket // num_programs + 1) * num_programs
    seen = ticket + 1
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _chain_kernel(w_ptr, y_ptr, counter_ptr, PHASES, N, K,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    items = tl.cdiv(N, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    offs_first = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_first = (offs_first < N)[:, None] & mask_k[None, :]
    w_first_off = offs_first.to(tl.int64)[:, None] * K + offs_k[None, :]
    w_next = tl.load(w_ptr + w_first_off, mask=mask_first, other=0.0, eviction_policy="evict_first")
    for ph in range(0, PHASES):
        x = tl.load(y_ptr + ph * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        y = tl.sum(w_next.to(tl.float32) * x[None, :], 1)
        tl.store(y_ptr + (ph + 1) * K + offs_first, y.to(y_ptr.dtype.element_ty), mask=offs_first < N)
        w_phase = w_ptr + (N * K).to(tl.int64) * ph
        for item in range(pid + P, items, P):
            offs_n = item * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            w = tl.load(w_phase + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :],
                        mask=mask_n[:, None] & mask_k[None, :], other=0.0, eviction_policy="evict_first")
            y = tl.sum(w.to(tl.float32) * x[None, :], 1)
            tl.store(y_ptr + (ph + 1) * K + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)
        # the next phase's first tile needs nothing from this phase: stream it before waiting
        w_next = tl.load(w_phase + N * K + w_first_off, mask=mask_first & ((offs_first * 0 + ph + 1) < PHASES)[:, None], other=0.0,
                         eviction_policy="evict_first")
        _grid_barrier(counter_ptr, P)


def time_graph(fn, iters: int = 50) -> float:
    """Median microseconds of one replay of ``fn`` captured in a CUDA graph."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", type=int, default=48)
    ap.add_argument("--n", type=int, default=896, help="rows and columns of each square GEMV (phases chain)")
    ap.add_argument("--programs-per-sm", type=int, default=2)
    args = ap.parse_args()
    dev = torch.device("cuda")
    P, N, K = args.phases, args.n, args.n
    w = torch.randn(P, N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5
    y0 = torch.randn(K, device=dev, dtype=torch.bfloat16)
    bytes_per_phase = N * K * 2

    def chain_kernels():
        y = y0[None]
        for i in range(P):
            y = gemv(y, w[i])
        return y

    rows = []
    for label, pdl in (("kernels", "0"), ("kernels+pdl", "1")):
        triton_common.PDL_ENABLED = pdl == "1"
        rows.append((label, time_graph(chain_kernels)))
    triton_common.PDL_ENABLED = True
    ref = chain_kernels()

    counter = torch.zeros(1, device=dev, dtype=torch.int32)
    ybuf = torch.empty(P + 1, K, device=dev, dtype=torch.bfloat16)
    programs = sm_count(dev) * args.programs_per_sm
    for block_n in (2, 4, 8):
        block_k = triton.next_power_of_2(K)

        def chain_barrier():
            ybuf[0].copy_(y0)
            _chain_kernel[(programs,)](w, ybuf, counter, P, N, K, BLOCK_N=block_n, BLOCK_K=block_k,
                                       num_warps=4)
            return ybuf[P]

        err = (chain_barrier().float() - ref[0].float()).abs().max().item()
        rows.append((f"barrier BLOCK_N={block_n} ({programs} programs, max|diff| {err:.2e})", time_graph(chain_barrier)))

    print(f"{P} phases of a [{N}, {K}] bf16 GEMV ({bytes_per_phase / 1e6:.2f} MB each), {torch.cuda.get_device_name()}")
    print(f"{'form':<60} {'us/phase':>9} {'GB/s':>7}")
    for label, us in rows:
        print(f"{label:<60} {us / P:9.2f} {bytes_per_phase * P / us / 1e3:7.0f}")


if __name__ == "__main__":
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    main()
