"""Gemma 3: Gemma 2's decoder (``gemma2.py``)
with a (1 + w) RMSNorm over each head of q and k instead of score soft-capping, five sliding
layers to each global one, and a RoPE base of its own for the sliding layers
(``rope_local_base_freq``, 10,000, against the global layers' 1,000,000, whose frequencies alone
are scaled: linear x8 in the 4B+ checkpoints).

Two families read it: the text-only checkpoints (Gemma3ForCausalLM, 1B and the text models), and
the text part of the multimodal ones (Gemma3ForConditionalGeneration, 4B+), whose config.json
nests the decoder's fields under ``text_config`` and whose decoder tensors sit under
``language_model.``; their vision tower and projector are read and dropped (text in, text out)."""

from __future__ import annotations

from typing import Any

from compiled_llm.model.families.base import Family, rope_fields
from compiled_llm.model.families.gemma2 import TENSOR_NAMES, gemma_fields
from compiled_llm.model.families.llama import QK_NORM_NAMES

SLIDING_WINDOW_PATTERN = 6  # transformers' default: every sixth layer global


def _local_theta(hf: dict[str, Any]) -> float:
    """The sliding layers' RoPE base: transformers 5's rope_parameters keyed by layer type (whose
    full-attention entry ``rope_fields`` reads), or the 4.x key rope_local_base_freq."""
    params = hf.get("rope_parameters") or {}
    local = params.get("sliding_attention") if isinstance(params.get("sliding_attention"), dict) else None
    if local is not None:
        return float(local.get("rope_theta", 10000.0))
    return float(hf.get("rope_local_base_freq", 10000.0))


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    hf = dict(hf)
    if not hf.get("layer_types"):
        pattern = hf.get("sliding_window_pattern") or SLIDING_WINDOW_PATTERN
        hf["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                             for i in range(hf["num_hidden_layers"])]
    fields = gemma_fields(hf, rope_fields(hf))
    fields.update(qk_norm=True, rope_local_theta=_local_theta(hf) if fields["sliding_window"] else None)
    return fields


def multimodal_config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's fields of a Gemma3ForConditionalGeneration config.json."""
    text = dict(hf.get("text_config") or {})
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
    return config_fields(text)


FAMILY = Family(
    name="gemma3",
    model_types=("gemma3_text",),
    architectures=("Gemma3ForCausalLM",),
    config_fields=config_fields,
    tensor_names=TENSOR_NAMES + QK_NORM_NAMES,
    norm_offset=1.0,
)

MULTIMODAL_FAMILY = Family(
    name="gemma3_multimodal",
    model_types=("gemma3",),
    architectures=("Gemma3ForConditionalGeneration",),
    config_fields=multimodal_config_fields,
    tensor_names=FAMILY.tensor_names,
    checkpoint_prefix="language_model.",
    ignored=r"(vision_tower|multi_modal_projector)\..*",
    norm_offset=1.0,
)
