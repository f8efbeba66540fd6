"""Tune the batch-1 decode launch configs in place, on the whole model: coordinate descent over
the T = 1 bucket of each decode kernel's table, judged by the device time of the bucket-1 decode
CUDA graph (so programmatic dependent launch and the neighbouring kernels count, which a kernel
timed alone misses). Prints each trial and the winning table as JSON for launch_configs.py.

    python benchmarks/tune_decode.py [--source qwen2.5-0.5b] [--rounds 2] [--tables gemv norm_mlp_down]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

# candidate values per (table, knob) of the "1" bucket
SPACE = {
    "norm_mlp_decode": {"BLOCK_I": [1, 2, 4, 8], "BLOCK_H": [256, 512, 1024], "num_warps": [1, 2, 4]},
    "norm_mlp_down": {"BLOCK_N": [1, 2, 4], "BLOCK_K": [1024, 2048, 4096], "num_warps": [4, 8]},
    "gemv": {"BLOCK_N": [1, 2, 4], "BLOCK_K": [512, 1024], "num_warps": [1, 2, 4]},
    "qkv_decode": {"BLOCK_P": [1, 2, 4], "BLOCK_K": [512, 1024], "num_warps": [2, 4]},
    "paged_attention_decode": {"BLOCK_N": [32, 64], "MAX_SPLITS": [4, 8, 16, 32], "num_warps": [2, 4]},
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="qwen2.5-0.5b")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--tables", nargs="+", choices=sorted(SPACE), default=sorted(SPACE),
                    help="tune only these tables (default: all)")
    args = ap.parse_args(argv)

    import torch

    from compiled_llm import LLM
    from compiled_llm.engine.build import build_engine
    from compiled_llm.kernels import launch_configs
    from compiled_llm.serve.cuda_graphs import StepGraphs

    tmp = tempfile.TemporaryDirectory(prefix="tune_engine_")
    engine = str(Path(tmp.name) / "engine")
    build_engine(args.source, engine, dtype="bfloat16", device="cuda", max_model_len=4096,
                 progress=False)
    llm = LLM(engine, device="cuda", max_model_len=4096, gpu_memory_utilization=0.5, max_graph_batch_size=1,
              prefill_graph_max_tokens=0)
    runner = llm.engine.runner
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def graph_us(table) -> float:
        launch_configs.use_configs(table)
        runner.graphs = StepGraphs()
        runner.prepare_graphs(0)
        if not runner.capture_all_graphs():
            return float("inf")
        times = []
        for _ in range(3):
            for _ in range(5):
                runner.graphs.run(1, 1)
            start.record()
            for _ in range(40):
                runner.graphs.run(1, 1)
            end.record()
            torch.cuda.synchronize()
            times.append(1e3 * start.elapsed_time(end) / 40)
        return sorted(times)[1]

    best = launch_configs.current()
    best_us = graph_us(best)
    print(f"start: {best_us:.1f} us per batch-1 decode step", flush=True)
    for r in range(args.rounds):
        for table, knobs in SPACE.items():
            if table not in args.tables:
                continue
            for knob, values in knobs.items():
                for v in values:
                    if best[table]["1"].get(knob) == v:
                        continue
                    trial = copy.deepcopy(best)
                    trial[table]["1"][knob] = v
                    try:
                        us = graph_us(trial)
                    except Exception as e:  # a config that does not compile or launch
                        print(f"  {table}.{knob}={v}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
                        continue
                    mark = ""
                    if us < best_us * 0.995:
                        best, best_us, mark = trial, us, "  <- best"
                    print(f"  {table}.{knob}={v}: {us:.1f} us{mark}", flush=True)
        print(f"round {r + 1}: {best_us:.1f} us ({1e6 / best_us:.0f} steps/s of graph time)", flush=True)
    print(json.dumps({t: {"1": best[t]["1"]} for t in SPACE}, indent=1))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
