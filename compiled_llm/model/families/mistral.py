"""Mistral: Llama's decoder without attention biases, and a ``sliding_window`` (Mistral 7B
v0.1: 4,096; null from v0.2) on every layer (``every_layer_sliding``)."""

from __future__ import annotations

from typing import Any

from compiled_llm.model.families.base import Family, every_layer_sliding
from compiled_llm.model.families.llama import TENSOR_NAMES, decoder_fields


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    return every_layer_sliding(decoder_fields(hf, qkv_bias=False, o_bias=False), hf)


FAMILY = Family(
    name="mistral",
    model_types=("mistral",),
    architectures=("MistralForCausalLM",),
    config_fields=config_fields,
    tensor_names=TENSOR_NAMES,
)
