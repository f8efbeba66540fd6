"""Real Hugging Face checkpoints written by transformers itself (random init, small configs)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers


def _small(**kw):
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    base.update(kw)
    return base


FAMILY_CONFIGS = {
    "qwen2": lambda: transformers.Qwen2Config(**_small(tie_word_embeddings=True, rope_theta=10000.0)),
    "qwen3": lambda: transformers.Qwen3Config(**_small(head_dim=32, tie_word_embeddings=False)),
    "llama": lambda: transformers.LlamaConfig(**_small(
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        rope_theta=500000.0)),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256),
    # Mistral 7B v0.3's shape of config: no sliding window, rope_theta 1e6
    "mistral": lambda: transformers.MistralConfig(**_small(tie_word_embeddings=False, sliding_window=None,
                                                          rope_theta=1000000.0)),
    # Phi-3 mini's shape of config at a small size (its pad/bos/eos ids lie past this vocabulary)
    "phi3": lambda: transformers.Phi3Config(**_small(tie_word_embeddings=False, sliding_window=None,
                                                     pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Gemma 2 at a small size: soft-capped scores and logits, sandwich norms, GeGLU, and a
    # window (every other layer) that the tests' prompts outrun
    "gemma2": lambda: transformers.Gemma2Config(**_small(head_dim=32, query_pre_attn_scalar=32, sliding_window=24,
                                                         tie_word_embeddings=True)),
    # Gemma 3: two sliding layers to a global one, each kind with its own RoPE (the global one
    # scaled linearly, as in the 4B+ checkpoints), q/k norms
    "gemma3": lambda: transformers.Gemma3TextConfig(**_small(
        head_dim=32, query_pre_attn_scalar=32, sliding_window=24, num_hidden_layers=3, tie_word_embeddings=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # Gemma 3's multimodal checkpoints (4B+): the same decoder under text_config and
    # language_model., beside a vision tower the engine reads and drops
    "gemma3_multimodal": lambda: transformers.Gemma3Config(
        text_config=_small(head_dim=32, query_pre_attn_scalar=32, sliding_window=24, num_hidden_layers=3,
                           vocab_size=300, layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=16),
        mm_tokens_per_image=4, boi_token_index=297, eoi_token_index=298, image_token_index=299),
    # mixtures of experts: Qwen3-MoE with a dense first layer (mlp_only_layers), top-2 of 4
    # experts renormalised; Mixtral, top-2 of 4
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**_small(
        head_dim=32, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        norm_topk_prob=True, mlp_only_layers=[0], tie_word_embeddings=False)),
    "mixtral": lambda: transformers.MixtralConfig(**_small(
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False, sliding_window=None)),
}
MODEL_CLASSES = {
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "llama": transformers.LlamaForCausalLM,
    "gpt2": transformers.GPT2LMHeadModel,
    "mistral": transformers.MistralForCausalLM,
    "phi3": transformers.Phi3ForCausalLM,
    "gemma2": transformers.Gemma2ForCausalLM,
    "gemma3": transformers.Gemma3ForCausalLM,
    "gemma3_multimodal": transformers.Gemma3ForConditionalGeneration,
    "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    "mixtral": transformers.MixtralForCausalLM,
}


def make_checkpoint(family: str, out_dir: Path, seed: int = 0, max_shard_size: str | None = None):
    """Write a random-init checkpoint of ``family``; returns the transformers model (eval, fp32)."""
    torch.manual_seed(seed)
    config = FAMILY_CONFIGS[family]()
    model = MODEL_CLASSES[family](config).eval()
    # transformers initialises small; widen the norms/biases so tests see real differences
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kw)
    return model
