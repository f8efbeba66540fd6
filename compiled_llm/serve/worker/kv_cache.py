"""Sizing and allocating the paged KV cache.

On a GPU the cache takes what is left of ``gpu_memory_utilization`` x total memory after the
weights, a warm-up at the largest step the engine will run (its activation peak), and memory
other processes hold. On a CPU the size is given (number of blocks or GiB).
"""

from __future__ import annotations

from typing import Callable

import torch

from compiled_llm.model.config import ModelConfig
from compiled_llm.errors import CompiledLLMError
from compiled_llm.model.spec import kv_cache_shape

DEFAULT_CPU_KV_GIB = 0.5


def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype, kv_layers: int | None = None) -> int:
    """Bytes of one block across the layers a cache holds (``kv_layers``, a pipeline stage's;
    None: all of them), keys and values."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    layers = config.num_layers if kv_layers is None else kv_layers
    return 2 * layers * block_size * config.num_kv_heads * config.head_dim * itemsize


def cpu_num_blocks(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    kv_cache_gib: float | None,
    max_useful_blocks: int,
    kv_layers: int | None = None,
) -> int:
    gib = DEFAULT_CPU_KV_GIB if kv_cache_gib is None else kv_cache_gib
    n = int(gib * 2**30 // block_bytes(config, block_size, dtype, kv_layers))
    return max(1, min(n, max_useful_blocks))


def gpu_num_blocks(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    gpu_memory_utilization: float,
    profile_step: Callable[[], None],
    kv_layers: int | None = None,
    reserved: Callable[[], int] | None = None,
) -> tuple[int, dict]:
    """Blocks that fit in the GPU budget, measured by running ``profile_step`` (the largest
    step: max tokens prefill + sampling of max_num_seqs rows) with the weights loaded, less
    ``reserved()`` bytes: buffers the engine makes after the cache and holds from then on (a
    pipelined engine's decode lanes), asked after ``profile_step``, which tells their shapes."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise CompiledLLMError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    # memory held outside this process's torch allocator: CUDA context, other processes
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    held_back = reserved() if reserved is not None else 0
    budget = total * gpu_memory_utilization - non_torch - peak - held_back
    n = int(budget // block_bytes(config, block_size, dtype, kv_layers))
    info = {
        "total_gib": total / 2**30,
        "peak_gib": peak / 2**30,
        "non_torch_gib": non_torch / 2**30,
        "reserved_gib": held_back / 2**30,
        "kv_gib": max(n, 0) * block_bytes(config, block_size, dtype, kv_layers) / 2**30,
    }
    if n < 1:
        held = f", after {held_back / 2**30:.2f} GiB held for decode buffers" if held_back else ""
        raise CompiledLLMError(
            f"no GPU memory left for the KV cache (budget {budget / 2**30:.2f} GiB at "
            f"gpu_memory_utilization={gpu_memory_utilization}{held}); raise it or lower max_num_batched_tokens"
        )
    return n, info


def allocate(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device,
             layers: int | None = None) -> torch.Tensor:
    """The cache of ``layers`` layers (a pipeline stage's; None: all of the model's)."""
    shape = kv_cache_shape(config, num_blocks, block_size)
    if layers is not None:
        shape = (layers, *shape[1:])
    # zeros, not empty: padded decode rows may read a block before anything was written there
    return torch.zeros(shape, dtype=dtype, device=device)
