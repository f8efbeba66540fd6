"""CUDA C++ provider of the weight-only int4 ops at decode sizes: a tensor-core GEMV
(csrc/gemv_int4.cu: why tensor cores at batch 1, and its rounding).

It takes the calls the Triton INT4 forms are slowest at: bf16 x of up to 8 rows (``takes``) and
int4 weights in groups of 128. Three ops:

- ``linear_wq`` (the lm_head) and ``fused_linear_residual_wq`` (o, down): one launch;
- ``fused_rms_norm_glu_mlp_wq``: two launches, RMSNorm + gate/up + silu * up (x normalised while
  the block stages it; gate and up rows of one output column in the same block), then down with
  the residual.

Every other call (int8, fp16/fp32 x, more rows, other group sizes) and every call on a machine
where the extension cannot be built (no nvcc: cuda_build) runs the Triton provider's function,
so the provider is never worse than Triton's. q/k/v (with RoPE) stays with Triton.
"""

from __future__ import annotations

import functools

import torch

from compiled_llm.kernels import triton_gemv, triton_norm_mlp
from compiled_llm.kernels.cuda_build import CudaSource, toolchain_available

SOURCE = CudaSource(
    name="cuda_gemv_int4",
    file="gemv_int4.cu",
    declarations="""
#include <torch/extension.h>
#include <optional>
torch::Tensor cllm_gemv_int4(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale, torch::Tensor zero,
                             std::optional<torch::Tensor> bias, std::optional<torch::Tensor> residual,
                             std::optional<torch::Tensor> norm_weight, double eps, bool glu, int64_t nt,
                             int64_t warps);
""",
    functions=("cllm_gemv_int4",),
)
GROUP = 128
MAX_ROWS = 8  # the mma's n (csrc/gemv_int4.cu kMaxTokens)


extension, build_error, cuda_extension_ok = SOURCE.extension, SOURCE.build_error, SOURCE.cuda_extension_ok


def supports(device_type: str, dtype: torch.dtype) -> bool:
    """Provider probe, kept cheap (no compile). Calls it does not take run Triton, so it claims
    what the Triton provider does where it can build."""
    return device_type == "cuda" and dtype in (torch.float32, torch.bfloat16, torch.float16) and toolchain_available()


def _aligned(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % 16 == 0


@functools.lru_cache(maxsize=None)
def _shared_memory_limit(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def shared_memory_bytes(T: int, K: int, rows: int, glu: bool) -> int:
    """What a block stages (csrc/gemv_int4.cu): x pair-ordered, its group sums, the warps'
    partial sums and the norm's sums of squares."""
    nt, warps = launch_shape(rows, K, glu)
    tiles = 2 * nt if glu else nt
    return T * K * 2 + T * (K // GROUP) * 4 + warps * 16 * tiles * T * 4 + MAX_ROWS * 4


def takes(x2: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero, *others, glu: bool = False) -> bool:
    """Whether the CUDA kernel takes a call: bf16 rows of x (at most MAX_ROWS), an int4 weight in
    groups of GROUP, everything contiguous and 16-byte aligned, x small enough to stage in a
    block's shared memory, on a GPU the extension built for."""
    if zero is None or not x2.is_cuda or x2.dtype != torch.bfloat16 or x2.dim() != 2:
        return False
    T, K = x2.shape
    return (
        0 < T <= MAX_ROWS and K % GROUP == 0 and qweight.dtype == torch.uint8 and qweight.shape[-1] * 2 == K
        and scale.shape[-1] == K // GROUP and scale.dtype == zero.dtype == torch.float32
        and all(_aligned(t) for t in (x2, qweight, scale, zero, *others) if t is not None)
        and shared_memory_bytes(T, K, qweight.shape[0], glu) <= _shared_memory_limit(x2.device.index or 0)
        and extension() is not None
    )


def launch_shape(rows: int, K: int, glu: bool) -> tuple[int, int]:
    """(NT, warps): a block owns 16 * NT output columns and its warps split the K groups. Measured on
    an H200 (benchmarks/NOTES.md): tall matrices (the lm_head) want few warps, each with 8 groups or
    more; the rest want 8 warps, and two tiles a block once there are columns enough to fill the GPU."""
    if glu:
        return 1, (4 if rows >= 16384 else 8)
    if rows >= 65536:
        return 1, (2 if K // GROUP <= 16 else 4)
    if rows >= 16384:
        return 2, 4
    return (2 if rows >= 4096 else 1), 8


def gemv_int4(x2, qweight, scale, zero, bias=None, residual2=None, norm_weight=None, eps: float = 0.0,
              glu: bool = False) -> torch.Tensor:
    """[T, N] bf16 (module docstring): x2 [T, K]; GLU: qweight holds 2N rows (gate, then up)."""
    nt, warps = launch_shape(qweight.shape[0], x2.shape[1], glu)
    return extension().cllm_gemv_int4(x2, qweight, scale, zero, bias, residual2, norm_weight, eps, glu, nt, warps)


def linear_wq(x, qweight, scale, zero, bias=None):
    x2 = x.reshape(-1, x.shape[-1])
    if takes(x2, qweight, scale, zero, bias):
        return gemv_int4(x2, qweight, scale, zero, bias).view(*x.shape[:-1], qweight.shape[0])
    return triton_gemv.linear_wq(x, qweight, scale, zero, bias)


def linear_residual_wq(x, qweight, scale, zero, bias, residual):
    x2, N = x.reshape(-1, x.shape[-1]), qweight.shape[0]
    r2 = residual.reshape(-1, N)
    if takes(x2, qweight, scale, zero, bias, r2) and r2.shape[0] == x2.shape[0] and r2.dtype == x2.dtype:
        return gemv_int4(x2, qweight, scale, zero, bias, r2).view(*x.shape[:-1], N)
    return triton_gemv.linear_residual_wq(x, qweight, scale, zero, bias, residual)


def fused_rms_norm_glu_mlp_wq(x, norm_weight, eps: float, gate_up_qweight, gate_up_scale, gate_up_zero,
                              down_qweight, down_scale, down_zero, residual=None):
    x2, N = x.reshape(-1, x.shape[-1]), down_qweight.shape[0]
    r2 = residual.reshape(-1, N) if residual is not None else None
    if (takes(x2, gate_up_qweight, gate_up_scale, gate_up_zero, norm_weight, r2, glu=True)
            and norm_weight.dtype == x2.dtype and (r2 is None or r2.dtype == x2.dtype)):
        act = gemv_int4(x2, gate_up_qweight, gate_up_scale, gate_up_zero, norm_weight=norm_weight, eps=eps, glu=True)
        if takes(act, down_qweight, down_scale, down_zero):
            out = gemv_int4(act, down_qweight, down_scale, down_zero, residual2=r2)
        else:
            out = triton_gemv.gemv(act, down_qweight, None, r2, config="norm_mlp_down", scale=down_scale,
                                   zero=down_zero)
        return out.view(*x.shape[:-1], N)
    return triton_norm_mlp.fused_rms_norm_glu_mlp_wq(x, norm_weight, eps, gate_up_qweight, gate_up_scale,
                                                     gate_up_zero, down_qweight, down_scale, down_zero, residual)

