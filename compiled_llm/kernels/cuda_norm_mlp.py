"""CUDA C++ provider of the fused norm + MLP ops (csrc/norm_mlp.cu), built just in time.

The extension is built by cuda_build (once per machine, cached). When it cannot be built,
``extension()`` returns None, with the reason in ``build_error()``, and the provider functions
below run the Triton kernels instead (the build records that through ``cuda_extension_ok()``).

Shape policy: the CUDA kernels are decode GEMVs for T <= 8 rows of bf16/fp16 with H and I
multiples of 8 (16-byte vector loads); other shapes take matmul-based math inside the provider
(CUDA norm kernel + cuBLAS + torch activation), never an error.

The GLU MLP takes both of the op's activations, SwiGLU and GeGLU (``activation``), in the same
kernels (a template parameter of the gate/up kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiled_llm.graph.fused_ops import glu_activation_ref
from compiled_llm.graph.ops import layer_norm_ref, rms_norm_ref
from compiled_llm.kernels import triton_norm_mlp
from compiled_llm.kernels.cuda_build import CudaSource, toolchain_available

SOURCE = CudaSource(
    name="cuda_norm_mlp",
    file="norm_mlp.cu",
    declarations="""
#include <torch/extension.h>
#include <optional>
torch::Tensor cllm_norm(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> b, double eps);
torch::Tensor cllm_gate_up_act(torch::Tensor n, torch::Tensor w1, std::optional<torch::Tensor> b1, bool glu,
                               bool gate_gelu);
torch::Tensor cllm_down_proj(torch::Tensor act, torch::Tensor w2, std::optional<torch::Tensor> b2);
int cllm_max_rows();
""",
    functions=("cllm_norm", "cllm_gate_up_act", "cllm_down_proj", "cllm_max_rows"),
)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


extension, build_error, cuda_extension_ok = SOURCE.extension, SOURCE.build_error, SOURCE.cuda_extension_ok


def supports(device_type: str, dtype: torch.dtype) -> bool:
    """Provider probe, kept cheap (no compile): the build compiles only when it picks "cuda"."""
    return device_type == "cuda" and dtype in SUPPORTED_DTYPES and toolchain_available()


def _aligned(*tensors) -> bool:
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)


def _gemv_ok(ext, x2, H: int, inter: int, tensors) -> bool:
    return (
        x2.is_cuda and x2.dtype in SUPPORTED_DTYPES and all(t.dtype == x2.dtype for t in tensors)
        and x2.shape[0] <= ext.cllm_max_rows() and H % 8 == 0 and inter % 8 == 0 and _aligned(x2, *tensors)
    )


def fused_rms_norm_glu_mlp(x, norm_weight, eps: float, gate_up_weight, down_weight, activation: str = "silu"):
    """The op without its residual (providers._residual_after adds it); ``activation`` "silu"
    (SwiGLU) or "gelu_tanh" (GeGLU)."""
    gelu_gate = triton_norm_mlp.gate_gelu(activation)  # an unknown name fails on every path
    ext = extension()
    if ext is None:
        return triton_norm_mlp.fused_rms_norm_glu_mlp(x, norm_weight, eps, gate_up_weight, down_weight,
                                                      activation=activation)
    x2 = x.reshape(-1, x.shape[-1])
    H, inter = x2.shape[1], down_weight.shape[1]
    out_shape = (*x.shape[:-1], down_weight.shape[0])
    if x2.shape[0] == 0:
        return x.new_empty(out_shape)
    if _gemv_ok(ext, x2, H, inter, (norm_weight, gate_up_weight, down_weight)):
        n = ext.cllm_norm(x2, norm_weight, None, eps)
        out = ext.cllm_down_proj(ext.cllm_gate_up_act(n, gate_up_weight, None, True, gelu_gate), down_weight, None)
    else:  # many rows (or odd shapes): cuBLAS matmuls around the norm
        n = _norm(ext, x2, norm_weight, None, eps)
        gate, up = F.linear(n, gate_up_weight).chunk(2, dim=-1)
        out = F.linear(glu_activation_ref(gate, activation) * up, down_weight)
    return out.view(out_shape)


def fused_layer_norm_gelu_mlp(x, norm_weight, norm_bias, eps: float, fc_weight, fc_bias, proj_weight, proj_bias):
    ext = extension()
    if ext is None:
        return triton_norm_mlp.fused_layer_norm_gelu_mlp(
            x, norm_weight, norm_bias, eps, fc_weight, fc_bias, proj_weight, proj_bias
        )
    x2 = x.reshape(-1, x.shape[-1])
    H, inter = x2.shape[1], proj_weight.shape[1]
    out_shape = (*x.shape[:-1], proj_weight.shape[0])
    if x2.shape[0] == 0:
        return x.new_empty(out_shape)
    if _gemv_ok(ext, x2, H, inter, (norm_weight, norm_bias, fc_weight, fc_bias, proj_weight, proj_bias)):
        n = ext.cllm_norm(x2, norm_weight, norm_bias, eps)
        out = ext.cllm_down_proj(ext.cllm_gate_up_act(n, fc_weight, fc_bias, False, False), proj_weight, proj_bias)
    else:
        n = _norm(ext, x2, norm_weight, norm_bias, eps)
        out = F.linear(F.gelu(F.linear(n, fc_weight, fc_bias), approximate="tanh"), proj_weight, proj_bias)
    return out.view(out_shape)


def _norm(ext, x2, weight, bias, eps):
    """The CUDA norm kernel where its contract holds, else the torch reference."""
    tensors = (weight,) if bias is None else (weight, bias)
    if x2.is_cuda and x2.dtype in SUPPORTED_DTYPES and x2.shape[1] % 8 == 0 and _aligned(x2, *tensors) \
            and all(t.dtype == x2.dtype for t in tensors):
        return ext.cllm_norm(x2, weight, bias, eps)
    return rms_norm_ref(x2, weight, eps) if bias is None else layer_norm_ref(x2, weight, bias, eps)
