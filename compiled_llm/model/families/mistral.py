"""Mistral: Llama's decoder without attention biases, and a ``sliding_window`` (Mistral 7B
v0.1: 4,096; null from v0.2), which cuts the context to it (``context_within_window``)."""

from __future__ import annotations

from typing import Any

from compiled_llm.model.families.base import Family, context_within_window
from compiled_llm.model.families.llama import TENSOR_NAMES, decoder_fields


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    return context_within_window(decoder_fields(hf, qkv_bias=False, o_bias=False), hf)


FAMILY = Family(
    name="mistral",
    model_types=("mistral",),
    architectures=("MistralForCausalLM",),
    config_fields=config_fields,
    tensor_names=TENSOR_NAMES,
)
