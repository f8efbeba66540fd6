"""A CUDA build's kernel warm-up: the runtime run once over the engine just written, with
Triton compiling into the engine's ``kernels/triton`` directory, so that loading the engine
later compiles nothing (``compiled_llm.engine.kernel_cache``).

``warm_kernels(engine_dir, device)`` is what the layers that own the runtime (``compiled-llm
build``, and ``LLM`` / ``run`` / ``serve`` / ``bench`` building a SOURCE into the engine cache)
hand to ``build_engine`` as its ``warm_up``: the build calls it after writing the engine and
before swapping it into place. It starts the warm-up's shares as fresh processes,

    python -m compiled_llm.serve.kernel_warmup ENGINE_DIR DEVICE PARTS PART

each running ``warm`` on its share with Triton's cache pointed at the engine's.
"""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from compiled_llm.engine.artifact import build_config, loaded_weight_bytes, read_manifest
from compiled_llm.engine.kernel_cache import KERNELS_DIR, triton_cache_at
from compiled_llm.engine.loader import load_model
from compiled_llm.errors import EngineError
from compiled_llm.kernels import registry
from compiled_llm.serve.core.block_manager import cdiv
from compiled_llm.serve.engine_config import EngineConfig
from compiled_llm.serve.llm_engine import LLMEngine
from compiled_llm.serve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# a KV cache big enough for the real steps below, small enough for several processes at once
SHARE_KV_BLOCKS = 64
# what a warm-up process holds besides the weights: CUDA context, a small KV cache, the largest
# step's activations and sampling rows, the graph pool
_WARM_PROCESS_OVERHEAD = 3 << 30
_CHILD_TIMEOUT_S = 900


def warm_kernels(engine_dir: Path, device: torch.device, workers: int | None = None) -> None:
    """Run the runtime over the engine in ``engine_dir`` with Triton compiling into
    ``engine_dir/kernels/triton``.

    Triton compiles on the host, one kernel at a time per process, so the work is split over
    ``workers`` processes (``warm_workers()``) that share the cache directory (Triton writes
    each entry with an atomic rename): each captures its share of the graph buckets, and one
    also runs the KV-sizing step and real steps (``warm``). If any of them fails, one process
    warms everything, compiling only what is still missing."""
    engine_dir = Path(engine_dir)
    (engine_dir / KERNELS_DIR).mkdir(parents=True, exist_ok=True)
    gc.collect()
    torch.cuda.empty_cache()  # the build's own copies of the weights must not shrink the KV cache
    built = build_config(read_manifest(engine_dir))
    if built.tensor_parallel_size * built.pipeline_parallel_size > 1:
        workers = 1  # each share would start a process per rank, on every GPU
    elif workers is None:
        workers = warm_workers(loaded_weight_bytes(engine_dir), torch.cuda.mem_get_info(device)[0])
    if not _warm_in_children(engine_dir, device, workers) and workers > 1:
        # a share failed (say, several processes did not fit on the GPU at once): one process
        # does all of it, compiling only what is still missing
        if not _warm_in_children(engine_dir, device, 1):
            raise EngineError("the build's kernel warm-up failed (see the warning above)")
    gc.collect()
    torch.cuda.empty_cache()


def warm_workers(weight_bytes: int = 0, free_gpu_bytes: int | None = None) -> int:
    """Processes a build compiles its kernels in: half the cores (compiling is CPU-bound), at
    most 8, and no more than fit on the GPU at once, each holding the weights (an 8B model's 16
    GB eight times over does not fit even an H200)."""
    by_cpu = max(1, min(8, (os.cpu_count() or 1) // 2))
    if free_gpu_bytes is None:
        return by_cpu
    return max(1, min(by_cpu, free_gpu_bytes // (weight_bytes + _WARM_PROCESS_OVERHEAD)))


def _warm_in_children(engine_dir: Path, device: torch.device, parts: int) -> bool:
    """Run the warm-up's ``parts`` shares in as many fresh processes at once; True when every
    one of them succeeded. None is left running, whatever happens here."""
    cmd = [sys.executable, "-m", "compiled_llm.serve.kernel_warmup", str(engine_dir), str(device), str(parts)]
    deadline = time.monotonic() + _CHILD_TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix="cllm-warm-") as logs:
        procs = []
        try:
            for part in range(parts):
                # stderr to a file: a full pipe would stall a child until it is read
                with open(Path(logs) / f"{part}.err", "w") as err:
                    procs.append(subprocess.Popen([*cmd, str(part)], stdout=subprocess.DEVNULL, stderr=err))
            ok = True
            for part, proc in enumerate(procs):
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                if proc.returncode != 0:
                    ok = False
                    last = (Path(logs) / f"{part}.err").read_text(errors="replace").strip().splitlines()[-1:]
                    log.warning("kernel warm-up process %d of %d failed (%s)",
                                part, parts, last[0] if last else f"exit status {proc.returncode}")
            return ok
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


# ---------------------------------------------------------------------------------------------
# One share, in a process of its own
# ---------------------------------------------------------------------------------------------


def warm(engine_dir: Path, device: torch.device, part: int = 0, parts: int = 1) -> None:
    """Share ``part`` of ``parts`` of the warm-up (all of it by default), in this process: the
    engine loaded as ``LLM`` loads it, its steps run on the engine itself."""
    config = EngineConfig() if parts == 1 else EngineConfig(num_blocks=SHARE_KV_BLOCKS)
    engine = LLMEngine(load_model(str(engine_dir), device=device), config)
    try:
        # the two extra jobs go to different processes (the last and the one before), so none of
        # them waits on both
        if parts > 1 and part == max(parts - 2, 0):
            engine.profile_largest_step()  # what the KV sizing of a real load runs
        engine.capture_cuda_graphs(part, parts)  # graph buckets, on inputs that write nowhere
        if part == parts - 1:
            # Real steps on top: Triton specialises integer arguments equal to 1 or divisible by
            # 16 (sequence counts, lengths), which the idle capture inputs do not cover. One and
            # three sequences, lengths that cross a multiple of 16, greedy and sampled.
            for temperature in (0.0, 0.7):
                params = SamplingParams(max_tokens=4, temperature=temperature, ignore_eos=True)
                for lengths in ([14], [5, 37, 16]):
                    for n in lengths:  # queued together: they run as one batch, as LLM.generate's
                        engine.add_request({"prompt_token_ids": [1 + (i % 7) for i in range(n)]}, params)
                    while engine.has_unfinished_requests():
                        engine.step()
            warm_token_bitmask(engine.model.config.vocab_size, engine.model.dtype, device)
        torch.cuda.synchronize(device)
    finally:
        engine.shutdown()


def warm_token_bitmask(vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """Launch the sampler's grammar bitmask (``cllm::apply_token_bitmask``), which only
    structured-output requests run, on logits of the model's dtype and on float32 ones (what
    penalties leave): its kernel is specialised on the dtype alone, not on the batch size or the
    widths (triton_bitmask), so these launches compile all that serving will run."""
    for logits_dtype in dict.fromkeys((dtype, torch.float32)):
        logits = torch.zeros(1, vocab_size, dtype=logits_dtype, device=device)
        bitmask = torch.full((1, cdiv(vocab_size, 32)), -1, dtype=torch.int32, device=device)
        registry.kernel_for("apply_token_bitmask", device.type, logits_dtype)(logits, bitmask)


def main(argv: list[str]) -> int:
    engine_dir, device, parts, part = Path(argv[0]), torch.device(argv[1]), int(argv[2]), int(argv[3])
    with triton_cache_at(engine_dir / KERNELS_DIR):
        warm(engine_dir, device, part, parts)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
