"""Megakernel variants timed on one engine and one decode step, in one process: what a kernel
change is worth, measured against the kernel it replaces without the noise between runs.

    python benchmarks/megakernel_variants.py ENGINE [--context 256] [--rows 1] VARIANT...

A VARIANT is ``NAME[,KEY=VALUE...]``: NAME is ``new`` (this tree's triton_kernel.py) or the path
of another copy of that file (``git show main:compiled_llm/megakernel/triton_kernel.py >
/tmp/main_kernel.py``: the same launch() signature; it reads this tree's encoding, so it is a fair
comparison only while the schedule's ops are ones that file runs: a change that adds an op or
re-tiles one needs an engine per tree, ``bash benchmarks/gpu_suite.sh megakernel``); the keys are
``w`` (warps; by default the file's launch() default) and compile-time sizes passed to launch() (``BLOCK_L=128``, ``PREFETCH=1``, ...),
which only ``new`` takes. Each variant is launched 20 times (CUDA events around each, median
printed) on the step ``benchmarks/megakernel_timeline.py`` times, and its logits are compared
with the first variant's. The activation buffers are set to NaN before each variant's first
launch, so a kernel that skips an op shows NaN logits instead of another variant's output. ``--timed`` adds each variant's split of the SMs' time (its TIMED form).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch


def kernel_module(name: str):
    if name == "new":
        from compiled_llm.megakernel import triton_kernel

        return triton_kernel
    spec = importlib.util.spec_from_file_location(f"megakernel_variant_{abs(hash(name))}", name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_variant(text: str) -> tuple[str, dict, dict]:
    """(kernel, launch keywords, sizes) of ``NAME[,KEY=VALUE...]``."""
    name, *pairs = text.split(",")
    kw = dict(p.split("=", 1) for p in pairs)
    launch = {"num_warps": int(kw.pop("w"))} if "w" in kw else {}
    sizes = {k: int(v) for k, v in kw.items()}
    return name, {**launch, **({"sizes": sizes} if sizes else {})}, sizes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("engine")
    p.add_argument("variants", nargs="+")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--timed", action="store_true")
    args = p.parse_args()

    from megakernel_timeline import decode_step

    from compiled_llm.megakernel.timeline import measured, spent_lines

    engine, program, batch, kv = decode_step(args.engine, args.rows, args.context)
    s = program.schedule
    program(engine.params, batch, kv)  # encodes the schedule
    state = program.device_state(engine.params, kv)
    step_args = (batch.token_ids, batch.positions, batch.slot_mapping, batch.seq_lens, batch.block_tables, kv)
    first = None
    for text in args.variants:
        name, launch_kw, _ = parse_variant(text)
        module = kernel_module(name)

        for buffer in state.buffers.values():  # what this variant does not write stays NaN (or -1)
            buffer.fill_(float("nan") if buffer.is_floating_point() else -1)

        def step(stamps=None):
            state.counters.zero_()
            module.launch(state.encoded, state.counters, s.num_sms, *step_args, stamps=stamps, **launch_kw)

        t0 = time.time()
        step()
        torch.cuda.synchronize()
        compile_s = time.time() - t0
        logits = state.logits[:args.rows].float().clone()
        first = logits if first is None else first
        diff = ((logits - first).abs().max() / first.abs().max()).item()
        if not torch.isfinite(logits).all():
            print(f"{text}: its logits are not finite: it left part of the step unwritten (an op it does not run?)")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        print(f"{text}: step {statistics.median(times):.1f} us (min {min(times):.1f}); logits differ from the "
              f"first variant's by {diff:.2e} of their largest; first launch {compile_s:.0f} s", flush=True)
        if args.timed:
            stamps = torch.zeros((len(s.instructions), 3), dtype=torch.int64, device="cuda")
            for _ in range(2):  # the first compiles the TIMED form
                step(stamps)
            torch.cuda.synchronize()
            print("\n".join(spent_lines(measured(s, stamps.cpu().tolist())[1], s.num_sms)), flush=True)


if __name__ == "__main__":
    main()
