"""Greedy agreement of a tensor-parallel engine with the unsharded one, on a checkpoint trained by
``train_synthetic_lm.py`` (real logit margins, so a flipped pick is a sharding error, not noise).

    python benchmarks/tp_agreement.py CHECKPOINT_DIR [--tensor-parallel-size 2] [--prompts 16]
        [--tokens 64] [--device cuda|cpu] [--dtype bfloat16|float32]

The acceptance point (issue 16): at least 99% over 16 prompts x 64 tokens, TP=2 against TP=1,
bf16 on GPUs. Counted as ``quant_accuracy.py`` counts it: the sharded engine generates greedily,
the unsharded one is fed those tokens (teacher forcing), and every position compares picks for
the same context; free-running, how many continuations are identical. Prints one JSON line;
exit status 0 when the agreement holds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import kernel_bench
import quant_accuracy as qa

from compiled_llm import LLM

THRESHOLD = 0.99


def measure(args) -> dict:
    prompts = kernel_bench.read_prompts(args.checkpoint / "prompts.json", args.prompts)
    options = {"device": args.device, "dtype": args.dtype}

    def load(size: int) -> LLM:
        return LLM(str(args.checkpoint), tensor_parallel_size=size, **options)

    sharded = load(args.tensor_parallel_size)
    try:
        got = qa.greedy(sharded, prompts, args.tokens)
    finally:
        sharded.shutdown()
    del sharded
    qa.free(None)  # rank 0's weights and KV cache leave cuda:0 before the unsharded engine sizes its own
    whole = load(1)
    reference = qa.greedy(whole, prompts, args.tokens)
    forced = qa.teacher_forced(whole, prompts, got)
    return {"tensor_parallel_size": args.tensor_parallel_size, "prompts": len(prompts), "tokens": args.tokens,
            **forced, **qa.free_running(got, reference), "pass": forced["agreement"] >= THRESHOLD}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path, help="a train_synthetic_lm.py output directory")
    p.add_argument("--tensor-parallel-size", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--dtype", default="auto", help="auto: bf16 on a GPU, float32 on a CPU")
    return p


def main(argv=None) -> int:
    report = measure(parser().parse_args(argv))
    print(json.dumps(report))
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
