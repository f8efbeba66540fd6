"""Does prefetching a layer's MLP weights into L2 while attention runs make the MLP faster?

At batch-1 decode the MLP's two GEMV kernels stream 26 MB per layer (Qwen2.5-0.5B) from HBM at
about half the copy bandwidth, while the q/k/v, attention and o kernels before them (~10 µs) leave
HBM mostly idle. This probe models one layer as ``delay (stands in for those kernels) -> MLP`` over
24 layers of distinct weights (more bytes than L2 holds, as in a real step) and times, as CUDA-graph
replays, the MLP alone, delay + MLP, and the same with an L2 prefetch of the MLP weights issued
before the delay (in the stream, or on a side stream that runs beside the delay).

Result on an H200 (2026-11-22, Qwen2.5-0.5B shapes, benchmarks/NOTES.md): no. The gate/up kernel
takes 6.55 µs/layer streaming from HBM and still 5.30 µs with its 17.4 MB already in L2, so these
kernels are bound by their fixed costs (ramp-up, the reduction, the tail), not by HBM; an
in-stream prefetch costs ~1.7 µs and saves nothing, a side-stream one saves ~1.4 µs of 23. The
engine does not prefetch; this probe stays so the finding can be re-checked on other GPUs.

    python benchmarks/l2_prefetch_probe.py [--delay-us 10] [--model qwen2.5-0.5b]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from compiled_llm.kernels.triton_common import pdl_launch, pdl_open, pdl_wait, use_pdl  # noqa: E402

MODELS = {"qwen2.5-0.5b": (896, 4864), "llama-3.2-1b": (2048, 8192)}

# ---------------------------------------------------------------------------------------------
# two ways to pull weights into L2 ahead of use: fire-and-forget ``prefetch.global.L2`` (inline
# PTX, sm_80+), and real ``ld.global.cg`` loads whose values feed a store that never happens
# ---------------------------------------------------------------------------------------------

LINE_BYTES = 128
LINES_PER_PROGRAM = 1024  # 128 threads x 8 lines: 128 KB of prefetches per program
MAX_TENSORS = 4


@triton.jit
def _prefetch_lines(base, nbytes, LINES: tl.constexpr, EVICT_LAST: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * LINES
    if start * 128 < nbytes:
        # past the end, clamp to the last byte: a repeated prefetch is harmless, and inline asm
        # cannot be masked
        offs = tl.minimum((start + tl.arange(0, LINES)) * 128, nbytes - 1)
        ptrs = base + offs
        if EVICT_LAST:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                      dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_l2_kernel(p0, n0, p1, n1, p2, n2, p3, n3,
                        LINES: tl.constexpr, EVICT_LAST: tl.constexpr, PDL: tl.constexpr):
    """Grid (programs, tensors): program (i, j) prefetches lines [i*LINES, (i+1)*LINES) of
    tensor j (byte pointers ``p*`` of ``n*`` bytes)."""
    pdl_open(PDL)
    which = tl.program_id(1)
    if which == 0:
        _prefetch_lines(p0, n0, LINES, EVICT_LAST)
    elif which == 1:
        _prefetch_lines(p1, n1, LINES, EVICT_LAST)
    elif which == 2:
        _prefetch_lines(p2, n2, LINES, EVICT_LAST)
    else:
        _prefetch_lines(p3, n3, LINES, EVICT_LAST)
    # keep the PDL chain: our successor's wait must also cover our predecessor
    pdl_wait(PDL)


@triton.jit
def _load_lines_kernel(p0, n0, p1, n1, p2, n2, p3, n3, sink_ptr, LINES: tl.constexpr):
    """Read the lines for real (ld.global.cg: L2 only) and keep a dummy dependency on them."""
    which = tl.program_id(1)
    base = p0
    n = n0
    if which == 1:
        base = p1
        n = n1
    elif which == 2:
        base = p2
        n = n2
    elif which == 3:
        base = p3
        n = n3
    start = tl.program_id(0).to(tl.int64) * LINES
    if start * 128 < n:
        offs = tl.minimum((start + tl.arange(0, LINES)) * 128, n - 1)
        v = tl.load(base + offs, cache_modifier=".cg")
        s = tl.sum(v.to(tl.int32), 0)
        tl.store(sink_ptr, s, mask=s == -12345)


def _byte_args(tensors) -> tuple[list, tuple[int, int]]:
    """The kernels' (pointer, bytes) pairs, padded to MAX_TENSORS, and their grid."""
    views = [t.view(-1).view(torch.uint8) for t in tensors]
    args = []
    for v in views + [views[0]] * (MAX_TENSORS - len(views)):
        args += [v, v.numel()]
    lines = max(triton.cdiv(v.numel(), LINE_BYTES) for v in views)
    return args, (triton.cdiv(lines, LINES_PER_PROGRAM), len(views))


def load_l2(tensors, sink):
    args, grid = _byte_args(tensors)
    _load_lines_kernel[grid](*args, sink, LINES=LINES_PER_PROGRAM, num_warps=8)


def can_prefetch(t: torch.Tensor) -> bool:
    """Prefetch needs compiled PTX on an sm_80+ GPU (the interpreter has no inline asm)."""
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(t.device)[0] >= 8


def prefetch_l2(tensors: Sequence[torch.Tensor], evict_last: bool = True):
    """Start moving ``tensors`` (on one CUDA device) into L2; returns at once, with the launched
    kernel (None when nothing was launched). A no-op where prefetching is unavailable (CPU, the
    interpreter, pre-Ampere GPUs); non-contiguous tensors are skipped (a copy would be prefetched,
    not the tensor)."""
    tensors = [t for t in tensors if t is not None and t.numel() > 0 and t.is_contiguous()]
    if not tensors or not can_prefetch(tensors[0]):
        return None
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"prefetch_l2 takes at most {MAX_TENSORS} tensors, got {len(tensors)}")
    args, grid = _byte_args(tensors)
    pdl = use_pdl(tensors[0])
    return _prefetch_l2_kernel[grid](*args, LINES=LINES_PER_PROGRAM, EVICT_LAST=evict_last, PDL=pdl,
                                     num_warps=4, **pdl_launch(pdl))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(MODELS))
    ap.add_argument("--delay-us", type=float, default=10.0)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--replays", type=int, default=30)
    args = ap.parse_args(argv)

    from compiled_llm.kernels.triton_gemv import gemv
    from compiled_llm.kernels.triton_norm_mlp import decode_activation

    H, inter = MODELS[args.model]
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    w_gu = [torch.randn(2 * inter, H, device=dev, dtype=dt, generator=gen) * 0.02 for _ in range(args.layers)]
    w_d = [torch.randn(H, inter, device=dev, dtype=dt, generator=gen) * 0.02 for _ in range(args.layers)]
    x = torch.randn(1, H, device=dev, dtype=dt, generator=gen)
    nw = torch.ones(H, device=dev, dtype=dt)
    # torch.cuda._sleep spins for a number of clock cycles: calibrate cycles per microsecond
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    end.synchronize()
    cycles = int(args.delay_us * 2_000_000 / (start.elapsed_time(end) * 1e3))
    k = prefetch_l2([w_gu[0]])
    ptx = k.asm["ptx"] if k is not None else ""
    print(f"prefetch kernel: {ptx.count('prefetch.global')} prefetch instructions in its PTX")

    def mlp(layer):
        act = decode_activation(x, nw, None, 1e-6, w_gu[layer], None, True, True)
        return gemv(act, w_d[layer], None, x, config="norm_mlp_down")

    side = torch.cuda.Stream()
    sink = torch.zeros(1, device=dev, dtype=torch.int32)

    def gate_up_only(same: bool):
        def step():
            for layer in range(args.layers):
                decode_activation(x, nw, None, 1e-6, w_gu[0 if same else layer], None, True, True)
        return step

    def variant(delay: bool, prefetch: tuple, evict_last: bool = True, how: str = "prefetch", same: bool = False):
        def step():
            for layer in range(args.layers):
                wl = 0 if same else layer
                tensors = [t for name, t in (("gu", w_gu[wl]), ("d", w_d[wl])) if name in prefetch]
                if tensors and how == "prefetch":
                    prefetch_l2(tensors, evict_last=evict_last)
                if tensors and how in ("side-prefetch", "side-load"):
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        if how == "side-prefetch":
                            prefetch_l2(tensors, evict_last=evict_last)
                        else:
                            load_l2(tensors, sink)
                if delay:
                    torch.cuda._sleep(cycles)
                if tensors and how.startswith("side"):
                    torch.cuda.current_stream().wait_stream(side)
                mlp(wl)
        return step

    def time_graph(step) -> float:
        step()  # compile
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        for _ in range(3):
            g.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(args.replays):
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / args.layers)
        times.sort()
        return times[len(times) // 2]

    mlp_bytes = 3 * H * inter * 2
    print(f"{args.model}: MLP weights {mlp_bytes / 1e6:.1f} MB/layer, {args.layers} layers, delay {args.delay_us} us "
          f"({cycles} cycles)")
    rows = [
        ("delay only", lambda: [torch.cuda._sleep(cycles) for _ in range(args.layers)]),
        ("MLP only", variant(False, ())),
        ("delay + MLP", variant(True, ())),
        ("prefetch gate/up + delay + MLP", variant(True, ("gu",))),
        ("prefetch gate/up+down + delay + MLP", variant(True, ("gu", "d"))),
        ("prefetch gate/up+down (evict_normal) + delay + MLP", variant(True, ("gu", "d"), evict_last=False)),
        ("prefetch gate/up+down + MLP (no delay)", variant(False, ("gu", "d"))),
        ("MLP only, one layer's weights (L2-resident)", variant(False, (), same=True)),
        ("side-stream prefetch gu+d || delay, MLP", variant(True, ("gu", "d"), how="side-prefetch")),
        ("gate/up kernel only, rotating weights", gate_up_only(False)),
        ("gate/up kernel only, one layer's weights", gate_up_only(True)),
        ("side-stream prefetch gu || delay, MLP", variant(True, ("gu",), how="side-prefetch")),
        ("side-stream prefetch d || delay, MLP", variant(True, ("d",), how="side-prefetch")),
        ("side-stream prefetch gu (normal) || delay, MLP", variant(True, ("gu",), evict_last=False, how="side-prefetch")),
        ("side-stream ld.cg gu+d || delay, MLP", variant(True, ("gu", "d"), how="side-load")),
        ("side-stream ld.cg gu || delay, MLP", variant(True, ("gu",), how="side-load")),
    ]
    for name, step in rows:
        us = time_graph(step)
        print(f"  {name:55s} {us:7.2f} us/layer", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
