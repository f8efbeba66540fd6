"""A lively checkpoint and its oracle, for tests that compare the runtime with transformers.

Random-init checkpoints with tied embeddings (and the presets) repeat one token forever: the
logits are dominated by the current token's embedding dotted with itself. Such outputs cannot
tell a decode position off by one from a correct one, nor exercise stops and detokenization.
This checkpoint unties the embeddings and initialises with a wide spread, so greedy outputs vary
from token to token, and pairs it with a byte-level BPE (tokens of several characters) trained on
a small text, whose specials include the EOS id the model emits now and then.

The oracle is transformers' own ``generate`` (greedy, one request at a time), run to a fixed
length without stopping, so every request's expected output is a prefix of its continuation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from helpers.trained_tokenizers import train_hf_tokenizer

# A wide initialisation: attention and MLP move the residual stream, so the next token depends
# on the context, not only on the current token.
INIT_RANGE = 0.2


def make_lively_checkpoint(out: Path, seed: int = 0, tokenizer=None, sliding_window: int | None = None,
                           experts: int = 0) -> transformers.PreTrainedModel:
    """Write a Qwen2 checkpoint (fp32, random init, untied) with a BPE tokenizer (default: the
    one trained here) to ``out``; returns the transformers model. With ``sliding_window`` it is
    a Mistral of the same shape whose every layer attends within that window; with ``experts``
    a Qwen3-MoE whose MLPs are that many experts, two of them per token."""
    tok = tokenizer if tokenizer is not None else train_hf_tokenizer(vocab_size=200, all_bytes=False)[1]
    torch.manual_seed(seed)
    shape = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, initializer_range=INIT_RANGE, rope_theta=10000.0,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), bos_token_id=None,
    )
    if experts:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **shape, num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)).eval()
    elif sliding_window is None:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape)).eval()
    else:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**shape, sliding_window=sliding_window)).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return model


@dataclass(frozen=True)
class Continuation:
    prompt: tuple[int, ...]
    token_ids: tuple[int, ...]  # greedy, never stopped
    min_margin: float  # smallest top-1 minus top-2 logit gap along the way


@torch.no_grad()
def build_lively_engine(checkpoint: Path, out: Path, **options) -> Path:
    """``checkpoint`` (``make_lively_checkpoint``'s) built into a CPU float32 engine at ``out``,
    with build ``options`` (tensor_parallel_size, pipeline_parallel_size, ...)."""
    from compiled_llm.engine.build import build_engine

    build_engine(str(checkpoint), out, dtype="float32", device="cpu", progress=False, **options)
    return out


def greedy_continuation(model, prompt: list[int], max_new_tokens: int) -> Continuation:
    """transformers' greedy generate, run to ``max_new_tokens`` whatever it emits."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    assert len(tokens) == max_new_tokens, "transformers stopped early"
    gaps = [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
    return Continuation(tuple(prompt), tuple(tokens), min(gaps))


def greedy_text_oracle(model, tokenizer):
    """``expected(prompt ids, n) -> (greedy token ids, their text)``: transformers' greedy
    continuation of n tokens (``greedy_continuation``) and its decoded text, each (prompt, n)
    computed once. What a server's answers are checked against."""
    cache: dict[tuple, tuple[list[int], str]] = {}

    def expected(ids: list[int], n: int) -> tuple[list[int], str]:
        key = (tuple(ids), n)
        if key not in cache:
            tokens = list(greedy_continuation(model, list(ids), n).token_ids)
            cache[key] = tokens, tokenizer.decode(tokens, skip_special_tokens=True)
        return cache[key]

    return expected
