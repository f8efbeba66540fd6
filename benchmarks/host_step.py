"""The engine's host time a decode step, with the model's forward stubbed out.

    python benchmarks/host_step.py [--rows 256] [--stream] [--steps 200] [--preset tiny-qwen2]

A GPU decode step of a small model at a large batch is a couple of milliseconds of device work,
and the engine's Python for that step (schedule the step ahead, fill its inputs, sample, apply the
tokens, build the streamed outputs, and the engine process's message) runs beside it: when the
Python takes longer, the device waits. This measures that Python alone, on any machine: ``rows``
requests decode on a CPU engine whose program returns a fixed logits tensor (no forward), and each
``LLMEngine.step_deltas`` call, with the engine process's snapshot and pickled message, is timed.
The sampler still runs (on a CPU it is a few torch ops over a tiny vocabulary, on a GPU one kernel
launch). ``--stream``: every request streamed, as the server's are; ``--reader-every N``: its front
end reads every N steps, and the engine holds the streams back while it is behind.
Prints the median and mean milliseconds a step, and a breakdown by phase.
"""

from __future__ import annotations

import argparse
import collections
import pickle
import random
import statistics
import time

import torch

PHASES = {
    "scheduler": ("compiled_llm.serve.core.scheduler", "Scheduler", ("schedule_ahead", "update")),
    "runner": ("compiled_llm.serve.worker.model_runner", "ModelRunner", ("prepare_decode", "_sample")),
    "engine": ("compiled_llm.serve.llm_engine", "LLMEngine", ("_delta",)),
}


def timed_phases(totals: dict) -> None:
    """Wrap the phases' methods so that each adds its seconds to ``totals``."""
    import importlib

    for module_name, cls_name, methods in PHASES.values():
        cls = getattr(importlib.import_module(module_name), cls_name)
        for name in methods:
            fn = getattr(cls, name)

            def wrapped(*a, _fn=fn, _name=f"{cls_name}.{name}", **k):
                t = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    totals[_name] += time.perf_counter() - t

            setattr(cls, name, wrapped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny-qwen2")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--phases", action="store_true", help="time the phases too (adds a little to each)")
    ap.add_argument("--reader-every", type=int, default=1, metavar="N",
                    help="with --stream: the front end reads the engine's outputs every N steps, and the "
                         "engine holds the streams back in between, as its process does (default 1: every step)")
    args = ap.parse_args()

    from compiled_llm import LLM, SamplingParams
    from compiled_llm.serve.engine_process.engine_messages import EngineSnapshot, OutputAssembler
    from compiled_llm.serve.worker.model_runner import ModelRunner

    llm = LLM(args.preset, device="cpu", max_num_seqs=args.rows)
    engine = llm.engine
    logits = torch.randn(2 * args.rows, llm.model.config.vocab_size)
    ModelRunner._run_program = lambda self, batch: logits  # the forward, stubbed: rows are sliced from it
    totals: dict = collections.defaultdict(float)
    if args.phases:
        timed_phases(totals)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.steps + 16, temperature=0.6, ignore_eos=True)
    for i in range(args.rows):
        ids = [rng.randint(0, min(llm.model.config.vocab_size, 10_000) - 1) for _ in range(rng.randint(16, 64))]
        text, prompt_ids, p = engine.validate({"prompt_token_ids": ids}, params)
        engine.add_request(None, request_id=str(i), stream=args.stream,
                           _validated=(text, prompt_ids, OutputAssembler.engine_params(p, engine.tokenizer)))
    for _ in range(8):  # the prefill steps, and the first decode steps queued ahead
        engine.step_deltas()
    totals.clear()
    times = []
    for i in range(args.steps):
        behind = args.reader_every > 1 and i % args.reader_every != 0
        t = time.perf_counter()
        deltas = engine.step_deltas(hold_streams=behind)
        pickle.dumps(("step", deltas, [], [], EngineSnapshot.of(engine)), protocol=pickle.HIGHEST_PROTOCOL)
        times.append(time.perf_counter() - t)
    reader = f", read every {args.reader_every} steps" if args.stream and args.reader_every > 1 else ""
    print(f"{args.rows} rows{', streamed' if args.stream else ''}{reader}: host time a decode step, median "
          f"{1e3 * statistics.median(times):.3f} ms, mean {1e3 * statistics.mean(times):.3f} ms ({args.steps} steps)")
    for name, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {1e3 * seconds / args.steps:.3f} ms")


if __name__ == "__main__":
    main()
