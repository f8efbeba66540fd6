"""GPT-2: learned absolute positions, LayerNorm with a bias, a tanh-GELU MLP with biases, and
linears stored as Conv1D ([in, out]) with q, k and v in one tensor. lm_head is always the
token embedding."""

from __future__ import annotations

from typing import Any

from compiled_llm.errors import UnsupportedArchitectureError
from compiled_llm.model.families.base import Family, TensorName

# gelu_new and gelu_pytorch_tanh are the same tanh approximation of GELU
_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    act = hf.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise UnsupportedArchitectureError(f"unsupported GPT-2 activation {act!r}; supported: gelu_new")
    h, heads = hf["n_embd"], hf["n_head"]
    return {
        "vocab_size": hf["vocab_size"],
        "hidden_size": h,
        "intermediate_size": hf.get("n_inner") or 4 * h,
        "num_layers": hf["n_layer"],
        "num_heads": heads,
        "num_kv_heads": heads,
        "head_dim": h // heads,
        "max_position_embeddings": hf["n_positions"],
        "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
        "norm_type": "layer",
        "mlp_type": "gelu_tanh",
        "position_type": "learned",
        "qkv_bias": True,
        "o_bias": True,
        "tie_word_embeddings": True,
    }


FAMILY = Family(
    name="gpt2",
    model_types=("gpt2",),
    architectures=("GPT2LMHeadModel",),
    config_fields=config_fields,
    tensor_names=(
        TensorName("wte.weight", "embed.weight"),
        TensorName("wpe.weight", "pos_embed.weight"),
        TensorName("ln_f.{kind:weight|bias}", "final_norm.{kind}"),
        TensorName("h.{layer}.ln_1.{kind:weight|bias}", "layers.{layer}.attn_norm.{kind}"),
        TensorName("h.{layer}.ln_2.{kind:weight|bias}", "layers.{layer}.mlp_norm.{kind}"),
        TensorName("h.{layer}.attn.c_attn.{kind:weight|bias}", "layers.{layer}.qkv.{kind}"),
        TensorName("h.{layer}.attn.c_proj.{kind:weight|bias}", "layers.{layer}.o.{kind}"),
        TensorName("h.{layer}.mlp.c_fc.{kind:weight|bias}", "layers.{layer}.fc.{kind}"),
        TensorName("h.{layer}.mlp.c_proj.{kind:weight|bias}", "layers.{layer}.proj.{kind}"),
    ),
    checkpoint_prefix="transformer.",
    # lm_head is the embedding (some checkpoints store the copy anyway); attn.bias and
    # attn.masked_bias are the causal-mask buffers older checkpoints carry
    ignored=r"lm_head\.weight|h\.\d+\.attn\.(?:bias|masked_bias)",
    transposed=("qkv", "o", "fc", "proj"),
    fused=(("qkv", ("q", "k", "v")),),
)
