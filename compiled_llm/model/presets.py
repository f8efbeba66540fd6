"""Built-in models that need no download: real architectures' shapes with random weights.

Each preset is the ``config.json`` a Hugging Face checkpoint of that model would have, so the
same ``config_from_hf`` reads it and a preset can be rebuilt in transformers for comparisons
(``transformers.AutoConfig.for_model(**preset_hf_config(name))``). Weights are
``model.weights.random_params`` with a fixed seed; the tokenizer is the byte-level one from
``compiled_llm.model.tokenizer``, whose specials are the presets' EOS ids.

The ``tiny-*`` presets are small enough to build and run in seconds on a CPU.
"""

from __future__ import annotations

from typing import Any

from compiled_llm.errors import CompiledLLMError
from compiled_llm.model.config import ModelConfig, config_from_hf

PRESET_SEED = 0
# Ids of the byte-level tokenizer's specials (see tokenizer.byte_level_tokenizer).
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 256, 257, 258
PRESET_EOS_IDS = [IM_END_ID, ENDOFTEXT_ID]
# Tiny presets' vocab: the tokenizer's 259 ids padded to a multiple of 16.
TINY_VOCAB = 272

_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _qwen2(**kw) -> dict[str, Any]:
    d = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    }
    d.update(kw)
    return d


def _qwen3(**kw) -> dict[str, Any]:
    d = _qwen2(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False)
    d.update(kw)
    return d


def _llama(**kw) -> dict[str, Any]:
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": dict(_LLAMA3_SCALING),
        "tie_word_embeddings": True,
        "attention_bias": False,
    }
    d.update(kw)
    return d


def _mistral(**kw) -> dict[str, Any]:
    d = {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    }
    d.update(kw)
    return d


def _phi3(**kw) -> dict[str, Any]:
    d = _mistral(architectures=["Phi3ForCausalLM"], model_type="phi3", rope_theta=10000.0)
    d.update(kw)
    return d


def _gemma2(**kw) -> dict[str, Any]:
    d = {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "tie_word_embeddings": True,
    }
    d.update(kw)
    return d


def _gemma3(**kw) -> dict[str, Any]:
    d = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "tie_word_embeddings": True,
    }
    d.update(kw)
    return d


def _qwen3_moe(**kw) -> dict[str, Any]:
    d = _qwen3(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", norm_topk_prob=True,
               decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
    d.update(kw)
    return d


def _mixtral(**kw) -> dict[str, Any]:
    d = _mistral(architectures=["MixtralForCausalLM"], model_type="mixtral")
    d.update(kw)
    return d


def _gpt2(**kw) -> dict[str, Any]:
    d = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "n_inner": None,
    }
    d.update(kw)
    return d


# name -> config.json contents (eos ids added by preset_hf_config)
_PRESETS: dict[str, dict[str, Any]] = {
    # Real shapes (numbers from the models' published config.json files)
    "qwen3-30b-a3b": _qwen3_moe(  # 61 GB in bf16: build it with load_format="dummy" to skip the disk
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    ),
    "mixtral-8x7b": _mixtral(  # 93 GB in bf16 (one H200): load_format="dummy" as above
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rope_theta=1000000.0,
        sliding_window=None, num_local_experts=8, num_experts_per_tok=2,
    ),
    "qwen2.5-0.5b": _qwen2(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
    ),
    "qwen3-0.6b": _qwen3(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    ),
    "llama-3.2-1b": _llama(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
    ),
    "gpt2": _gpt2(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024),
    # The 7-8B size most people serve: head_dim 128, GQA groups of 4 and 7, K up to 18,944
    "llama-3.1-8b": _llama(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        tie_word_embeddings=False, rope_scaling=dict(_LLAMA3_SCALING, factor=8.0),
    ),
    "mistral-7b": _mistral(  # v0.3
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
    ),
    "phi-3-mini": _phi3(  # 4k, with a 2,047-token sliding window on every layer
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
        original_max_position_embeddings=4096, sliding_window=2047,
    ),
    "gemma-2-2b": _gemma2(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
    ),
    "gemma-3-1b": _gemma3(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
    ),
    "qwen2.5-7b": _qwen2(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    # Tiny: same families, quick on a CPU
    "tiny-qwen2": _qwen2(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    ),
    "tiny-qwen3": _qwen3(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
    ),
    "tiny-llama": _llama(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False,
        rope_scaling=dict(_LLAMA3_SCALING, factor=8.0, original_max_position_embeddings=256),
    ),
    "tiny-gpt2": _gpt2(vocab_size=TINY_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=1024),
    "tiny-mistral": _mistral(  # a window that prompts and generations outrun
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, sliding_window=48,
    ),
    "tiny-qwen3-moe": _qwen3_moe(  # top-2 of 4 experts; the first layer dense
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, mlp_only_layers=[0],
    ),
    "tiny-mixtral": _mixtral(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        num_local_experts=4, num_experts_per_tok=2,
    ),
    "tiny-gemma2": _gemma2(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        query_pre_attn_scalar=32, sliding_window=48,
    ),
    "tiny-gemma3": _gemma3(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
        query_pre_attn_scalar=32, sliding_window=48, sliding_window_pattern=3,
    ),
}

PRESET_NAMES = tuple(_PRESETS)


def is_preset(name: str) -> bool:
    return name in _PRESETS


def preset_hf_config(name: str) -> dict[str, Any]:
    """The config.json a checkpoint of preset ``name`` would have."""
    if name not in _PRESETS:
        raise CompiledLLMError(f"unknown preset {name!r}; presets: {', '.join(PRESET_NAMES)}")
    d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in _PRESETS[name].items()}
    d["eos_token_id"] = list(PRESET_EOS_IDS)
    d["bos_token_id"] = None
    return d


def preset_config(name: str) -> ModelConfig:
    return config_from_hf(preset_hf_config(name))
