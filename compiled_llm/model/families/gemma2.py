"""Gemma 2: a pre- and post-norm ("sandwich") decoder whose RMSNorms scale by (1 + w), with
embeddings scaled by sqrt(hidden_size), a GeGLU MLP (gelu tanh), scores scaled by
query_pre_attn_scalar ** -0.5 and soft-capped (attn_logit_softcapping), final logits
soft-capped, and sliding-window layers (every other one, from the first) alternating with
global ones (``layer_types``).

The (1 + w) of its norms is added to the weights at load (``Family.norm_offset``), so the spec's
one RMSNorm serves: in float32 that is exactly transformers' ``x_normed * (1 + w)``. In bf16 it
rounds where transformers does not: the weight 1 + w is stored in bf16, and the normalised row is
rounded to bf16 before the multiply (Llama's order), where transformers rounds once, after it.
"""

from __future__ import annotations

from typing import Any

from compiled_llm.errors import UnsupportedArchitectureError
from compiled_llm.model.families.base import Family, TensorName, rope_fields
from compiled_llm.model.families.llama import EMBEDDING_NAMES, PROJECTION_NAMES, shape_fields


def gemma_fields(hf: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields Gemma 2 and Gemma 3 read alike (``rope``: rope_fields' result)."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedArchitectureError(f"unsupported activation {act!r}; supported: gelu_pytorch_tanh")
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedArchitectureError("unsupported use_bidirectional_attention (an encoder); supported: causal")
    layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window")
    types = tuple(hf.get("layer_types") or ())
    if types and len(types) != layers:
        raise UnsupportedArchitectureError(f"layer_types lists {len(types)} layers, num_hidden_layers is {layers}")
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UnsupportedArchitectureError(f"unsupported layer type {unknown[0]!r}; supported: full_attention, "
                                           "sliding_attention")
    if window is None:  # no window: every layer global
        types = ()
    return {
        **shape_fields(hf),
        "max_position_embeddings": rope.pop("max_position_embeddings", hf.get("max_position_embeddings", 8192)),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "norm_type": "rms",
        "mlp_type": "gelu_tanh_glu",
        "position_type": "rope",
        **rope,
        "qkv_bias": bool(hf.get("attention_bias", False)),
        "o_bias": bool(hf.get("attention_bias", False)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "sliding_window": window if types and "sliding_attention" in types else None,
        "layer_types": types if window is not None and "sliding_attention" in types else (),
        "attn_softcap": hf.get("attn_logit_softcapping") or None,  # 0: none
        "final_softcap": hf.get("final_logit_softcapping") or None,
        "query_pre_attn_scalar": hf.get("query_pre_attn_scalar"),
        "embed_scale": True,
        "sandwich_norms": True,
    }


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    hf = dict(hf)
    if not hf.get("layer_types"):  # a config.json transformers did not complete: its default
        hf["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                             for i in range(hf["num_hidden_layers"])]
    return gemma_fields(hf, rope_fields(hf))


# The names transformers' Gemma 2 and Gemma 3 save: four norms per layer, the sandwich's
# post_attention_layernorm after the attention (Llama's is the MLP's input norm)
TENSOR_NAMES = EMBEDDING_NAMES + (
    TensorName("model.layers.{layer}.input_layernorm.weight", "layers.{layer}.attn_norm.weight"),
    TensorName("model.layers.{layer}.post_attention_layernorm.weight", "layers.{layer}.post_attn_norm.weight"),
    TensorName("model.layers.{layer}.pre_feedforward_layernorm.weight", "layers.{layer}.mlp_norm.weight"),
    TensorName("model.layers.{layer}.post_feedforward_layernorm.weight", "layers.{layer}.post_mlp_norm.weight"),
) + PROJECTION_NAMES

FAMILY = Family(
    name="gemma2",
    model_types=("gemma2",),
    architectures=("Gemma2ForCausalLM",),
    config_fields=config_fields,
    tensor_names=TENSOR_NAMES,
    norm_offset=1.0,
)
