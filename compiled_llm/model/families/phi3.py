"""Phi-3 (mini, small context): Llama's decoder with q, k and v stored stacked in one
``qkv_proj`` and the MLP's gate and up in one ``gate_up_proj``, split at load (the fusion passes
fuse them again). Its ``sliding_window`` (2,047 in the 4k checkpoints) cuts the context to it
(``context_within_window``); LongRoPE (the 128k checkpoints) is refused with the rope types."""

from __future__ import annotations

from typing import Any

from compiled_llm.model.families.base import Family, TensorName, context_within_window
from compiled_llm.model.families.llama import EMBEDDING_AND_NORM_NAMES, decoder_fields


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    return context_within_window(decoder_fields(hf, qkv_bias=False, o_bias=False), hf)


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
