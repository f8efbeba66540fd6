"""Naming the pass that breaks the numbers: rebuild the engine in memory with growing prefixes
of its pass list and check each the way the engine was checked.

A weight-only quantized engine's prefixes up to ``quantize_weights`` are held to the
unquantized spec, the later ones to the spec on the dequantized weights.
"""

from __future__ import annotations

import dataclasses

from compiled_llm.engine.artifact import tp_size_of
from compiled_llm.engine.compare.ranks import rebuild_on_ranks, sharded_step
from compiled_llm.engine.compare.source import quantization_of, whole_config
from compiled_llm.engine.compare.steps import program_step, rebuilt_megakernel, rebuilt_program
from compiled_llm.engine.compare.verdict import check_candidate
from compiled_llm.model.sharding import local_config


def bisect_passes(engine, ref_kind: str, prompts, max_tokens: int, on_step=None, executor=None) -> str:
    """Rebuild the engine in memory with passes[:k], k = 0, 1, ...; name the first stage whose
    program fails the check ("capture" when even no passes fail, "megakernel" when every pass
    holds and a megakernel engine's decode schedule, made anew, fails, "artifact" when every
    in-memory rebuild passes and only the saved engine fails). A tensor-parallel engine's
    ranks (``executor``) rebuild their own programs alongside."""

    manifest = engine.manifest
    names = [p["name"] for p in manifest["passes"]]
    scheme = quantization_of(manifest)
    size = tp_size_of(manifest)
    for k in range(len(names) + 1):
        if executor is not None:
            rebuild_on_ranks(executor, names[:k])
        program, params = rebuilt_program(manifest, names[:k], engine.dtype, engine.device)
        step = program_step(program, params)
        config = whole_config(engine)
        if executor is not None:
            step = sharded_step(dataclasses.replace(engine, program=program, params=params), executor)
            if "shard" in names[:k]:
                config = local_config(config, size)
        quantized = scheme if "quantize_weights" in names[:k] else None
        verdict = check_candidate(step, ref_kind, engine, prompts, max_tokens, quantized, config)
        stage = names[k - 1] if k else "capture"
        if on_step is not None:
            on_step(stage, verdict)
        if not verdict.ok:
            return stage
    if manifest.get("megakernel"):
        program, params = rebuilt_megakernel(manifest, engine.dtype, engine.device)
        verdict = check_candidate(program_step(program, params), ref_kind, engine, prompts, max_tokens, scheme,
                                  whole_config(engine))
        if on_step is not None:
            on_step("megakernel", verdict)
        if not verdict.ok:
            return "megakernel"
    return "artifact"
