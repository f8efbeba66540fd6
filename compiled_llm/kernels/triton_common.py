"""Small helpers shared by the Triton kernel families."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """tl.dot with exact fp32 products for fp32 inputs (the default would round them to TF32,
    which breaks fp32 parity tests); bf16/fp16 inputs use tensor cores either way."""
    if IEEE:
        r = tl.dot(a, b, input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def is_fp32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32


def row_warps(block: int, cap: int = 16) -> int:
    """Warps for a one-program-per-row kernel of ``block`` elements: ~8 elements a thread."""
    return max(1, min(cap, next_pow2(block) // 256))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a fixed stand-in on CPU, where only the Triton
    interpreter runs). A device constant, so grids that use it stay shape-determined."""
    if device.type != "cuda":
        return 8
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
