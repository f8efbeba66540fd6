"""Compiled against eager: does the engine compute what the model computes?

The engine generates greedily from random prompts (fixed seed); the reference (the spec with no
passes, or transformers on the source checkpoint) is fed the same tokens (teacher forcing), so
every step compares logits for the same context. Out of tolerance, the engine is rebuilt in
memory with growing prefixes of its pass list, and the first pass whose output fails the same
check is named. A weight-only quantized engine is held to the spec on its dequantized weights;
its distance from the unquantized model is reported as a measure, not a failure.

One idea a module, in the order a comparison uses them:

  source.py      what the engine's manifest says it was built from
  steps.py       step functions (program, spec, a rebuilt program) and running one over the prompts
  references.py  the reference's logits: the spec (dequantized for a quantized engine) or transformers
  verdict.py     the tolerance: judging logits against the reference's, and the summary line
  ranks.py       a tensor-parallel engine's other ranks, driven through the executor's run_on_ranks
  bisection.py   naming the first pass that breaks the numbers
  driver.py      compare_engine: all of the above, as ``compiled-llm compare`` runs it
"""

from compiled_llm.engine.compare.bisection import bisect_passes
from compiled_llm.engine.compare.driver import compare_engine, random_prompts
from compiled_llm.engine.compare.references import dequantized_model, hf_logits, reference_logits
from compiled_llm.engine.compare.source import quantization_of, source_of, whole_config
from compiled_llm.engine.compare.steps import BLOCK_SIZE, StepFn, program_step, rebuilt_program, run_steps, spec_step
from compiled_llm.engine.compare.verdict import (
    FP32_REL_TOL, LOW_PRECISION_AGREEMENT, TOP_K, PromptStat, Verdict, check_candidate, judge, summary_line,
)

__all__ = [
    "BLOCK_SIZE", "FP32_REL_TOL", "LOW_PRECISION_AGREEMENT", "TOP_K", "PromptStat", "StepFn", "Verdict",
    "bisect_passes", "check_candidate", "compare_engine", "dequantized_model", "hf_logits", "judge",
    "program_step", "quantization_of", "random_prompts", "rebuilt_program", "reference_logits", "run_steps",
    "source_of", "spec_step", "summary_line", "whole_config",
]
