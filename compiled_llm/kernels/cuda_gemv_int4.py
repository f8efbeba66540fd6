"""CUDA C++ provider of the weight-only int4 ops at decode sizes: a tensor-core GEMV
(csrc/gemv_int4.cu: why tensor cores at batch 1, and its rounding).

It takes the calls the Triton INT4 forms are slowest at: bf16 x of up to 8 rows (``takes``) and
int4 weights in groups of 128. Four ops:

- ``linear_wq`` (the lm_head) and ``fused_linear_residual_wq`` (o, down): one launch;
- ``fused_rms_norm_glu_mlp_wq``: two launches, RMSNorm + gate/up + silu * up (x normalised while
  the block stages it; gate and up rows of one output column in the same block), then down with
  the residual. SwiGLU only: the kernel's GLU epilogue is silu, so a GeGLU call (Gemma's
  ``activation="gelu_tanh"``) runs Triton's INT4 form;
- ``fused_qkv_rope_wq`` without per-head q/k norm: one launch, RMSNorm + q/k/v + bias + RoPE (the
  two rows RoPE rotates together in the same block), each head written to q, k or v.

Every other call (int8, fp16/fp32 x, more rows, other group sizes, Qwen3's q/k norm) and every
call on a machine where the extension cannot be built (no nvcc: cuda_build) runs the Triton
provider's function, so the provider is never worse than Triton's.
"""

from __future__ import annotations

import functools

import torch

from compiled_llm.kernels import triton_common, triton_gemv, triton_norm_mlp, triton_qkv_rope
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
                             int64_t warps, bool pdl);
std::vector<torch::Tensor> cllm_qkv_int4(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale,
                                         torch::Tensor zero, std::optional<torch::Tensor> bias,
                                         std::optional<torch::Tensor> norm_weight, double norm_eps,
                                         torch::Tensor positions, std::optional<torch::Tensor> cos_sin,
                                         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t nt,
                                         int64_t warps, bool pdl);
""",
    functions=("cllm_gemv_int4", "cllm_qkv_int4"),
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


def shared_memory_bytes(T: int, K: int, rows: int, mode: str = "plain") -> int:
    """What a block stages (csrc/gemv_int4.cu): x pair-ordered, its group sums, the warps'
    partial sums, the norm's sums of squares per group and its 1 / rms per token."""
    nt, warps = launch_shape(rows, K, mode)
    tiles = nt if mode == "plain" else 2 * nt
    return T * K * 2 + T * (K // GROUP) * 8 + warps * 16 * tiles * T * 4 + MAX_ROWS * 4


def takes(x2: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero, *others, mode: str = "plain") -> bool:
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
        and shared_memory_bytes(T, K, qweight.shape[0], mode) <= _shared_memory_limit(x2.device.index or 0)
        and extension() is not None
    )


def launch_shape(rows: int, K: int, mode: str = "plain") -> tuple[int, int]:
    """(NT, warps) for a mode of csrc/gemv_int4.cu ("plain", "glu" or "qkv"): a block owns 16 * NT output columns and its warps split the K groups. Measured on
    an H200 (benchmarks/NOTES.md): tall matrices (the lm_head) want few warps, each with 8 groups or
    more; the rest want 8 warps, and two tiles a block once there are columns enough to fill the GPU.
    GLU and QKV blocks already hold two tiles, a row's and its pair's."""
    if mode == "qkv":
        return 1, 8
    if mode == "glu":
        return 1, (4 if rows >= 16384 else 8)
    if rows >= 65536:
        return 1, (2 if K // GROUP <= 16 else 4)
    if rows >= 16384:
        return 2, 4
    return (2 if rows >= 4096 else 1), 8


def gemv_int4(x2, qweight, scale, zero, bias=None, residual2=None, norm_weight=None, eps: float = 0.0,
              glu: bool = False) -> torch.Tensor:
    """[T, N] bf16 (module docstring): x2 [T, K]; GLU: qweight holds 2N rows (gate, then up)."""
    nt, warps = launch_shape(qweight.shape[0], x2.shape[1], "glu" if glu else "plain")
    return extension().cllm_gemv_int4(x2, qweight, scale, zero, bias, residual2, norm_weight, eps, glu, nt, warps,
                                      triton_common.PDL_ENABLED)


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
                              down_qweight, down_scale, down_zero, residual=None, activation: str = "silu"):
    x2, N = x.reshape(-1, x.shape[-1]), down_qweight.shape[0]
    r2 = residual.reshape(-1, N) if residual is not None else None
    # the kernel's GLU epilogue is silu's: GeGLU runs Triton's INT4 form
    if (activation == "silu" and takes(x2, gate_up_qweight, gate_up_scale, gate_up_zero, norm_weight, r2,
                                       mode="glu")
            and norm_weight.dtype == x2.dtype and (r2 is None or r2.dtype == x2.dtype)):
        act = gemv_int4(x2, gate_up_qweight, gate_up_scale, gate_up_zero, norm_weight=norm_weight, eps=eps, glu=True)
        if takes(act, down_qweight, down_scale, down_zero):
            out = gemv_int4(act, down_qweight, down_scale, down_zero, residual2=r2)
        else:
            out = triton_gemv.gemv(act, down_qweight, None, r2, config="norm_mlp_down", scale=down_scale,
                                   zero=down_zero)
        return out.view(*x.shape[:-1], N)
    return triton_norm_mlp.fused_rms_norm_glu_mlp_wq(x, norm_weight, eps, gate_up_qweight, gate_up_scale,
                                                     gate_up_zero, down_qweight, down_scale, down_zero, residual,
                                                     activation)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def takes_qkv(x, qweight, scale, zero, bias, q_norm_weight, positions, cos_sin, head_dim: int, norm_weight) -> bool:
    """The QKV form's contract on top of ``takes``: no per-head q/k norm, head halves of whole
    16-row tiles, int64 positions of x's rows, an fp32 cos/sin table with a row per position, and
    blocks (32 rows each) for at least half the GPU's SMs. With fewer (Qwen2.5-0.5B: 36) Triton's
    q/k/v kernel, which splits heads over more programs, measured faster in the engine; Llama-3.2-1B
    (96) and Llama-3.1-8B (192) measured faster here (benchmarks/NOTES.md)."""
    return (
        q_norm_weight is None and head_dim % 32 == 0 and x.is_cuda
        and qweight.shape[0] // 32 >= _sm_count(x.device.index or 0) // 2 and positions.dtype == torch.int64
        and positions.shape == (x.shape[0],) and positions.is_contiguous()
        and (norm_weight is None or norm_weight.dtype == x.dtype)
        and (cos_sin is None or (cos_sin.dtype == torch.float32 and cos_sin.shape[-1] == head_dim))
        and takes(x, qweight, scale, zero, bias, norm_weight, cos_sin, mode="qkv")
    )


def qkv_int4(x, qweight, scale, zero, bias, norm_weight, norm_eps: float, positions, cos_sin, num_heads: int,
             num_kv_heads: int, head_dim: int):
    """(q, k, v) of the QKV form (module docstring), for a call ``takes_qkv`` accepts (or any call
    meeting the kernel's contract, whatever its size)."""
    nt, warps = launch_shape(qweight.shape[0], x.shape[1], "qkv")
    q, k, v = extension().cllm_qkv_int4(x, qweight, scale, zero, bias, norm_weight, norm_eps, positions, cos_sin,
                                        num_heads, num_kv_heads, head_dim, nt, warps, triton_common.PDL_ENABLED)
    return q, k, v


def fused_qkv_rope_wq(x, qkv_qweight, qkv_scale, qkv_zero, qkv_bias, q_norm_weight, k_norm_weight, positions,
                      cos_sin, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                      norm_weight=None, norm_eps: float = 0.0):
    if takes_qkv(x, qkv_qweight, qkv_scale, qkv_zero, qkv_bias, q_norm_weight, positions, cos_sin, head_dim,
                 norm_weight):
        return qkv_int4(x, qkv_qweight, qkv_scale, qkv_zero, qkv_bias, norm_weight, norm_eps, positions, cos_sin,
                        num_heads, num_kv_heads, head_dim)
    return triton_qkv_rope.fused_qkv_rope_wq(x, qkv_qweight, qkv_scale, qkv_zero, qkv_bias, q_norm_weight,
                                             k_norm_weight, positions, cos_sin, num_heads, num_kv_heads, head_dim,
                                             eps, norm_weight, norm_eps)
