"""``compare_engine``: load the engine, start its other ranks, check it on random prompts,
print what was found and, out of tolerance, bisect its passes."""

from __future__ import annotations

from typing import Any, Callable

import torch

from compiled_llm.engine.artifact import load_engine
from compiled_llm.engine.compare.bisection import bisect_passes
from compiled_llm.engine.compare.ranks import sharded_step
from compiled_llm.engine.compare.source import quantization_of
from compiled_llm.engine.compare.steps import program_step
from compiled_llm.engine.compare.verdict import Verdict, check_candidate, summary_line
from compiled_llm.engine.loaded_model import LoadedModel
from compiled_llm.errors import CompiledLLMError


def random_prompts(vocab_size: int, num_prompts: int, seed: int = 0, min_len: int = 4, max_len: int = 24) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (num_prompts,), generator=gen).tolist()
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lens]


def compare_engine(
    engine_dir,
    num_prompts: int = 8,
    max_tokens: int = 32,
    reference: str = "spec",
    seed: int = 0,
    bisect: bool = True,
    out: Callable[[str], None] = print,
    start_ranks: Callable[[LoadedModel], Any] | None = None,
) -> tuple[Verdict, str | None]:
    """Run the comparison, printing per-prompt lines; returns (verdict, culprit or None).

    A tensor-parallel engine's other ranks are started by ``start_ranks(engine)``: the runtime's
    executor (``serve/executor``), handed in by the caller, since the engine stage does not import
    the runtime above it (``compiled-llm compare`` passes ``MultiprocExecutor``)."""

    if num_prompts < 1 or max_tokens < 1:
        raise CompiledLLMError("--num-prompts and --max-tokens must be at least 1")
    engine = load_engine(engine_dir)
    executor = None
    if engine.pp_size > 1:  # its bisection rebuilds one program; a pipelined engine runs one per stage
        raise CompiledLLMError(f"{engine_dir} is a pipelined engine ({engine.pp_size} stages), which compare does not "
                               "check yet; compare the same build without --pipeline-parallel-size")
    if engine.tp_size > 1:
        if start_ranks is None:
            raise CompiledLLMError(f"{engine_dir} is a tensor-parallel engine ({engine.tp_size} ranks): "
                                   "compare_engine needs start_ranks to start its other ranks")
        executor = start_ranks(engine)
    try:
        return _compare(engine, executor, num_prompts, max_tokens, reference, seed, bisect, out)
    except Exception:
        if executor is not None:
            executor.check(wait_s=3.0)  # a rank failed: say which, not how the collective broke
        raise
    finally:
        if executor is not None:
            executor.shutdown()


def _compare(engine, executor, num_prompts, max_tokens, reference, seed, bisect, out):
    prompts = random_prompts(engine.config.vocab_size, num_prompts, seed)
    scheme = quantization_of(engine.manifest)
    step = program_step(engine.program, engine.params) if executor is None else sharded_step(engine, executor)
    verdict = check_candidate(step, reference, engine, prompts, max_tokens, scheme)
    against = f"spec on its {scheme}-dequantized weights" if scheme else reference
    ranks = f", {engine.tp_size} tensor-parallel ranks" if engine.tp_size > 1 else ""
    out(f"engine {engine.engine_dir} ({engine.device.type}, {str(engine.dtype).removeprefix('torch.')}{ranks}) vs {against}")
    for i, s in enumerate(verdict.per_prompt):
        out(f"  prompt {i}: {s.prompt_len:3d} tokens  greedy agreement {s.agree}/{s.steps}  max|Δlogit| {s.max_abs_delta:.3e}")
    if scheme:
        q = check_candidate(step, reference, engine, prompts, max_tokens)
        out(f"{scheme} quantization error vs the unquantized model ({reference}), a measure, not a failure: greedy "
            f"agreement {q.agreement:.2%} ({q.agree}/{q.steps}), max|Δlogit| {q.max_abs_delta:.3e} (relative {q.rel_delta:.2e})")
    culprit = None
    if not verdict.ok and bisect:
        out("out of tolerance; rebuilding with growing prefixes of the pass list:")
        culprit = bisect_passes(
            engine, reference, prompts, max_tokens,
            on_step=lambda stage, v: out(f"  after {stage:<18} agreement {v.agreement:7.2%}  max|Δlogit| {v.max_abs_delta:.3e}  {'ok' if v.ok else 'FAIL'}"),
            executor=executor,
        )
    out(summary_line(verdict, against, culprit))
    return verdict, culprit
