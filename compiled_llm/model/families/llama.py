"""Llama: the pre-norm decoder the other rotary families build on. RMSNorm, rotary positions
(llama3 frequency scaling from Llama 3.1 on), grouped-query attention, a SwiGLU MLP, and
``attention_bias`` putting a bias on all four attention projections."""

from __future__ import annotations

from typing import Any

from compiled_llm.errors import UnsupportedArchitectureError
from compiled_llm.model.families.base import Family, TensorName, rope_fields


def shape_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The sizes every rotary decoder's config.json names alike (Llama's and Gemma's)."""
    heads = hf["num_attention_heads"]
    return {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf["intermediate_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        # Qwen3, Llama 3.2 and Gemma name a head_dim that is not hidden_size / heads
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
    }


def decoder_fields(hf: dict[str, Any], *, qkv_bias: bool, o_bias: bool, qk_norm: bool = False) -> dict[str, Any]:
    """The ModelConfig fields of a Llama-style config.json; the families built on Llama differ
    in where the attention has biases and whether q and k are normed."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitectureError(f"unsupported activation {act!r}; supported: silu")
    rope = rope_fields(hf)
    return {
        **shape_fields(hf),
        "max_position_embeddings": rope.pop("max_position_embeddings", hf.get("max_position_embeddings", 2048)),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "norm_type": "rms",
        "mlp_type": "silu_glu",
        "position_type": "rope",
        **rope,
        "qkv_bias": qkv_bias,
        "o_bias": o_bias,
        "qk_norm": qk_norm,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return decoder_fields(hf, qkv_bias=bias, o_bias=bias)


# The names transformers' decoders save for the embeddings, the final norm and the lm_head
# (every rotary family's).
EMBEDDING_NAMES = (
    TensorName("model.embed_tokens.weight", "embed.weight"),
    TensorName("model.norm.weight", "final_norm.weight"),
    TensorName("lm_head.weight", "lm_head.weight"),
)

# The names transformers' Llama-style models save for the embeddings and norms (Phi-3 too).
EMBEDDING_AND_NORM_NAMES = EMBEDDING_NAMES + (
    TensorName("model.layers.{layer}.input_layernorm.weight", "layers.{layer}.attn_norm.weight"),
    TensorName("model.layers.{layer}.post_attention_layernorm.weight", "layers.{layer}.mlp_norm.weight"),
)

# The q/k/v/o and gate/up/down projections, stored apart (Gemma's too).
PROJECTION_NAMES = (
    TensorName("model.layers.{layer}.self_attn.{proj:q|k|v|o}_proj.{kind:weight|bias}", "layers.{layer}.{proj}.{kind}"),
    TensorName("model.layers.{layer}.mlp.{proj:gate|up|down}_proj.weight", "layers.{layer}.{proj}.weight"),
)

# The RMSNorm over each head of q and k (Qwen3, Qwen3-MoE, Gemma 3).
QK_NORM_NAMES = (
    TensorName("model.layers.{layer}.self_attn.{proj:q|k}_norm.weight", "layers.{layer}.{proj}_norm.weight"),
)

# The names transformers' LlamaForCausalLM saves, which Qwen2, Qwen3 and Mistral share.
TENSOR_NAMES = EMBEDDING_AND_NORM_NAMES + PROJECTION_NAMES

FAMILY = Family(
    name="llama",
    model_types=("llama",),
    architectures=("LlamaForCausalLM",),
    config_fields=config_fields,
    tensor_names=TENSOR_NAMES,
)
