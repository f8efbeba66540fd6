"""Fused semantic ops (``cllm::``) that the build's fusion passes rewrite the spec into.

Each is defined by ``ops.cllm_op`` from its reference implementation below, built from
``ops.py``'s reference helpers, so a fused graph computes what the unfused one does (up to float
rounding) on any device; the reference's signature is the op's schema and, run on fake tensors,
its fake. Kernel providers (Triton, CUDA C++) are made from that definition as
``cllm::<op>__<provider>`` (see ``kernels/registry.py``).

Ops that absorb a residual add (``fused_linear_residual``, the MLPs' optional ``residual``) add
the op's output *after* rounding it to the dtype, so they compute bit for bit what the separate
``aten.add`` did; likewise ``fused_qkv_rope``'s optional input RMSNorm (``norm_weight``) rounds
the normalised x before the projection, as the separate ``rms_norm`` op does.

Outputs never alias inputs or each other (custom ops require it), hence the copies of the
split q/k/v.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from compiled_llm.graph.ops import cllm_op, layer_norm_ref, rms_norm_ref, rotary_ref

# ---------------------------------------------------------------------------------------------
# Reference implementations: each op's one signature (shared by kernel providers' fallbacks and
# by the kernels' tests)
# ---------------------------------------------------------------------------------------------


def fused_add_rms_norm_ref(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    summed = residual + x
    return rms_norm_ref(summed, weight, eps), summed


def fused_add_layer_norm_ref(
    x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    summed = residual + x
    return layer_norm_ref(summed, weight, bias, eps), summed


def linear_ref(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """A linear the passes hand to the engine's kernels (the spec writes aten.linear, which runs
    cuBLAS): a sharded program's row-parallel linear before its all-reduce (fuse_residual)."""
    return F.linear(x, weight, bias)


def add_residual(out: Tensor, residual: Optional[Tensor]) -> Tensor:
    """``residual + out`` when a residual is given: the op's output is rounded to its dtype
    first, exactly as the separate aten.add it replaces saw it."""
    return out if residual is None else residual + out


def fused_rms_norm_residual_ref(x: Tensor, weight: Tensor, eps: float, residual: Tensor) -> Tensor:
    """``residual + rms_norm(x)``: Gemma's post-norms, which norm a sublayer's output before the
    residual add (the norm rounded to the dtype first, as the separate ops do)."""
    return residual + rms_norm_ref(x, weight, eps)


def fused_linear_residual_ref(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Tensor) -> Tensor:
    return residual + F.linear(x, weight, bias)


# The gated MLP's activations (``fused_rms_norm_glu_mlp``'s ``activation``): "silu" is SwiGLU
# (Llama, Qwen), "gelu_tanh" GeGLU (Gemma 2 and 3: transformers' gelu_pytorch_tanh).
GLU_ACTIVATIONS = ("silu", "gelu_tanh")


def glu_activation_ref(gate: Tensor, activation: str) -> Tensor:
    """The gate's activation in a gated MLP, ``act(gate) * up``, as the unfused graph computes it
    (rounded to gate's dtype)."""
    if activation == "silu":
        return F.silu(gate)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh")
    raise ValueError(f"unknown GLU activation {activation!r}; known: {', '.join(GLU_ACTIVATIONS)}")


def fused_rms_norm_glu_mlp_ref(
    x: Tensor,
    norm_weight: Tensor,
    eps: float,
    gate_up_weight: Tensor,
    down_weight: Tensor,
    residual: Optional[Tensor] = None,
    activation: str = "silu",
) -> Tensor:
    """down(act(gate(n)) * up(n)) (+ residual), n = rms_norm(x), act one of GLU_ACTIVATIONS.
    ``activation`` comes last and defaults to silu, what graphs saved before it existed meant,
    so they still load and run."""
    n = rms_norm_ref(x, norm_weight, eps)
    gate, up = F.linear(n, gate_up_weight).chunk(2, dim=-1)
    return add_residual(F.linear(glu_activation_ref(gate, activation) * up, down_weight), residual)


def fused_layer_norm_gelu_mlp_ref(
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
    n = layer_norm_ref(x, norm_weight, norm_bias, eps)
    out = F.linear(F.gelu(F.linear(n, fc_weight, fc_bias), approximate="tanh"), proj_weight, proj_bias)
    return add_residual(out, residual)


def fused_qkv_rope_ref(
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
    T = x.shape[0]
    if norm_weight is not None:  # the layer's input RMSNorm, rounded to the dtype as the separate op does
        x = rms_norm_ref(x, norm_weight, norm_eps)
    qkv = F.linear(x, qkv_weight, qkv_bias)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(T, num_heads, head_dim)
    k = k.reshape(T, num_kv_heads, head_dim)
    v = v.reshape(T, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        q = rms_norm_ref(q, q_norm_weight, eps)
    if k_norm_weight is not None:
        k = rms_norm_ref(k, k_norm_weight, eps)
    if cos_sin is not None:
        q = rotary_ref(q, positions, cos_sin)
        k = rotary_ref(k, positions, cos_sin)
    # clone, not contiguous(): with one token the splits are already contiguous views of qkv
    # and would alias each other
    fresh = q_norm_weight is not None or cos_sin is not None
    q = q.contiguous() if fresh else q.clone(memory_format=torch.contiguous_format)
    k = k.contiguous() if fresh else k.clone(memory_format=torch.contiguous_format)
    return q, k, v.clone(memory_format=torch.contiguous_format)


def moe_routing_ref(x: Tensor, router_weight: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """A mixture's routing, as transformers' Qwen3-MoE and Mixtral route: the router's logits
    (x's dtype), their softmax in float32, its top_k (renormalised to sum to 1 when
    ``renormalize``). Returns (weights [T, top_k] float32, expert ids [T, top_k] int64), the
    highest weight first."""
    probs = F.linear(x, router_weight).float().softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe_ref(x: Tensor, router_weight: Tensor, gate_up_weight: Tensor, down_weight: Tensor, top_k: int,
                  renormalize: bool, norm_weight: Optional[Tensor] = None, norm_eps: float = 0.0,
                  residual: Optional[Tensor] = None) -> Tensor:
    """A mixture of SwiGLU experts over x [T, H]: router_weight [E, H], gate_up_weight [E, 2I, H]
    (each expert's gate rows, then its up rows), down_weight [E, H, I]. Each token's output is
    the sum over its top_k experts of ``weight * down(silu(gate(x)) * up(x))``, the weight
    rounded to x's dtype and each product too, summed in float32 (the spec's graph does the same;
    transformers adds the experts one at a time in x's dtype, so in bf16 it rounds more). Written
    densely (every expert on every token, an unchosen one weighted 0) so that it has no
    data-dependent shapes; the kernels read only the chosen experts.

    With ``norm_weight``, x is the layer's RMSNorm input, normalised first (eps ``norm_eps``, as
    the separate op rounds it); with ``residual``, the output is ``residual + mixture``, the
    mixture rounded to the dtype before the add (the passes fold the norm before and the add after
    into the op, so a decode step runs neither as a launch of its own)."""
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, norm_eps)
    weights, ids = moe_routing_ref(x, router_weight, top_k, renormalize)
    dense = torch.zeros(x.shape[0], router_weight.shape[0], dtype=torch.float32, device=x.device)
    dense = dense.scatter(1, ids, weights).to(x.dtype)  # [T, E]
    gate, up = torch.matmul(x, gate_up_weight.transpose(1, 2)).chunk(2, dim=-1)  # [E, T, I] each
    experts = torch.matmul(F.silu(gate) * up, down_weight.transpose(1, 2))  # [E, T, H]
    return add_residual((experts * dense.t().unsqueeze(-1)).float().sum(0).to(x.dtype), residual)


# ---------------------------------------------------------------------------------------------
# The fused cllm:: ops
# ---------------------------------------------------------------------------------------------

linear = cllm_op("linear", linear_ref)
fused_add_rms_norm = cllm_op("fused_add_rms_norm", fused_add_rms_norm_ref)
fused_add_layer_norm = cllm_op("fused_add_layer_norm", fused_add_layer_norm_ref)
fused_linear_residual = cllm_op("fused_linear_residual", fused_linear_residual_ref)
fused_rms_norm_residual = cllm_op("fused_rms_norm_residual", fused_rms_norm_residual_ref)
fused_rms_norm_glu_mlp = cllm_op("fused_rms_norm_glu_mlp", fused_rms_norm_glu_mlp_ref)
fused_layer_norm_gelu_mlp = cllm_op("fused_layer_norm_gelu_mlp", fused_layer_norm_gelu_mlp_ref)
fused_qkv_rope = cllm_op("fused_qkv_rope", fused_qkv_rope_ref)
fused_moe = cllm_op("fused_moe", fused_moe_ref)
