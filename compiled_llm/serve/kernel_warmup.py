"""``python -m compiled_llm.serve.kernel_warmup ENGINE_DIR DEVICE PARTS PART``: one share of a
CUDA build's kernel warm-up (``compiled_llm.engine.kernel_cache.warm_kernels`` starts PARTS of
these at once): the runtime runs over the engine just written, with Triton compiling into the
engine's ``kernels/triton`` directory, so that loading the engine later compiles nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from compiled_llm.engine.kernel_cache import KERNELS_DIR, triton_cache_at
from compiled_llm.serve.llm import LLM
from compiled_llm.serve.sampling_params import SamplingParams

# a KV cache big enough for the real steps below, small enough for several processes at once
SHARE_KV_BLOCKS = 64


def warm(engine_dir: Path, device: torch.device, part: int = 0, parts: int = 1) -> None:
    """Share ``part`` of ``parts`` of the warm-up (all of it by default), in this process."""
    options = {} if parts == 1 else {"num_blocks": SHARE_KV_BLOCKS}
    llm = LLM(str(engine_dir), device=device, **options)
    # the two extra jobs go to different processes (the last and the one before), so none of
    # them waits on both
    if parts > 1 and part == max(parts - 2, 0):
        llm.engine.profile_largest_step()  # what the KV sizing of a real load runs
    llm.engine.capture_cuda_graphs(part, parts)  # graph buckets, on inputs that write nowhere
    if part == parts - 1:
        # Real steps on top: Triton specialises integer arguments equal to 1 or divisible by
        # 16 (sequence counts, lengths), which the idle capture inputs do not cover. One and
        # three sequences, lengths that cross a multiple of 16, greedy and sampled.
        for temperature in (0.0, 0.7):
            params = SamplingParams(max_tokens=4, temperature=temperature, ignore_eos=True)
            for lengths in ([14], [5, 37, 16]):
                prompts = [{"prompt_token_ids": [1 + (i % 7) for i in range(n)]} for n in lengths]
                llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize(device)


def main(argv: list[str]) -> int:
    engine_dir, device, parts, part = Path(argv[0]), torch.device(argv[1]), int(argv[2]), int(argv[3])
    with triton_cache_at(engine_dir / KERNELS_DIR):
        warm(engine_dir, device, part, parts)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
