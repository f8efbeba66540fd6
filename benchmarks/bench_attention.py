"""Microbenchmark of the paged attention kernels on a GPU (one table, < 1 minute).

Decode (the op as the runtime's decode graphs run it): each timed graph holds one call per layer
of LAYERS layers, each on its own layer cache (so K/V come from HBM, not from an L2 that one
small cache would fit in), and is replayed REPS times between CUDA events. Compared:
  * launches=3: separate kv_store, split-K and reduce kernels (the earlier path),
  * launches=2: KV store folded into the split kernel, separate reduce,
  * launches=1: one kernel (KV store and split reduce folded in), the default.
Block tables are a runtime's full width (max_model_len 4096), which sets the number of splits.

Prefill (T = 1024, one fresh prompt, Qwen2.5-0.5B heads), two timings each: triton's do_bench
(calls launched from Python; when a kernel is shorter than its Python launch this measures the
host) and do_bench_cudagraph (replays of a captured graph: the GPU time):
  * the kernel alone (k/v already stored, max_query_len given) for the default config and a
    few alternatives (--no-sweep to skip them),
  * torch SDPA (flash, is_causal, bf16) on contiguous [1, H, T, D] tensors, with enable_gqa and
    with K/V expanded to every query head beforehand,
  * the whole op (kv_store + host read of max_query_len + kernel; do_bench only, the host read
    cannot be captured). Earlier BENCHMARKS.md prefill numbers were of this kind.
A config that fails to compile or run is reported and skipped.

    python benchmarks/bench_attention.py
    python benchmarks/bench_attention.py --no-sweep --reps 50
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

QWEN = dict(name="qwen2.5-0.5b", Hq=14, Hkv=2, D=64)
LLAMA = dict(name="llama-3.2-1b", Hq=32, Hkv=8, D=64)
DECODE_CASES = [(QWEN, 1, 384), (QWEN, 1, 4096), (QWEN, 64, 1024), (LLAMA, 32, 1024)]
BLOCK = 16
MAX_MODEL_LEN = 4096
DTYPE = torch.bfloat16
PREFILL_SWEEP = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages) besides the default
    (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 8, 3),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8, help="calls (layer caches) per timed graph")
    p.add_argument("--reps", type=int, default=20, help="graph replays per decode timing")
    p.add_argument("--cases", nargs="+", choices=["decode", "prefill"], default=["decode", "prefill"])
    p.add_argument("--no-sweep", action="store_true", help="prefill: the default config only")
    p.add_argument("--prefill-tokens", type=int, default=1024)
    return p.parse_args(argv)


def _cfg_with(kernel: str, **knobs):
    """Install the default table with ``knobs`` set in every bucket of ``kernel``."""
    from compiled_llm.kernels import launch_configs

    table = {kernel: {k: dict(v, **knobs) for k, v in launch_configs.DEFAULT_CONFIGS[kernel].items()}}
    launch_configs.use_configs(table)


# ---------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------


def decode_inputs(m, S, ctx, layers, seed=0):
    """A decode step of S sequences at context ctx over ``layers`` random layer caches:
    (args without the cache, list of layer caches)."""
    from kernel_inputs import attention_case

    case = attention_case([(ctx - 1, 1)] * S, m["Hq"], m["Hkv"], m["D"], BLOCK, DTYPE, "cpu", seed,
                          extra_blocks=0, max_blocks=MAX_MODEL_LEN // BLOCK)
    g = torch.Generator("cuda").manual_seed(seed)
    shape = case.kv_cache.shape
    caches = [torch.randn(shape, generator=g, device="cuda", dtype=DTYPE) for _ in range(layers)]
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in case.args()]
    return args, caches


def time_decode(args, caches, reps) -> float:
    """µs per call: CUDA-graph replay of one call per layer cache."""
    from compiled_llm.kernels import triton_paged_attention as pa

    def step():
        for c in caches:
            pa.paged_attention(*args[:3], c, *args[4:])

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compiles, allocates the split counters
        step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(caches))


def bench_decode(opts, rows):
    from compiled_llm.kernels import launch_configs
    from compiled_llm.kernels import triton_paged_attention as pa

    for m, S, ctx in DECODE_CASES:
        label = f"decode {m['name']} S={S} ctx={ctx}"
        try:
            args, caches = decode_inputs(m, S, ctx, opts.layers)
        except Exception as e:
            rows.append((label, "inputs", f"failed: {type(e).__name__}: {e}"))
            continue
        kv_bytes = S * ctx * m["Hkv"] * m["D"] * 2 * 2
        times = {}
        for launches in (3, 2, 1):
            _cfg_with("paged_attention_decode", LAUNCHES=launches)
            plan = pa.decode_plan(S, m["Hkv"], MAX_MODEL_LEN, torch.device("cuda"))
            what = f"launches={launches} splits={plan['NUM_SPLITS']}"
            try:
                us = time_decode(args, caches, opts.reps)
            except Exception as e:
                rows.append((label, what, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"))
                continue
            times[launches] = us
            note = f"{kv_bytes / us / 1e3:7.0f} GB/s of K/V"
            if launches != 3 and 3 in times:
                note += f"  {times[3] / us:4.2f}x vs launches=3"
            rows.append((label, what, f"{us:8.2f} us  {note}"))
        launch_configs.use_configs(None)
        del caches
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# prefill
# ---------------------------------------------------------------------------------------------


def bench_prefill(opts, rows):
    import torch.nn.functional as F
    import triton

    from compiled_llm.kernels import launch_configs
    from compiled_llm.kernels import triton_kv_store
    from compiled_llm.kernels import triton_paged_attention as pa
    from kernel_inputs import attention_case

    m, T = QWEN, opts.prefill_tokens
    label = f"prefill {m['name']} T={T}"
    case = attention_case([(0, T)], m["Hq"], m["Hkv"], m["D"], BLOCK, DTYPE, "cuda", seed=1)
    cache = case.kv_cache.nan_to_num(0.0)
    triton_kv_store.kv_store(case.k, case.v, cache, case.slot_mapping)
    q, qsl, sl, bt = case.q, case.query_start_loc, case.seq_lens, case.block_tables

    def timed(what, fn, graph=True):
        """'do_bench us / graph us' for the table, and the graph time (None if it failed)."""
        try:
            fn()
            eager = triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3
            replay = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3 if graph else None
        except Exception as e:
            rows.append((label, what, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"))
            return None, None
        text = f"{eager:8.2f} us do_bench" + (f"  {replay:8.2f} us graph" if replay is not None else "")
        return text, replay

    group = m["Hq"] // m["Hkv"]
    qh = q.transpose(0, 1)[None].contiguous()
    kh = case.k.transpose(0, 1)[None].contiguous()
    vh = case.v.transpose(0, 1)[None].contiguous()
    ke, ve = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    sdpa = {
        "torch SDPA enable_gqa": lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=case.scale,
                                                                        enable_gqa=True),
        "torch SDPA K/V expanded": lambda: F.scaled_dot_product_attention(qh, ke, ve, is_causal=True,
                                                                          scale=case.scale),
    }
    base = None
    for what, fn in sdpa.items():
        text, us = timed(what, fn)
        if text is not None:
            base = us if base is None else min(base, us)
            rows.append((label, what, text))

    default = launch_configs.DEFAULT_CONFIGS["paged_attention_prefill"]
    bucket = min((k for k in default if T <= (float("inf") if k == "inf" else int(k))),
                 key=lambda k: float("inf") if k == "inf" else int(k))
    d = default[bucket]
    configs = [(d["BLOCK_M"], d["BLOCK_N"], d["num_warps"], d["num_stages"])]
    if not opts.no_sweep:
        configs += [c for c in PREFILL_SWEEP if c != configs[0]]
    t0 = time.perf_counter()
    for i, (bm, bn, w, st) in enumerate(configs):
        if i and time.perf_counter() - t0 > 30:
            rows.append((label, "sweep", "stopped: time budget"))
            break
        launch_configs.use_configs({"paged_attention_prefill": {"inf": {
            "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st}}})
        _, tokens = pa.prefill_tile(m["Hq"], m["Hkv"], bm)
        what = f"kernel BLOCK_M={bm}({tokens} tok) N={bn} w={w} s={st}" + (" [default]" if i == 0 else "")
        text, us = timed(what, lambda: pa.paged_attention_prefill(q, cache, qsl, sl, bt, case.scale, max_query_len=T))
        if text is not None:
            rows.append((label, what, text + (f"  {us / base:4.2f}x SDPA (graph)" if base else "")))
    launch_configs.use_configs(None)
    op_cache = cache.clone()
    what = "whole op (kv_store + host sync + kernel)"
    text, _ = timed(what, lambda: pa.paged_attention(q, case.k, case.v, op_cache, case.slot_mapping, qsl, sl, bt,
                                                     case.scale), graph=False)
    if text is not None:
        rows.append((label, what, text))


def main(argv=None) -> int:
    opts = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows: list[tuple[str, str, str]] = []
    for name, fn in (("decode", bench_decode), ("prefill", bench_prefill)):
        if name not in opts.cases:
            continue
        try:
            fn(opts, rows)
        except Exception:
            rows.append((name, "crashed", traceback.format_exc().strip().splitlines()[-1][:120]))
    print(f"# paged attention on {torch.cuda.get_device_name()} ({DTYPE}), {time.perf_counter() - t0:.0f} s")
    w0 = max((len(r[0]) for r in rows), default=0)
    w1 = max((len(r[1]) for r in rows), default=0)
    for case, what, result in rows:
        print(f"{case:<{w0}}  {what:<{w1}}  {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
