"""One megakernel decode step timed on the GPU, instruction by instruction: the per-SM timeline
and where the step's time goes (issue 46's "per-SM timeline of one step").

    python benchmarks/megakernel_timeline.py ENGINE [--rows 1] [--context 1024] [--width 120] [--sms 8]

ENGINE is built with ``--decode-backend megakernel`` (``--load-format dummy`` is fine: timing
does not depend on weight values). The step decodes ``--rows`` sequences whose caches hold
``--context`` tokens of random keys and values; a few untimed steps warm it up, then the
kernel's TIMED form stamps every instruction's wait, run and end with ``%globaltimer``. Printed:
the split of the SMs' time (each kind's running time, waiting on counters, idle) and the
timeline of the first ``--sms`` SMs (all with ``--sms 0``), measured, beside the scheduler's
estimate of the same step. The timed form reads the clock three times an instruction, so its
step is a little slower than an untimed one, whose time is printed too.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch


def decode_batch(rows: int, context: int, block_size: int):
    from compiled_llm.graph.batch import ScheduledSeq, pack_batch

    blocks = math.ceil((context + 1) / block_size)
    seqs = [ScheduledSeq([7 + i], context, list(range(i * blocks, (i + 1) * blocks))) for i in range(rows)]
    return pack_batch(seqs, block_size, "cuda"), rows * blocks


def decode_step(engine_dir: str, rows: int, context: int, block_size: int = 16):
    """(engine, its MegakernelProgram, a decode batch of ``rows`` rows at ``context`` tokens,
    a KV cache of random keys and values) on the GPU: the step this script and
    megakernel_variants.py time."""
    from compiled_llm.engine.artifact import load_engine
    from compiled_llm.megakernel.program import MegakernelProgram
    from compiled_llm.model.spec import kv_cache_shape

    engine = load_engine(engine_dir, device="cuda")
    if not isinstance(engine.program, MegakernelProgram):
        raise SystemExit(f"{engine_dir} was not built with --decode-backend megakernel")
    batch, num_blocks = decode_batch(rows, context, block_size)
    kv = (torch.randn(kv_cache_shape(engine.config, num_blocks, block_size), device="cuda") * 0.5).to(engine.dtype)
    return engine, engine.program, batch, kv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("engine")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--width", type=int, default=120)
    p.add_argument("--sms", type=int, default=8, help="SM rows to draw (0: all)")
    args = p.parse_args()

    from compiled_llm.megakernel import triton_kernel
    from compiled_llm.megakernel.timeline import measured, spent_lines, timeline

    engine, program, batch, kv = decode_step(args.engine, args.rows, args.context)
    s = program.schedule
    for _ in range(3):
        program(engine.params, batch, kv)
    torch.cuda.synchronize()
    # the untimed step, for comparison: CUDA events around 20 launches
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        program(engine.params, batch, kv)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    state = program.device_state(engine.params, kv)
    stamps = torch.zeros((len(s.instructions), 3), dtype=torch.int64, device="cuda")
    for _ in range(2):  # the first timed launch compiles the TIMED form
        state.counters.zero_()
        triton_kernel.launch(state.encoded, state.counters, s.num_sms, batch.token_ids, batch.positions,
                             batch.slot_mapping, batch.seq_lens, batch.block_tables, kv, stamps=stamps)
    torch.cuda.synchronize()
    timed, spent = measured(s, stamps.cpu().tolist())
    print(f"{args.engine}: {args.rows} row(s), context {args.context}; untimed step (events, median of 20): "
          f"{statistics.median(times):.1f} us")
    print("\n".join(spent_lines(spent, s.num_sms)))
    keep = s.num_sms if args.sms == 0 else args.sms

    def first_sms(text: str) -> str:
        lines = text.splitlines()
        head = [line for line in lines if not line.startswith("SM ")]
        return "\n".join(head + [line for line in lines if line.startswith("SM ")][:keep])

    print("\nmeasured:")
    print(first_sms(timeline(timed, args.width, source="measured")))
    print("\nthe scheduler's estimate:")
    print(first_sms(timeline(s, args.width)))


if __name__ == "__main__":
    main()
