"""Mixtral: Mistral's decoder (a sliding window when set) with every MLP a mixture of
``num_local_experts`` SwiGLU experts (w1 the gate, w3 the up, w2 the down projection), routed top
``num_experts_per_tok`` and always renormalised over the chosen ones."""

from __future__ import annotations

from typing import Any

from compiled_llm.model.families.base import Family, TensorName, every_layer_sliding
from compiled_llm.model.families.llama import EMBEDDING_AND_NORM_NAMES, decoder_fields
from compiled_llm.model.families.qwen3_moe import expert_fields


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    fields = every_layer_sliding(decoder_fields(hf, qkv_bias=False, o_bias=False), hf)
    return {**fields, **expert_fields(hf, hf["num_local_experts"], list(range(hf["num_hidden_layers"])), True)}


FAMILY = Family(
    name="mixtral",
    model_types=("mixtral",),
    architectures=("MixtralForCausalLM",),
    config_fields=config_fields,
    tensor_names=EMBEDDING_AND_NORM_NAMES + (
        TensorName("model.layers.{layer}.self_attn.{proj:q|k|v|o}_proj.weight", "layers.{layer}.{proj}.weight"),
        TensorName("model.layers.{layer}.block_sparse_moe.gate.weight", "layers.{layer}.router.weight"),
        TensorName("model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
                   "layers.{layer}.experts.{expert}.gate.weight"),
        TensorName("model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
                   "layers.{layer}.experts.{expert}.up.weight"),
        TensorName("model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",
                   "layers.{layer}.experts.{expert}.down.weight"),
    ),
)
