"""Small helpers shared by the Triton kernel families."""

from __future__ import annotations

import functools
import os

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


@triton.jit
def store_linear_output(y, offs_t, offs_n, mask_t, mask_n, b_ptr, r_ptr, out_ptr, stride_r, stride_o,
                        HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Store a linear's fp32 sums ``y`` [rows, N] (rows ``offs_t``, columns ``offs_n``) with the
    unfused graph's roundings: + bias, rounded to out's dtype (what F.linear returns), then
    + residual in fp32, rounded again (what aten.add returns)."""
    dtype = out_ptr.dtype.element_ty
    mask = mask_t[:, None] & mask_n[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + offs_t.to(tl.int64)[:, None] * stride_r + offs_n[None, :], mask=mask, other=0.0)
        y = y.to(dtype).to(tl.float32) + r.to(tl.float32)
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * stride_o + offs_n[None, :], y.to(dtype), mask=mask)


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


# ---------------------------------------------------------------------------------------------
# programmatic dependent launch (Hopper+): a decode kernel is launched while its predecessor
# still runs, streams the weights it does not need the predecessor for, and waits (griddepcontrol
# .wait) only before it reads activations or writes anything. Within a decode CUDA graph that
# hides most of each kernel boundary's launch gap and ramp-up.
# ---------------------------------------------------------------------------------------------

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_GDC = True
except ImportError:  # a Triton without grid dependency control
    _HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


PDL_ENABLED = os.environ.get("CLLM_PDL", "1") != "0"  # process-wide switch (A/B measurements)


@triton.jit
def pdl_open(PDL: tl.constexpr):
    """Let the next kernel in the stream launch now (it waits on its own before reading our
    output). Safe first thing in a kernel: it only schedules, it orders nothing."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has finished and its writes are visible.
    Every read of a predecessor's output and every store must come after this."""
    if PDL:
        gdc_wait()


def use_pdl(t: torch.Tensor) -> bool:
    """Launch with programmatic dependent launch: a Hopper-or-newer GPU running compiled Triton
    (not the interpreter) with grid dependency control, unless CLLM_PDL=0."""
    if not (PDL_ENABLED and _HAS_GDC and t.is_cuda) or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device()) >= (9, 0)


def pdl_launch(on: bool) -> dict:
    """Launch keyword for a kernel launched with PDL (nothing otherwise)."""
    return {"launch_pdl": True} if on else {}


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)
