"""Qwen3: Llama with an RMSNorm over each head of q and k (the qk-norm, before the rotary
embedding) and a head_dim of its own; ``attention_bias`` puts a bias on q, k and v."""

from __future__ import annotations

from typing import Any

from compiled_llm.model.families.base import Family
from compiled_llm.model.families.llama import QK_NORM_NAMES, TENSOR_NAMES, decoder_fields


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    # transformers' Qwen3 puts attention_bias on o_proj too, but the spec reads Qwen3's o
    # without a bias whatever it says (released Qwen3 checkpoints set it false)
    return decoder_fields(hf, qkv_bias=bool(hf.get("attention_bias", False)), o_bias=False, qk_norm=True)


FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    architectures=("Qwen3ForCausalLM",),
    config_fields=config_fields,
    tensor_names=TENSOR_NAMES + QK_NORM_NAMES,
)
