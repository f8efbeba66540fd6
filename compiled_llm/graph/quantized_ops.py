"""Weight-only quantized variants of the fused linear ops (``cllm::<op>_wq``), which the build's
``quantize_weights`` pass swaps in, and the quantization schemes they read.

Each weight ``W [N, K]`` of the unquantized op becomes three arguments: ``W_qweight``,
``W_scale`` and ``W_zero``. The dtype of ``qweight`` says the scheme:

- int8 (``qweight`` int8 ``[N, K]``): symmetric, one fp32 scale per output channel, no zero
  point (``zero`` is None): ``W = q * scale[n]``. A kernel can multiply the scale into its
  accumulator once per output, after the K loop.
- int4 (``qweight`` uint8 ``[N, K / 2]``, two values per byte, the even k in the low nibble):
  asymmetric, groups of ``G`` consecutive k (128, or the largest power of two dividing K if K
  demands a smaller one), fp32 scale and zero point per (n, group): ``W = (q - zero) * scale``,
  the 16 codes spanning exactly the group's [min, max]. The zero point is an fp32 offset in code
  units, neither rounded nor clamped to a code, so a group all of one sign (or constant) keeps
  its whole range. Asymmetric because random and trained weights alike are rarely centred on
  zero within a group of 128; it costs one fp32 per group more than symmetric.

Every op's reference dequantizes its weights to the activations' dtype and runs the unquantized
op's reference, so a quantized engine computes exactly what the unquantized one would with the
dequantized weights: the kernels are tested against that, apart from quantization error.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from compiled_llm.graph.fused_ops import (
    fused_layer_norm_gelu_mlp_ref, fused_linear_residual_ref, fused_qkv_rope_ref, fused_rms_norm_glu_mlp_ref,
)
from compiled_llm.graph.ops import cllm_op

SCHEMES = ("int8", "int4")
INT4_GROUP_SIZE = 128


# ---------------------------------------------------------------------------------------------
# Quantizing and dequantizing one weight
# ---------------------------------------------------------------------------------------------


def int4_group_size(k: int) -> int:
    """Groups of INT4_GROUP_SIZE along K, or the largest power of two (>= 2) that divides K."""
    g = INT4_GROUP_SIZE
    while g > 2 and k % g:
        g //= 2
    if k % g:
        raise ValueError(f"int4 needs an even K, got {k}")
    return g


def quantize(weight: Tensor, scheme: str) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """(qweight, scale, zero) of a [N, K] weight (module docstring); computed in fp32."""
    w = weight.detach().to(torch.float32)
    if scheme == "int8":
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return q, scale, None
    if scheme == "int4":
        n, k = w.shape
        g = int4_group_size(k)
        groups = w.reshape(n, k // g, g)
        lo, hi = groups.amin(dim=2), groups.amax(dim=2)
        scale = ((hi - lo) / 15.0).clamp_min(1e-12)
        zero = -lo / scale
        q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k)
        return q[:, 0::2] | (q[:, 1::2] << 4), scale, zero
    raise ValueError(f"unknown quantization scheme {scheme!r}; the schemes are: {', '.join(SCHEMES)}")


def dequantize(qweight: Tensor, scale: Tensor, zero: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """The [N, K] weight ``quantize`` encoded, in ``dtype``."""
    if qweight.dtype == torch.int8:
        return (qweight.to(torch.float32) * scale[:, None]).to(dtype)
    n = qweight.shape[0]
    q = torch.stack([qweight & 0xF, qweight >> 4], dim=-1).reshape(n, -1).to(torch.float32)
    groups = scale.shape[1]
    q = q.reshape(n, groups, -1)
    return ((q - zero[..., None]) * scale[..., None]).reshape(n, -1).to(dtype)


# ---------------------------------------------------------------------------------------------
# The quantized ops' references
# ---------------------------------------------------------------------------------------------


def linear_wq_ref(x: Tensor, qweight: Tensor, scale: Tensor, zero: Optional[Tensor],
                  bias: Optional[Tensor] = None) -> Tensor:
    return F.linear(x, dequantize(qweight, scale, zero, x.dtype), bias)


def fused_linear_residual_wq_ref(x: Tensor, qweight: Tensor, scale: Tensor, zero: Optional[Tensor],
                                 bias: Optional[Tensor], residual: Tensor) -> Tensor:
    return fused_linear_residual_ref(x, dequantize(qweight, scale, zero, x.dtype), bias, residual)


def fused_rms_norm_glu_mlp_wq_ref(
    x: Tensor,
    norm_weight: Tensor,
    eps: float,
    gate_up_qweight: Tensor,
    gate_up_scale: Tensor,
    gate_up_zero: Optional[Tensor],
    down_qweight: Tensor,
    down_scale: Tensor,
    down_zero: Optional[Tensor],
    residual: Optional[Tensor] = None,
    activation: str = "silu",
) -> Tensor:
    return fused_rms_norm_glu_mlp_ref(
        x, norm_weight, eps, dequantize(gate_up_qweight, gate_up_scale, gate_up_zero, x.dtype),
        dequantize(down_qweight, down_scale, down_zero, x.dtype), residual, activation,
    )


def fused_layer_norm_gelu_mlp_wq_ref(
    x: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    eps: float,
    fc_qweight: Tensor,
    fc_scale: Tensor,
    fc_zero: Optional[Tensor],
    fc_bias: Tensor,
    proj_qweight: Tensor,
    proj_scale: Tensor,
    proj_zero: Optional[Tensor],
    proj_bias: Tensor,
    residual: Optional[Tensor] = None,
) -> Tensor:
    return fused_layer_norm_gelu_mlp_ref(
        x, norm_weight, norm_bias, eps, dequantize(fc_qweight, fc_scale, fc_zero, x.dtype), fc_bias,
        dequantize(proj_qweight, proj_scale, proj_zero, x.dtype), proj_bias, residual,
    )


def fused_qkv_rope_wq_ref(
    x: Tensor,
    qkv_qweight: Tensor,
    qkv_scale: Tensor,
    qkv_zero: Optional[Tensor],
    qkv_bias: Optional[Tensor],
    q_norm_weight: Optional[Tensor],
    k_norm_weight: Optional[Tensor],
    positions: Tensor,
    cos_sin: Optional[Tensor],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    norm_weight: Optional[Tensor] = None,
    norm_eps: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    return fused_qkv_rope_ref(
        x, dequantize(qkv_qweight, qkv_scale, qkv_zero, x.dtype), qkv_bias, q_norm_weight, k_norm_weight,
        positions, cos_sin, num_heads, num_kv_heads, head_dim, eps, norm_weight, norm_eps,
    )


linear_wq = cllm_op("linear_wq", linear_wq_ref)
fused_linear_residual_wq = cllm_op("fused_linear_residual_wq", fused_linear_residual_wq_ref)
fused_rms_norm_glu_mlp_wq = cllm_op("fused_rms_norm_glu_mlp_wq", fused_rms_norm_glu_mlp_wq_ref)
fused_layer_norm_gelu_mlp_wq = cllm_op("fused_layer_norm_gelu_mlp_wq", fused_layer_norm_gelu_mlp_wq_ref)
fused_qkv_rope_wq = cllm_op("fused_qkv_rope_wq", fused_qkv_rope_wq_ref)
