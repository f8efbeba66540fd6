"""Qwen2 (and Qwen2.5): Llama with a bias on q, k and v (always, whatever ``attention_bias``
says) and none on o."""

from __future__ import annotations

from typing import Any

from compiled_llm.model.families.base import Family
from compiled_llm.model.families.llama import TENSOR_NAMES, decoder_fields


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    return decoder_fields(hf, qkv_bias=True, o_bias=False)


FAMILY = Family(
    name="qwen2",
    model_types=("qwen2",),
    architectures=("Qwen2ForCausalLM",),
    config_fields=config_fields,
    tensor_names=TENSOR_NAMES,
)
