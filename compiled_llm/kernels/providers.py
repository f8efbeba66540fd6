"""Triton and CUDA C++ providers of the cllm:: ops, registered with the kernel registry.

Each provider is its own ``torch.library.custom_op`` named ``cllm::<op>__<provider>`` with the
semantic op's exact schema (argument names, types, mutations), so the build's select_kernels
pass can swap the call target without touching arguments, and exported programs name it. Fake
implementations return fresh contiguous tensors, like the kernels do.

Triton providers: every semantic and fused op, CUDA devices, fp32/bf16/fp16. The CUDA C++ norm+MLP
provider ranks below Triton, so a build gets it only by asking (``prefer={op: "cuda"}``); it
compiles on first use and runs Triton if it cannot (see cuda_norm_mlp).

Shapes a kernel does not handle go to the reference implementation inside the provider rather
than failing: the choice of provider is per op and dtype, not per shape.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from compiled_llm.graph import fused_ops, ops
from compiled_llm.kernels import (
    cuda_norm_mlp, triton_gemv, triton_norm, triton_norm_mlp, triton_paged_attention, triton_qkv_rope,
)
from compiled_llm.kernels.registry import Provider, register_provider

TRITON = "triton"
CUDA = "cuda"
TRITON_PRIORITY = 10
CUDA_PRIORITY = 5
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


def _empty(x: Tensor, *shape: int) -> Tensor:
    return x.new_empty(shape)


# ---------------------------------------------------------------------------------------------
# norms
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("cllm::rms_norm__triton", mutates_args=())
def rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.shape[-1] > MAX_ROW_NORM:
        return ops.rms_norm_ref(x, weight, eps)
    return triton_norm.rms_norm(x, weight, eps)


@rms_norm_triton.register_fake
def _(x, weight, eps):
    return _empty(x, *x.shape)


@torch.library.custom_op("cllm::layer_norm__triton", mutates_args=())
def layer_norm_triton(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    if x.shape[-1] > MAX_ROW_NORM:
        return ops.layer_norm_ref(x, weight, bias, eps)
    return triton_norm.layer_norm(x, weight, bias, eps)


@layer_norm_triton.register_fake
def _(x, weight, bias, eps):
    return _empty(x, *x.shape)


@torch.library.custom_op("cllm::fused_add_rms_norm__triton", mutates_args=())
def fused_add_rms_norm_triton(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if x.shape[-1] > MAX_ROW_NORM or residual.shape != x.shape:
        return fused_ops.fused_add_rms_norm_ref(x, residual, weight, eps)
    return triton_norm.fused_add_rms_norm(x, residual, weight, eps)


@fused_add_rms_norm_triton.register_fake
def _(x, residual, weight, eps):
    return _empty(x, *x.shape), _empty(x, *x.shape)


@torch.library.custom_op("cllm::fused_add_layer_norm__triton", mutates_args=())
def fused_add_layer_norm_triton(
    x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    if x.shape[-1] > MAX_ROW_NORM or residual.shape != x.shape:
        return fused_ops.fused_add_layer_norm_ref(x, residual, weight, bias, eps)
    return triton_norm.fused_add_layer_norm(x, residual, weight, bias, eps)


@fused_add_layer_norm_triton.register_fake
def _(x, residual, weight, bias, eps):
    return _empty(x, *x.shape), _empty(x, *x.shape)


# ---------------------------------------------------------------------------------------------
# rotary / qkv
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("cllm::rotary_embedding__triton", mutates_args=())
def rotary_embedding_triton(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor]:
    if q.shape[-1] % 2:
        return ops.rotary_ref(q, positions, cos_sin), ops.rotary_ref(k, positions, cos_sin)
    return triton_qkv_rope.rotary_embedding(q, k, positions, cos_sin)


@rotary_embedding_triton.register_fake
def _(q, k, positions, cos_sin):
    return _empty(q, *q.shape), _empty(k, *k.shape)


@torch.library.custom_op("cllm::fused_qkv_rope__triton", mutates_args=())
def fused_qkv_rope_triton(
    x: Tensor,
    qkv_weight: Tensor,
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
    args = (x, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight, positions, cos_sin,
            num_heads, num_kv_heads, head_dim, eps)
    if not triton_qkv_rope.supports_shape(head_dim, q_norm_weight is not None, k_norm_weight is not None):
        return fused_ops.fused_qkv_rope_ref(*args, norm_weight, norm_eps)
    return triton_qkv_rope.fused_qkv_rope(*args, norm_weight=norm_weight, norm_eps=norm_eps)


@fused_qkv_rope_triton.register_fake
def _(x, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight, positions, cos_sin,
      num_heads, num_kv_heads, head_dim, eps, norm_weight=None, norm_eps=0.0):
    T = x.shape[0]
    return _empty(x, T, num_heads, head_dim), _empty(x, T, num_kv_heads, head_dim), _empty(x, T, num_kv_heads, head_dim)


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("cllm::paged_attention__triton", mutates_args=("kv_cache",))
def paged_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
) -> Tensor:
    return triton_paged_attention.paged_attention(
        q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_tables, scale
    )


@paged_attention_triton.register_fake
def _(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_tables, scale):
    return _empty(q, *q.shape)


# ---------------------------------------------------------------------------------------------
# linear + residual add (o projection)
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("cllm::fused_linear_residual__triton", mutates_args=())
def fused_linear_residual_triton(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Tensor) -> Tensor:
    # the kernel adds a residual of the output's shape; a broadcasting one goes to the reference
    if residual.shape != (*x.shape[:-1], weight.shape[0]):
        return fused_ops.fused_linear_residual_ref(x, weight, bias, residual)
    return triton_gemv.linear_residual(x, weight, bias, residual)


@fused_linear_residual_triton.register_fake
def _(x, weight, bias, residual):
    return _empty(x, *x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------------------------------------
# norm + MLP (Triton and CUDA C++)
# ---------------------------------------------------------------------------------------------


def _glu_fake(x, norm_weight, eps, gate_up_weight, down_weight, residual=None):
    return _empty(x, *x.shape[:-1], down_weight.shape[0])


def _gelu_fake(x, norm_weight, norm_bias, eps, fc_weight, fc_bias, proj_weight, proj_bias, residual=None):
    return _empty(x, *x.shape[:-1], proj_weight.shape[0])


@torch.library.custom_op("cllm::fused_rms_norm_glu_mlp__triton", mutates_args=())
def fused_rms_norm_glu_mlp_triton(
    x: Tensor,
    norm_weight: Tensor,
    eps: float,
    gate_up_weight: Tensor,
    down_weight: Tensor,
    residual: Optional[Tensor] = None,
) -> Tensor:
    return triton_norm_mlp.fused_rms_norm_glu_mlp(x, norm_weight, eps, gate_up_weight, down_weight, residual=residual)


@torch.library.custom_op("cllm::fused_layer_norm_gelu_mlp__triton", mutates_args=())
def fused_layer_norm_gelu_mlp_triton(
    x: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    eps: float,
    fc_weight: Tensor,
    fc_bias: Tensor,
    proj_weight: Tensor,
    proj_bias: Tensor,
    residual: Optional[Tensor] = None,
) -> Tensor:
    return triton_norm_mlp.fused_layer_norm_gelu_mlp(
        x, norm_weight, norm_bias, eps, fc_weight, fc_bias, proj_weight, proj_bias, residual=residual
    )


# The CUDA C++ kernels have no residual epilogue: the add runs after them, on the rounded output
# (what the reference computes), still saving the separate graph node.


@torch.library.custom_op("cllm::fused_rms_norm_glu_mlp__cuda", mutates_args=())
def fused_rms_norm_glu_mlp_cuda(
    x: Tensor,
    norm_weight: Tensor,
    eps: float,
    gate_up_weight: Tensor,
    down_weight: Tensor,
    residual: Optional[Tensor] = None,
) -> Tensor:
    out = cuda_norm_mlp.fused_rms_norm_glu_mlp(x, norm_weight, eps, gate_up_weight, down_weight)
    return fused_ops.add_residual(out, residual)


@torch.library.custom_op("cllm::fused_layer_norm_gelu_mlp__cuda", mutates_args=())
def fused_layer_norm_gelu_mlp_cuda(
    x: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    eps: float,
    fc_weight: Tensor,
    fc_bias: Tensor,
    proj_weight: Tensor,
    proj_bias: Tensor,
    residual: Optional[Tensor] = None,
) -> Tensor:
    out = cuda_norm_mlp.fused_layer_norm_gelu_mlp(
        x, norm_weight, norm_bias, eps, fc_weight, fc_bias, proj_weight, proj_bias
    )
    return fused_ops.add_residual(out, residual)


for _op in (fused_rms_norm_glu_mlp_triton, fused_rms_norm_glu_mlp_cuda):
    _op.register_fake(_glu_fake)
for _op in (fused_layer_norm_gelu_mlp_triton, fused_layer_norm_gelu_mlp_cuda):
    _op.register_fake(_gelu_fake)


# ---------------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------------

TRITON_OPS = {
    "rms_norm": rms_norm_triton,
    "layer_norm": layer_norm_triton,
    "rotary_embedding": rotary_embedding_triton,
    "paged_attention": paged_attention_triton,
    "fused_add_rms_norm": fused_add_rms_norm_triton,
    "fused_add_layer_norm": fused_add_layer_norm_triton,
    "fused_qkv_rope": fused_qkv_rope_triton,
    "fused_linear_residual": fused_linear_residual_triton,
    "fused_rms_norm_glu_mlp": fused_rms_norm_glu_mlp_triton,
    "fused_layer_norm_gelu_mlp": fused_layer_norm_gelu_mlp_triton,
}
CUDA_OPS = {
    "fused_rms_norm_glu_mlp": fused_rms_norm_glu_mlp_cuda,
    "fused_layer_norm_gelu_mlp": fused_layer_norm_gelu_mlp_cuda,
}


def provider_op(op_name: str, provider: str):
    """torch.ops.cllm.<op>__<provider> (the OpOverloadPacket)."""
    return getattr(torch.ops.cllm, f"{op_name}__{provider}")


def direct_implementations() -> dict:
    """Provider op overload -> the Python function behind it. The op-by-op runtime program calls
    these directly: the dispatcher and the custom-op wrapper around each call cost more host time
    than launching the kernels (a prefill step is host-bound without it). Graphs that are saved,
    exported or compiled keep naming the ops. ``_init_fn`` is where CustomOpDef keeps the
    function; a torch without it keeps the dispatcher path."""
    out = {}
    for table, provider in ((TRITON_OPS, TRITON), (CUDA_OPS, CUDA)):
        for name, op in table.items():
            fn = getattr(op, "_init_fn", None)
            if callable(fn):
                out[provider_op(name, provider).default] = fn
    return out


def register_all() -> None:
    for name in TRITON_OPS:
        register_provider(name, Provider(TRITON, provider_op(name, TRITON), triton_supports, TRITON_PRIORITY))
    for name in CUDA_OPS:
        register_provider(name, Provider(CUDA, provider_op(name, CUDA), cuda_norm_mlp.supports, CUDA_PRIORITY))


register_all()
