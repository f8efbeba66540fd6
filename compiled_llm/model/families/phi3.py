"""Phi-3 (mini; Phi-3.5 mini): Llama's decoder with q, k and v stored stacked in one
``qkv_proj`` and the MLP's gate and up in one ``gate_up_proj``, split at load (the fusion passes
fuse them again). Its ``sliding_window`` (2,047 in the 4k checkpoints) applies to every layer
(``every_layer_sliding``). The 128k checkpoints and Phi-3.5 scale their rotary frequencies
with LongRoPE ("longrope", "su" in older configs; ``rope_fields``), whose table switches from
the short factors to the long ones at original_max_position_embeddings, per position (see
``ops.longrope_cos_sin`` for how that differs from transformers past the original context)."""

from __future__ import annotations

from typing import Any

from compiled_llm.model.families.base import Family, TensorName, every_layer_sliding
from compiled_llm.model.families.llama import EMBEDDING_AND_NORM_NAMES, decoder_fields


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    return every_layer_sliding(decoder_fields(hf, qkv_bias=False, o_bias=False), hf)


TENSOR_NAMES = EMBEDDING_AND_NORM_NAMES + (
    TensorName("model.layers.{layer}.self_attn.{proj:qkv|o}_proj.weight", "layers.{layer}.{proj}.weight"),
    TensorName("model.layers.{layer}.mlp.{proj:gate_up|down}_proj.weight", "layers.{layer}.{proj}.weight"),
)

FAMILY = Family(
    name="phi3",
    model_types=("phi3",),
    architectures=("Phi3ForCausalLM",),
    config_fields=config_fields,
    tensor_names=TENSOR_NAMES,
    fused=(("qkv", ("q", "k", "v")), ("gate_up", ("gate", "up"))),
)
