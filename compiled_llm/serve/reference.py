"""The reference generation loop: eager spec, one prompt at a time, paged KV cache.

It is the oracle the compiled runtime is tested against and the path ``compiled-llm run SOURCE
--eager`` takes for checkpoints and presets. It favours obviousness over speed: each prompt gets its own cache
sized to prompt + max_tokens, a prefill step, then one decode step per token, sampled with the
same ``sampling.sample`` the runtime uses (so seeded sampling matches too).

Token-level stop rules, in order, after each sampled token (the token is kept in the output,
as transformers and vLLM do):
  - a stop_token_ids hit, or an EOS id unless ignore_eos -> "stop"
  - a stop string in the detokenized output (only when ``detokenize`` is given) -> "stop"
  - max_tokens reached -> "length"
Before ``min_tokens`` output tokens the stop tokens are not sampled and stop strings are not
looked for (vLLM's rule).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from compiled_llm.model.config import ModelConfig
from compiled_llm.errors import InvalidRequestError
from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.model.spec import forward, kv_cache_shape
from compiled_llm.serve.worker.sampler import SamplingTensors, make_generator, sample, suppress_tokens
from compiled_llm.serve.sampling_params import SamplingParams, stop_tokens

BLOCK_SIZE = 16


@dataclass(frozen=True)
class ReferenceOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    text: str | None = None  # detokenized output (stop string cut off) when detokenize was given
    prefill_s: float = 0.0  # time to first token
    decode_s: float = 0.0  # time for the remaining tokens


def check_request(config: ModelConfig, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> None:
    """Raise InvalidRequestError for a prompt the model can never serve."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("prompt is empty; give at least one token")
    bad = [t for t in prompt_token_ids if not 0 <= int(t) < config.vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token id {bad[0]} is outside the model's vocabulary (0..{config.vocab_size - 1})")
    limit = config.max_position_embeddings
    if n + sampling.max_tokens > limit:
        raise InvalidRequestError(
            f"prompt of {n} tokens + max_tokens {sampling.max_tokens} exceeds the model's context of {limit} tokens"
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _find_stop(text: str, stops: Sequence[str]) -> int:
    """Index where the earliest stop string starts in text, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


@torch.inference_mode()
def generate_one(
    config: ModelConfig,
    params: dict[str, Tensor],
    prompt: Sequence[int],
    sampling: SamplingParams,
    eos_token_ids: Sequence[int] = (),
    detokenize: Callable[[list[int]], str] | None = None,
    block_size: int = BLOCK_SIZE,
) -> ReferenceOutput:
    prompt = [int(t) for t in prompt]
    check_request(config, prompt, sampling)
    embed = params["embed.weight"]
    device = embed.device
    num_blocks = -(-(len(prompt) + sampling.max_tokens) // block_size)
    kv_cache = torch.zeros(kv_cache_shape(config, num_blocks, block_size), dtype=embed.dtype, device=device)
    # Reversed block order, so the oracle exercises a non-identity block table.
    table = list(range(num_blocks))[::-1]
    st = SamplingTensors.from_params([sampling], config.vocab_size, device)
    generators = [make_generator(sampling.seed, device)]
    stop_ids = set(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        stop_ids |= set(int(t) for t in eos_token_ids)
    held = stop_tokens(sampling, eos_token_ids)  # not sampled before min_tokens output tokens
    held_at = (torch.zeros(len(held), dtype=torch.int64, device=device), torch.tensor(held, dtype=torch.int64, device=device))

    out: list[int] = []
    finish, stop_text = "length", None
    step = ScheduledSeq(prompt, 0, table)
    _sync(device)
    t0 = time.perf_counter()
    t_first = t0
    while True:
        logits = forward(config, params, pack_batch([step], block_size, device), kv_cache)
        if len(out) < sampling.min_tokens and held:
            logits = suppress_tokens(logits, *held_at)
        token = int(sample(logits, st, generators)[0])  # the host sync of every step
        if not out:
            t_first = time.perf_counter()
        out.append(token)
        if token in stop_ids:
            finish = "stop"
            break
        if detokenize is not None and sampling.stop and len(out) > sampling.min_tokens:
            text = detokenize(out)
            cut = _find_stop(text, sampling.stop)
            if cut >= 0:
                finish, stop_text = "stop", text[:cut]
                break
        if len(out) >= sampling.max_tokens:
            break
        step = ScheduledSeq([token], len(prompt) + len(out) - 1, table)
    t_end = time.perf_counter()
    text = None
    if detokenize is not None:
        text = stop_text if stop_text is not None else detokenize(out)
    return ReferenceOutput(
        prompt_token_ids=prompt,
        token_ids=out,
        finish_reason=finish,
        text=text,
        prefill_s=t_first - t0,
        decode_s=t_end - t_first,
    )


def generate_reference(
    config: ModelConfig,
    params: dict[str, Tensor],
    prompts: list[list[int]],
    sampling: SamplingParams | list[SamplingParams],
    eos_token_ids: Sequence[int] = (),
    device: torch.device | str | None = None,
    detokenize: Callable[[list[int]], str] | None = None,
    block_size: int = BLOCK_SIZE,
) -> list[ReferenceOutput]:
    """Generate for each prompt on its own (no batching). ``device`` defaults to the params'
    device; params are moved there if they live elsewhere. Every request is validated before
    any runs, so a bad one fails the call without partial work."""
    if isinstance(sampling, SamplingParams):
        sampling = [sampling] * len(prompts)
    if len(sampling) != len(prompts):
        raise InvalidRequestError(f"{len(prompts)} prompts but {len(sampling)} SamplingParams")
    for p, sp in zip(prompts, sampling):
        check_request(config, p, sp)
    if device is not None:
        device = torch.device(device)
        params = {k: v.to(device) for k, v in params.items()}
    return [
        generate_one(config, params, p, sp, eos_token_ids, detokenize, block_size)
        for p, sp in zip(prompts, sampling)
    ]
