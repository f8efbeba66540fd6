"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms, a head_dim of its
own) with, in every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``, a mixture of
``num_experts`` SwiGLU experts routed top ``num_experts_per_tok`` (renormalised when
``norm_topk_prob``); the other layers keep Qwen3's dense MLP."""

from __future__ import annotations

from typing import Any

from compiled_llm.model.families.base import Family, TensorName
from compiled_llm.model.families.llama import QK_NORM_NAMES, TENSOR_NAMES, decoder_fields


def expert_fields(hf: dict[str, Any], experts: int, moe_layers: list[int], norm_topk_prob: bool) -> dict[str, Any]:
    """The ModelConfig fields of a mixture of experts (Qwen3-MoE's and Mixtral's names differ)."""
    return {
        "num_experts": experts,
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf.get("moe_intermediate_size") or hf["intermediate_size"],
        "norm_topk_prob": norm_topk_prob,
        "moe_layers": tuple(moe_layers),
    }


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    fields = decoder_fields(hf, qkv_bias=bool(hf.get("attention_bias", False)), o_bias=False, qk_norm=True)
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0  # transformers 5 names it the latter
    step = hf.get("decoder_sparse_step") or 1
    dense = set(hf.get("mlp_only_layers") or ())
    moe_layers = [n for n in range(hf["num_hidden_layers"]) if experts and n not in dense and (n + 1) % step == 0]
    return {**fields, **expert_fields(hf, experts if moe_layers else 0, moe_layers,
                                      bool(hf.get("norm_topk_prob", False)))}


FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    architectures=("Qwen3MoeForCausalLM",),
    config_fields=config_fields,
    # Qwen3's, with a mixture's router and experts beside its dense layers' MLPs
    tensor_names=TENSOR_NAMES + QK_NORM_NAMES + (
        TensorName("model.layers.{layer}.mlp.gate.weight", "layers.{layer}.router.weight"),
        TensorName("model.layers.{layer}.mlp.experts.{expert}.{proj:gate|up|down}_proj.weight",
                   "layers.{layer}.experts.{expert}.{proj}.weight"),
    ),
)
