"""The verdict: how one side's logits are judged against the reference's, and the one line that
says so.

Tolerance: float32 needs 100% greedy agreement and max|Δlogit| <= 1e-4 * max|reference logit|;
bf16/fp16 need >= 99% agreement, and at every flip each side's pick must be in the other's top 5.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch import Tensor

from compiled_llm.engine.compare.references import reference_logits
from compiled_llm.engine.compare.steps import StepFn, run_steps

FP32_REL_TOL = 1e-4
LOW_PRECISION_AGREEMENT = 0.99
TOP_K = 5


@dataclasses.dataclass(frozen=True)
class PromptStat:
    prompt_len: int
    agree: int
    steps: int
    max_abs_delta: float


@dataclasses.dataclass(frozen=True)
class Verdict:
    ok: bool
    agreement: float
    agree: int
    steps: int
    max_abs_delta: float
    max_abs_logit: float
    flips_outside_top_k: int
    per_prompt: tuple[PromptStat, ...]
    rule: str  # the tolerance applied, in words

    @property
    def rel_delta(self) -> float:
        return self.max_abs_delta / max(self.max_abs_logit, 1e-30)


def judge(
    logits: Tensor, tokens: Tensor, ref_logits: Tensor, prompts: Sequence[Sequence[int]], dtype: torch.dtype
) -> Verdict:
    """Compare one side's logits [K, N, V] and greedy tokens [N, K] with the reference's logits."""
    ref_tokens = ref_logits.argmax(-1).T  # [N, K]
    agree_mask = ref_tokens == tokens
    delta = (logits - ref_logits).abs()
    per_prompt = tuple(
        PromptStat(len(p), int(agree_mask[i].sum()), int(tokens.shape[1]), float(delta[:, i].max()))
        for i, p in enumerate(prompts)
    )
    agree, steps = int(agree_mask.sum()), agree_mask.numel()
    top = logits.topk(TOP_K, dim=-1).indices.transpose(0, 1)  # [N, K, 5]
    ref_top = ref_logits.topk(TOP_K, dim=-1).indices.transpose(0, 1)
    in_ref_top = (ref_top == tokens.unsqueeze(-1)).any(-1)
    in_top = (top == ref_tokens.unsqueeze(-1)).any(-1)
    outside = int((~agree_mask & ~(in_ref_top & in_top)).sum())
    max_delta, max_logit = float(delta.max()), float(ref_logits.abs().max())
    agreement = agree / steps
    if dtype == torch.float32:
        ok = agree == steps and max_delta <= FP32_REL_TOL * max_logit
        rule = f"fp32: 100% agreement and max|Δlogit| <= {FP32_REL_TOL:g} x max|logit|"
    else:
        ok = agreement >= LOW_PRECISION_AGREEMENT and outside == 0
        rule = f"{str(dtype).removeprefix('torch.')}: >= {LOW_PRECISION_AGREEMENT:.0%} agreement, flips inside the other side's top {TOP_K}"
    return Verdict(ok, agreement, agree, steps, max_delta, max_logit, outside, per_prompt, rule)


def check_candidate(step: StepFn, ref_kind: str, engine, prompts, max_tokens: int,
                    quantization: str | None = None, config=None) -> Verdict:
    """The candidate against the reference (the dequantized spec when ``quantization``);
    ``config`` shapes the candidate's KV cache (default: the engine's)."""
    logits, tokens = run_steps(step, config or engine.config, prompts, max_tokens, engine.device, engine.dtype)
    ref = reference_logits("spec" if quantization else ref_kind, engine, prompts, tokens, max_tokens, quantization)
    return judge(logits, tokens, ref, prompts, engine.dtype)


def summary_line(v: Verdict, reference: str, culprit: str | None) -> str:
    head = "PASS" if v.ok else "FAIL"
    text = (
        f"{head}: vs {reference}: greedy agreement {v.agreement:.2%} ({v.agree}/{v.steps}), "
        f"max|Δlogit| {v.max_abs_delta:.3e} (relative {v.rel_delta:.2e})"
    )
    if not v.ok:
        text += f"; flips outside top-{TOP_K}: {v.flips_outside_top_k}; needs {v.rule}"
        if culprit == "megakernel":
            text += "; every pass holds: the megakernel's decode schedule changes the numbers"
        elif culprit:
            text += f"; first pass that changes the numbers: {culprit}"
    return text
