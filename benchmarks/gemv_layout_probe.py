"""Probe: does a GEMV whose accumulator holds one fp32 per weight row and thread stream weights
faster than the engine's, whose accumulator holds the whole [rows, BLOCK_K] tile?

The engine's decode GEMVs (triton_gemv) accumulate ``x * w`` into a [BLOCK_T, BLOCK_N, BLOCK_K]
fp32 tile and reduce along K once at the end: each thread keeps 8 fp32 per weight row (one per
bf16 element of its 16-byte vector). Here the weight tile is loaded as [BLOCK_N, BLOCK_K / 8, 8]
so that each thread's 16-byte vector is the last axis; the product is summed over that axis inside
the thread every step, leaving a [BLOCK_N, BLOCK_K / 8] accumulator: 8x fewer accumulator
registers, so more programs fit on an SM and more bytes are in flight.

The one-row layout was prototyped here and now is the engine's ``_gemv_one_row_kernel``, which
this probe times against the general kernel. Times chains of GEMVs (each call's weight is a different copy, so every call streams from HBM as
every layer of a decode step does) in a CUDA graph with PDL, for the Qwen2.5-0.5B decode shapes.
Needs a CUDA GPU; not part of the engine.   python3 benchmarks/gemv_layout_probe.py
"""

from __future__ import annotations

import itertools

import torch
import triton
from barrier_probe import time_graph  # this folder is the script's sys.path[0]

from compiled_llm.kernels import launch_configs
from compiled_llm.kernels.triton_common import pdl_launch, use_pdl
from compiled_llm.kernels.triton_gemv import _gemv_kernel, _gemv_one_row_kernel, tile_config

VEC = 8  # bf16 elements in one 16-byte load


def main() -> None:
    dev = torch.device("cuda")
    calls = 24
    print(f"{torch.cuda.get_device_name()}: {calls} chained calls per graph, µs per call, GB/s of weight bytes")
    print(f"{'shape':<10} {'kernel':<44} {'regs':>5} {'spill':>5} {'us':>7} {'GB/s':>6}")
    for name, N, K in (("o", 896, 896), ("gate_up", 9728, 896), ("down", 896, 4864), ("qkv", 1152, 896)):
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5 for _ in range(calls)]
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        out = torch.empty(1, N, device=dev, dtype=torch.bfloat16)
        ref = (x.float() @ ws[0].float().t())
        pdl = use_pdl(x)
        nbytes = N * K * 2
        table = {"o": "gemv", "gate_up": "gemv", "down": "norm_mlp_down", "qkv": "gemv"}[name]
        rows = []
        # the engine's kernel at its tuned config
        tile = tile_config(launch_configs.get(table, 1), 1, N, K, 2)
        handle = {}

        def engine_step(tile=tile):
            for w in ws:
                handle["k"] = _gemv_kernel[(triton.cdiv(N, tile["BLOCK_ROWS"]), 1)](
                    x, w, w, x, out, 1, N, K, x.stride(0), w.stride(0), 0, out.stride(0),
                    HAS_BIAS=False, HAS_RESIDUAL=False, BLOCK_T=1, BLOCK_N=tile["BLOCK_ROWS"],
                    BLOCK_K=tile["BLOCK_K"], PDL=pdl, num_warps=tile["num_warps"], **pdl_launch(pdl))
        us = time_graph(engine_step)
        rows.append((f"engine {table} N{tile['BLOCK_ROWS']} K{tile['BLOCK_K']} w{tile['num_warps']}",
                     handle["k"], us))
        for bn, bk, nw in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (1, 2, 4, 8)):
            if bk > triton.next_power_of_2(K) or nw * 32 * VEC > bk or bn * bk * 2 > 64 * 1024:
                continue

            def step(bn=bn, bk=bk, nw=nw):
                for w in ws:
                    handle["k"] = _gemv_one_row_kernel[(triton.cdiv(N, bn),)](
                        x, w, w, x, out, N, K, w.stride(0), HAS_BIAS=False, HAS_RESIDUAL=False,
                        BLOCK_N=bn, BLOCK_K=bk, VEC=VEC, PDL=pdl, num_warps=nw, **pdl_launch(pdl))
            try:
                us = time_graph(step)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                print(f"  skip N{bn} K{bk} w{nw}: {type(e).__name__}")
                continue
            step()
            torch.cuda.synchronize()
            err = ((out.float() - (x.float() @ ws[-1].float().t())).abs().max() / ref.abs().max()).item()
            tag = "" if err < 1e-2 else f" WRONG {err:.1e}"
            rows.append((f"one-row N{bn} K{bk} w{nw}{tag}", handle["k"], us))
        rows.sort(key=lambda r: r[2])
        for label, k, us in rows[:8] + [r for r in rows[8:] if r[0].startswith("engine")]:
            print(f"{name:<10} {label:<44} {k.n_regs:>5} {k.n_spills:>5} {us / calls:7.2f} {nbytes * calls / us / 1e3:6.0f}")
        del ws


if __name__ == "__main__":
    main()
