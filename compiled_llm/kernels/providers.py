"""Triton and CUDA C++ kernels of the cllm:: ops, registered with the kernel registry.

Each kernel is registered with ``registry.register_kernel``, which makes it the op
``cllm::<op>__<provider>`` with the semantic op's schema and fake (see ``ops.OpDef``), so the
build's select_kernels pass can swap the call target without touching arguments, and exported
programs name it. A kernel takes the op's arguments in the schema's order.

Triton providers: every semantic and fused op, the sampler's ops and the all-reduce; CUDA
devices, fp32/bf16/fp16. CUDA C++ providers compile on first use and run Triton if they cannot
(cuda_build):

- the int4 decode GEMV (cuda_gemv_int4) ranks above Triton for the four weight-only ops it
  serves: it takes the bf16 int4 calls of up to 8 rows and hands every other call to the Triton
  kernels;
- the norm+MLP provider (cuda_norm_mlp) ranks below Triton, so a build gets it only by asking
  (``prefer={op: "cuda"}``).

Shapes a kernel does not handle go to the reference implementation (``handles=``) rather than
failing: the choice of provider is per op and dtype, not per shape.
"""

from __future__ import annotations

import torch

from compiled_llm.graph import fused_ops, ops
from compiled_llm.kernels import (
    cuda_gemv_int4, cuda_norm_mlp, triton_all_reduce, triton_fused_moe, triton_gemm_wq, triton_gemv, triton_norm,
    triton_norm_mlp, triton_bitmask, triton_paged_attention, triton_qkv_rope, triton_sampling,
)
from compiled_llm.kernels.registry import register_kernel

TRITON = "triton"
CUDA = "cuda"
TRITON_PRIORITY = 10
CUDA_PRIORITY = 5
CUDA_INT4_PRIORITY = 20
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_ROW_NORM = 65536  # one program holds the whole row in registers


def triton_supports(device_type: str, dtype: torch.dtype) -> bool:
    """CUDA GPUs Triton generates code for: Volta (7.0) and newer, Ampere (8.0) and newer for bf16
    (tensor-core bf16 dots). Without a visible GPU (a build for a CUDA target on another
    machine) the capability is not checked."""
    if device_type != "cuda" or dtype not in TRITON_DTYPES:
        return False
    if not torch.cuda.is_available():
        return True
    major_minor = torch.cuda.get_device_capability()
    return major_minor >= (8, 0) if dtype == torch.bfloat16 else major_minor >= (7, 0)


# ---------------------------------------------------------------------------------------------
# what the Triton kernels handle (the rest goes to the reference)
# ---------------------------------------------------------------------------------------------


def _row_fits(x) -> bool:
    return x.shape[-1] <= MAX_ROW_NORM


def _row_fits_and_residual_matches(x, residual) -> bool:
    return x.shape[-1] <= MAX_ROW_NORM and residual.shape == x.shape


def _even_head_dim(q) -> bool:
    return q.shape[-1] % 2 == 0


def _qkv_rope_fits(q_norm_weight, k_norm_weight, head_dim) -> bool:
    return triton_qkv_rope.supports_shape(head_dim, q_norm_weight is not None, k_norm_weight is not None)


def _residual_is_output_shaped(x, weight, residual) -> bool:
    """The kernel adds a residual of the output's shape; a broadcasting one goes to the reference."""
    return residual.shape == (*x.shape[:-1], weight.shape[0])


def _quantized(x, qweight, scale, zero) -> bool:
    """Weight-only quantized calls the kernels take: at decode sizes, weights the GEMV streams
    (int8, or int4 in groups it tiles: triton_gemv.streams_quantized); above, weights the
    quantized GEMM takes (triton_gemm_wq.supports). Others run the op's reference (dequantize,
    then cuBLAS)."""
    if triton_gemv.use_gemv(x.numel() // x.shape[-1]):
        return triton_gemv.streams_quantized(qweight, scale, zero)
    return triton_gemm_wq.supports(qweight, scale, zero)


def _quantized_residual(x, qweight, scale, zero, residual) -> bool:
    return _quantized(x, qweight, scale, zero) and residual.shape == (*x.shape[:-1], qweight.shape[0])


def _quantized_mlp(x, gate_up_qweight, gate_up_scale, gate_up_zero, down_qweight, down_scale, down_zero) -> bool:
    return triton_norm_mlp.takes_quantized((gate_up_qweight, down_qweight), (gate_up_scale, down_scale),
                                           (gate_up_zero, down_zero), x.numel() // x.shape[-1])


def _quantized_gelu_mlp(x, fc_qweight, fc_scale, fc_zero, proj_qweight, proj_scale, proj_zero) -> bool:
    return triton_norm_mlp.takes_quantized((fc_qweight, proj_qweight), (fc_scale, proj_scale), (fc_zero, proj_zero),
                                           x.numel() // x.shape[-1])


def _quantized_qkv(x, qkv_qweight, qkv_scale, qkv_zero, q_norm_weight, k_norm_weight, head_dim) -> bool:
    if not _qkv_rope_fits(q_norm_weight, k_norm_weight, head_dim):
        return False
    if triton_qkv_rope.use_decode_form(x.shape[0]):
        return triton_gemv.streams_quantized(qkv_qweight, qkv_scale, qkv_zero)
    return triton_gemm_wq.supports(qkv_qweight, qkv_scale, qkv_zero)


TRITON_KERNELS = {  # op -> (kernel, handles)
    "rms_norm": (triton_norm.rms_norm, _row_fits),
    "layer_norm": (triton_norm.layer_norm, _row_fits),
    "fused_add_rms_norm": (triton_norm.fused_add_rms_norm, _row_fits_and_residual_matches),
    "fused_add_layer_norm": (triton_norm.fused_add_layer_norm, _row_fits_and_residual_matches),
    "fused_rms_norm_residual": (triton_norm.fused_rms_norm_residual, _row_fits_and_residual_matches),
    "rotary_embedding": (triton_qkv_rope.rotary_embedding, _even_head_dim),
    "fused_qkv_rope": (triton_qkv_rope.fused_qkv_rope, _qkv_rope_fits),
    "paged_attention": (triton_paged_attention.paged_attention, None),
    "linear": (triton_gemv.linear, None),
    "fused_linear_residual": (triton_gemv.linear_residual, _residual_is_output_shaped),
    "fused_rms_norm_glu_mlp": (triton_norm_mlp.fused_rms_norm_glu_mlp, None),
    "fused_layer_norm_gelu_mlp": (triton_norm_mlp.fused_layer_norm_gelu_mlp, None),
    # weight-only quantized variants, int8 and int4: the decode forms, the quantized GEMM above
    "linear_wq": (triton_gemv.linear_wq, _quantized),
    "fused_linear_residual_wq": (triton_gemv.linear_residual_wq, _quantized_residual),
    "fused_rms_norm_glu_mlp_wq": (triton_norm_mlp.fused_rms_norm_glu_mlp_wq, _quantized_mlp),
    "fused_layer_norm_gelu_mlp_wq": (triton_norm_mlp.fused_layer_norm_gelu_mlp_wq, _quantized_gelu_mlp),
    "fused_qkv_rope_wq": (triton_qkv_rope.fused_qkv_rope_wq, _quantized_qkv),
    # mixture of experts: routing on the device, the chosen experts' weights streamed (decode) or
    # grouped GEMMs over the pairs sorted by expert (prefill)
    "fused_moe": (triton_fused_moe.fused_moe, None),
    # tensor parallelism: custom push kernel over symmetric memory where the ranks opened it, else NCCL
    "all_reduce": (triton_all_reduce.all_reduce, triton_all_reduce.handles),
}
# the sampler's ops (serve/worker/sampler.py picks them with registry.kernel_for)
SAMPLER_KERNELS = {
    "greedy_sample": (triton_sampling.greedy_argmax, None),
    "temperature_sample": (triton_sampling.gumbel_sample, None),
    "apply_token_bitmask": (triton_bitmask.apply_token_bitmask, None),  # structured output
}


# ---------------------------------------------------------------------------------------------
# CUDA C++ norm + MLP
# ---------------------------------------------------------------------------------------------


def _residual_after(op_name: str, kernel):
    """The CUDA C++ kernels have no residual epilogue: they get the op's arguments but its
    optional ``residual`` (those after it too: the GLU MLP's activation), which is added after
    them, on the rounded output (what the reference computes), still saving the separate graph
    node."""
    n = ops.OPS[op_name].params.index("residual")

    def call(*args):
        return fused_ops.add_residual(kernel(*args[:n], *args[n + 1:]), args[n] if len(args) > n else None)

    call.__name__ = call.__qualname__ = f"{op_name}__{CUDA}"
    return call


CUDA_KERNELS = {
    name: _residual_after(name, getattr(cuda_norm_mlp, name))
    for name in ("fused_rms_norm_glu_mlp", "fused_layer_norm_gelu_mlp")
}


CUDA_INT4_KERNELS = {  # op -> (kernel, handles): what the Triton provider handles, int4 decode in CUDA
    "linear_wq": (cuda_gemv_int4.linear_wq, _quantized),
    "fused_linear_residual_wq": (cuda_gemv_int4.linear_residual_wq, _quantized_residual),
    "fused_rms_norm_glu_mlp_wq": (cuda_gemv_int4.fused_rms_norm_glu_mlp_wq, _quantized_mlp),
    "fused_qkv_rope_wq": (cuda_gemv_int4.fused_qkv_rope_wq, _quantized_qkv),
}


def provider_op(op_name: str, provider: str):
    """torch.ops.cllm.<op>__<provider> (the OpOverloadPacket)."""
    return getattr(torch.ops.cllm, f"{op_name}__{provider}")


for _name, (_kernel, _handles) in {**TRITON_KERNELS, **SAMPLER_KERNELS}.items():
    register_kernel(_name, TRITON, _kernel, supports=triton_supports, priority=TRITON_PRIORITY, handles=_handles)
for _name, _kernel in CUDA_KERNELS.items():
    register_kernel(_name, CUDA, _kernel, supports=cuda_norm_mlp.supports, priority=CUDA_PRIORITY)
for _name, (_kernel, _handles) in CUDA_INT4_KERNELS.items():
    register_kernel(_name, CUDA, _kernel, supports=cuda_gemv_int4.supports, priority=CUDA_INT4_PRIORITY,
                    handles=_handles)
