"""Where a step's time goes, on the GPU: device time of each decode graph bucket against the
wall time of a decode step (the difference is host overhead), and per-kernel device time of an
eager decode step and of a 1,024-token prefill.

    python benchmarks/profile_steps.py [--source qwen2.5-0.5b] [--top 25]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path


def _kernel_table(prof, top: int, per: int = 1) -> str:
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = e.self_cuda_time_total
        if t > 0 and e.device_type.name == "CUDA":
            rows.append((t / per, e.count // per, e.key[:110]))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    lines = [f"  device total {total:.1f} us ({len(rows)} kernel names)"]
    lines += [f"  {t:9.1f} us  x{n:<4d} {k}" for t, n, k in rows[:top]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="qwen2.5-0.5b")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--prefill", type=int, default=1024)
    args = ap.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from compiled_llm import LLM, SamplingParams
    from compiled_llm.engine.build import build_engine
    from compiled_llm.cli.bench.workloads import latency_prompt

    dev = torch.device("cuda")
    tmp = tempfile.TemporaryDirectory(prefix="prof_engine_")
    engine = str(Path(tmp.name) / "engine")
    build_engine(args.source, engine, dtype="bfloat16", device="cuda", max_model_len=4096,
                 progress=False)
    llm = LLM(engine, device=dev, max_model_len=4096, gpu_memory_utilization=0.6)
    runner = llm.engine.runner
    vocab = llm.model.config.vocab_size
    greedy = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate({"prompt_token_ids": latency_prompt(vocab)}, greedy, use_tqdm=False)

    # 1. wall time of a batch-1 decode step (engine loop) vs the device time of its graph
    st = llm.stats
    s0, t0 = st.decode_steps, st.decode_s
    llm.generate({"prompt_token_ids": latency_prompt(vocab, seed=3)}, greedy, use_tqdm=False)
    wall_step = (st.decode_s - t0) / (st.decode_steps - s0)
    print(f"batch-1 decode: engine step wall {1e3 * wall_step:.3f} ms ({1 / wall_step:.0f} tok/s)")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def replay_ms(b: int) -> float:
        for _ in range(5):
            runner.graphs.run(b, b)
        torch.cuda.synchronize()
        start.record()
        for _ in range(50):
            runner.graphs.run(b, b)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 50

    for b in [b for b in (1, 2, 4, 8, 32, 64, 128, 256) if b in runner.graphs.graphs]:
        print(f"  graph bucket {b:4d}: {replay_ms(b):.3f} ms device per replay")

    # 1a. what a decode step runs on the device besides its graph: the engine loop under the
    # profiler, device time per step by op name (graph kernels included), against the step wall
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        s1, t1 = st.decode_steps, st.decode_s
        llm.generate({"prompt_token_ids": latency_prompt(vocab, seed=4)}, greedy, use_tqdm=False)
        torch.cuda.synchronize()
    n_steps = st.decode_steps - s1
    print(f"engine decode loop under the profiler: {n_steps} steps, wall {1e3 * (st.decode_s - t1) / n_steps:.3f} ms/step; "
          f"device time per step by op:")
    print(_kernel_table(prof, 12, per=n_steps))

    # 1b. the same graphs captured without programmatic dependent launch (A/B in one run)
    from compiled_llm.kernels import triton_common
    from compiled_llm.serve.cuda_graphs import StepGraphs

    with_pdl = {b: replay_ms(b) for b in (1, 64) if b in runner.graphs.graphs}
    triton_common.PDL_ENABLED = False
    runner.graphs = StepGraphs()
    runner.prepare_graphs(0)
    runner.capture_all_graphs()
    without = {b: replay_ms(b) for b in with_pdl}
    triton_common.PDL_ENABLED = True
    for b in with_pdl:
        print(f"  graph bucket {b:4d}: {with_pdl[b]:.3f} ms with PDL, {without[b]:.3f} ms without "
              f"({without[b] / with_pdl[b]:.2f}x)")

    # 2. host side of one step without the device: schedule + fill + copy, timed on the host
    t = time.perf_counter()
    n = 0
    while time.perf_counter() - t < 0.5:
        runner._fill_decode([], 1, runner.width)
        n += 1
    print(f"  host fill of an empty decode batch: {1e6 * (time.perf_counter() - t) / n:.1f} us")

    # 3. kernels of one eager decode step (bucket 1) and of one bucket-64 step
    staging = runner.idle_decode_inputs()
    for b in (1, 64):
        views = runner._views(b, b, runner.width, staging.dev)
        with torch.inference_mode():
            for _ in range(3):
                runner._run_program(views)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    runner._run_program(views)
                torch.cuda.synchronize()
        print(f"eager decode step, bucket {b} (per step):")
        print(_kernel_table(prof, args.top, per=5))

    # 4. a prefill of one long prompt through the engine
    p = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": latency_prompt(vocab, args.prefill, seed=10 + i)} for i in range(4)]
    llm.generate(prompts[0], p, use_tqdm=False)
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts[1], p, use_tqdm=False)
    torch.cuda.synchronize()
    print(f"prefill {args.prefill}: generate wall {1e3 * (time.perf_counter() - t):.2f} ms")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        llm.generate(prompts[2], p, use_tqdm=False)
        torch.cuda.synchronize()
    print(f"prefill {args.prefill} kernels:")
    print(_kernel_table(prof, args.top))
    cpu = sorted(prof.key_averages(), key=lambda e: e.cpu_time_total, reverse=True)[:12]
    print("prefill host (cpu_time_total):")
    for e in cpu:
        print(f"  {e.cpu_time_total / 1e3:8.2f} ms x{e.count:<5d} {e.key[:100]}")
    # the host side of a prefill, by Python function
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    llm.generate(prompts[3], p, use_tqdm=False)
    torch.cuda.synchronize()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
    print("prefill host by function (cProfile, tottime):")
    print("\n".join(buf.getvalue().splitlines()[:60]))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
