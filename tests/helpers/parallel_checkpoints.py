"""Small transformers checkpoints whose shapes split over tensor-parallel ranks and pipeline
stages, of several families, and prompts for them: what the TP and PP tests compare with
transformers' greedy output.

Random init with a wide spread and untied embeddings (GPT-2's are always tied), so greedy
outputs vary from token to token.
"""

from __future__ import annotations

import random

import transformers

from helpers.lively import INIT_RANGE

LAYERS = 2
HEADS = 4
HEAD_DIM = 16  # hidden 64 / 4 heads (qwen3's is set to 32 below)


def _llama_like(layers: int = LAYERS, **kw):
    return {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": layers,
            "num_attention_heads": HEADS, "max_position_embeddings": 512, "tie_word_embeddings": False,
            "initializer_range": INIT_RANGE, "bos_token_id": None, "eos_token_id": None, **kw}


# family -> a model of ``layers`` decoder layers (LAYERS by default)
FAMILIES = {
    # 2 KV heads: one per rank; q/k/v biases
    "qwen2": lambda layers=LAYERS: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_llama_like(
        layers, num_key_value_heads=2, rope_theta=10000.0))),
    # head_dim 32 (q is wider than the hidden size), q/k norms
    "qwen3": lambda layers=LAYERS: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_llama_like(
        layers, num_key_value_heads=2, head_dim=32))),
    # 1 KV head for 2 ranks: both hold it
    "llama": lambda layers=LAYERS: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_llama_like(
        layers, num_key_value_heads=1, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))),
    # q, k, v and gate, up stored stacked (split at load, then sharded); pad id 0 (a token here)
    "phi3": lambda layers=LAYERS: transformers.Phi3ForCausalLM(transformers.Phi3Config(**_llama_like(
        layers, num_key_value_heads=2, pad_token_id=0))),
    # sandwich norms (the residual add rides the post-norm, not the all-reduce), soft-capped
    # scores and logits, and a window of 8 on every other layer that the prompts outrun
    "gemma2": lambda layers=LAYERS: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**_llama_like(
        layers, num_key_value_heads=2, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=8))),
    # 257 tokens: the vocabulary is padded to 258 to give each rank 129 rows; learned positions,
    # biases everywhere (row-parallel ones added once)
    "gpt2": lambda layers=LAYERS: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=257, n_embd=64, n_layer=layers, n_head=HEADS, n_positions=512,
        initializer_range=INIT_RANGE, bos_token_id=None, eos_token_id=None)),
}


PROMPT_LENGTHS = (3, 8, 15, 22, 31, 40)


def prompts_for(vocab_size: int) -> list[list[int]]:
    rng = random.Random(7)
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
    prompts[2][5] = vocab_size - 1  # the last id: the end of rank 1's rows (padded for gpt2)
    prompts[3][0] = 0  # the first: rank 0's
    return prompts
