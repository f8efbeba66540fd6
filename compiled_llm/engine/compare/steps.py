"""Step functions, the one shape every side of a comparison takes: ``step(batch, kv_cache) ->
logits[S, V]``, run over the same prompts by ``run_steps``. The candidates are the engine's
program or one rebuilt in memory with a prefix of its pass list; the reference is the spec.
(A tensor-parallel program over all its ranks is ``ranks.sharded_step``.)"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor

from compiled_llm.engine.artifact import build_config, tp_size_of
from compiled_llm.engine.build import decode_schedule, lower
from compiled_llm.engine.compare.source import quantization_of, source_of
from compiled_llm.engine.program import PortableProgram
from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.megakernel.program import MegakernelProgram
from compiled_llm.model.spec import forward, kv_cache_shape
from compiled_llm.model.sources import load_source_params

BLOCK_SIZE = 16

StepFn = Callable[[object, Tensor], Tensor]  # (PackedBatch, kv_cache) -> logits[S, V]


def program_step(program, params) -> StepFn:
    return lambda batch, kv: program(params, batch, kv)


def spec_step(config, params) -> StepFn:
    return lambda batch, kv: forward(config, params, batch, kv)


def rebuilt_program(manifest: dict, pass_names: Sequence[str], dtype, device, rank: int = 0):
    """(program, params) of the engine's source rebuilt in memory with ``pass_names``, as rank
    ``rank`` of a tensor-parallel engine computes it."""
    src = source_of(manifest)
    params = load_source_params(src, dtype, device)
    lowered = lower(src.config, params, pass_names, device.type, dtype, build_config(manifest).kernel_prefs,
                    quantization=quantization_of(manifest), tp_rank=rank, tp_size=tp_size_of(manifest))
    return PortableProgram(lowered.gm, lowered.param_names), lowered.params


def rebuilt_megakernel(manifest: dict, dtype, device):
    """(program, params) of the engine's source rebuilt in memory with all its passes and its
    decode steps run by a schedule made anew for as many SMs as the engine's."""
    src = source_of(manifest)
    params = load_source_params(src, dtype, device)
    names = [p["name"] for p in manifest["passes"]]
    lowered = lower(src.config, params, names, device.type, dtype, build_config(manifest).kernel_prefs,
                    quantization=quantization_of(manifest))
    program = PortableProgram(lowered.gm, lowered.param_names)
    made = decode_schedule(lowered, src.config.num_layers, manifest["megakernel"]["num_sms"])
    return MegakernelProgram(program, made), lowered.params


def _tables(prompts: Sequence[Sequence[int]], max_tokens: int) -> tuple[list[list[int]], int]:
    tables, next_block = [], 0
    for p in prompts:
        n = math.ceil((len(p) + max_tokens) / BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    return tables, next_block


def run_steps(
    step: StepFn,
    config,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    device,
    dtype: torch.dtype,
    forced: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Prefill all prompts in one packed batch, then decode ``max_tokens - 1`` steps.

    Returns (logits [K, N, V] float32, tokens [N, K]): greedy picks of this side, or ``forced``
    (the other side's tokens) fed instead when given."""

    tables, num_blocks = _tables(prompts, max_tokens)
    kv = torch.zeros(kv_cache_shape(config, num_blocks, BLOCK_SIZE), dtype=dtype, device=device)
    seqs = [ScheduledSeq(list(p), 0, t) for p, t in zip(prompts, tables)]
    lens = [len(p) for p in prompts]
    all_logits, all_tokens = [], []
    for k in range(max_tokens):
        with torch.no_grad():
            logits = step(pack_batch(seqs, BLOCK_SIZE, device), kv).float()
        tokens = forced[:, k].to(logits.device) if forced is not None else logits.argmax(-1)
        all_logits.append(logits.cpu())
        all_tokens.append(tokens.cpu())
        seqs = [ScheduledSeq([int(t)], n + k, tb) for t, n, tb in zip(tokens.tolist(), lens, tables)]
    return torch.stack(all_logits), torch.stack(all_tokens, dim=1)
