"""All PERF.md workloads for compiled_llm and Hugging Face transformers, in one process, one
table. Meant for the GPU machine (budget: < 6 minutes on an H100 for Qwen2.5-0.5B shapes):

    python benchmarks/bench_all.py                        # preset qwen2.5-0.5b, bf16, cuda
    python benchmarks/bench_all.py --engine ENGINE_DIR    # an engine built beforehand

Without --engine it builds the preset into a temporary directory first (timed: build, load).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

from compiled_llm.cli.bench import workloads as wl  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="qwen2.5-0.5b", help="model source to build (default preset qwen2.5-0.5b)")
    ap.add_argument("--engine", default=None, help="use this engine directory instead of building one")
    ap.add_argument("--dtype", default="bfloat16", help="build dtype (default bfloat16)")
    ap.add_argument("--workload", action="append", choices=wl.WORKLOADS, help="subset of workloads (repeatable)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly")
    ap.add_argument("--max-model-len", type=int, default=4096, help="engine max length (default 4096)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                    help="engine memory share (default 0.85: leaves room for the HF peer after)")
    args = ap.parse_args(argv)

    import torch

    from compiled_llm import LLM
    from compiled_llm.cli.bench import hf_config_of

    if not torch.cuda.is_available():
        print("warning: no CUDA GPU; this runs on the CPU and will be slow", file=sys.stderr)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    workloads = tuple(args.workload or wl.WORKLOADS)
    info = [f"torch {torch.__version__}", f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"]

    ceilings = wl.measure_ceilings(device) if device.type == "cuda" else None
    if ceilings:
        info.append(f"copy {ceilings['copy_gb_s']:,.0f} GB/s, bf16 matmul {ceilings['matmul_tflop_s']:,.0f} TFLOP/s")
    tmp = None
    engine = args.engine
    if engine is None:
        from compiled_llm.engine.build import build_engine

        tmp = tempfile.TemporaryDirectory(prefix="bench_engine_")
        engine = str(Path(tmp.name) / "engine")
        t0 = time.perf_counter()
        build_engine(args.source, engine, dtype=args.dtype, device=device.type,
                     max_model_len=args.max_model_len, progress=False)
        info.append(f"build {time.perf_counter() - t0:.1f} s ({args.source}, {args.dtype})")

    t0 = time.perf_counter()
    llm = LLM(engine, device=device, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.no_cuda_graphs)
    info.append(f"load {time.perf_counter() - t0:.1f} s (graph capture {llm.stats.graph_capture_s:.1f} s, "
                f"{llm.stats.graphs_captured} buckets, KV {llm.stats.kv_num_blocks} blocks)")
    kernels = (llm.model.manifest or {}).get("kernels")
    if kernels:
        info.append("kernels " + ", ".join(f"{k}={v}" for k, v in sorted(kernels.items())))

    print("; ".join(info), flush=True)
    results = []
    for w in workloads:
        t0 = time.perf_counter()
        results.extend(wl.run_compiled(llm, (w,)))
        print(f"compiled_llm {w} ({time.perf_counter() - t0:.1f} s): {results[-1].metrics} {results[-1].note}", flush=True)
    hf_cfg = hf_config_of(llm)
    config = llm.model.config
    dtype = llm.model.dtype
    del llm
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    if not args.no_hf and hf_cfg is not None:
        # The peer runs in a child process of this run: its torch.compile and CUDA graphs then
        # share nothing with our engine's (a crash there once took our finished numbers with it).
        for w in workloads:
            t0 = time.perf_counter()
            results.append(wl.run_hf_child(hf_cfg, dtype, device.type, w))
            print(f"hf {w} ({time.perf_counter() - t0:.1f} s): {results[-1].metrics} {results[-1].note}", flush=True)

    print(wl.format_table(results))
    if ceilings:
        print(derived_lines(results, config, ceilings))
    if tmp is not None:
        tmp.cleanup()
    return 0


def derived_lines(results, config, ceilings) -> str:
    """What the workloads reach of the ceilings measured in this run."""
    lines = []
    ours = {r.workload: r for r in results if r.system == "compiled_llm"}
    if "latency" in ours:
        roof = ceilings["copy_gb_s"] * 1e9 / wl.weight_bytes(config)
        tok_s = ours["latency"].metrics["decode_tok_s"]
        lines.append(f"latency: {tok_s:,.0f} tok/s = {tok_s / roof:.1%} of the weight-bytes roofline "
                     f"({wl.weight_bytes(config) / 1e9:.3f} GB per token at {ceilings['copy_gb_s']:,.0f} GB/s: {roof:,.0f} tok/s)")
    if "prefill" in ours:
        ttft = ours["prefill"].metrics["ttft_ms"] * 1e-3
        rate = ceilings["matmul_tflop_s"]
        for kind, flops in wl.prefill_flops(config, 1024).items():
            lines.append(f"prefill: {flops / 1e12:.3f} TFLOP ({kind}) in {1e3 * ttft:.2f} ms = {flops / ttft / 1e12:,.0f} TFLOP/s "
                         f"= {flops / ttft / 1e12 / rate:.1%} of the {rate:,.0f} TFLOP/s bf16 matmul rate")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
