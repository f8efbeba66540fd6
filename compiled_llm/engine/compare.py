"""Compiled against eager: does the engine compute what the model computes?

The engine generates greedily from random prompts (fixed seed); the reference is fed the same
tokens (teacher forcing), so every step compares logits for the same context:

  spec       the spec with no passes, on the source's original weights
  hf         transformers' model from the source checkpoint directory

Tolerance: float32 needs 100% greedy agreement and max|Δlogit| <= 1e-4 * max|reference logit|;
bf16/fp16 need >= 99% agreement, and at every flip each side's pick must be in the other's top 5.
When the engine fails, ``bisect_passes`` rebuilds it in memory with growing prefixes of its pass
list and names the first pass whose output fails the same check.

A weight-only quantized engine (``build --quantization``) is checked against the spec on the
dequantized weights, what its program must compute apart from float rounding; its distance from
the unquantized model (the quantization error) is reported too, as a measure, not a failure.
Bisection compares the prefixes up to ``quantize_weights`` with the unquantized spec and the
later ones with the dequantized one.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from compiled_llm.engine.artifact import build_config, load_engine, tp_size_of
from compiled_llm.engine.build import lower
from compiled_llm.engine.loaded_model import LoadedModel
from compiled_llm.engine.program import PortableProgram
from compiled_llm.errors import CompiledLLMError
from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.graph.quantized_ops import dequantize, quantize
from compiled_llm.graph.spec import forward, kv_cache_shape
from compiled_llm.model.config import ModelConfig
from compiled_llm.model.sharding import local_config
from compiled_llm.model.sources import load_source_params, resolve_source

BLOCK_SIZE = 16
FP32_REL_TOL = 1e-4
LOW_PRECISION_AGREEMENT = 0.99
TOP_K = 5

StepFn = Callable[[object, Tensor], Tensor]  # (PackedBatch, kv_cache) -> logits[S, V]


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


def random_prompts(vocab_size: int, num_prompts: int, seed: int = 0, min_len: int = 4, max_len: int = 24) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (num_prompts,), generator=gen).tolist()
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lens]


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


def hf_logits(model_dir, prompts, tokens: Tensor, dtype: torch.dtype, device) -> Tensor:
    """transformers' logits [K, N, V] for each prompt followed by the given tokens."""
    from transformers import AutoModelForCausalLM  # the HF peer: seconds to import, only for --reference hf

    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    except Exception as e:
        raise CompiledLLMError(f"transformers cannot load {model_dir}: {type(e).__name__}") from None
    K = tokens.shape[1]
    out = []
    with torch.no_grad():
        for p, toks in zip(prompts, tokens.tolist()):
            ids = torch.tensor([list(p) + toks[:-1]], device=device)
            logits = model(ids).logits[0].float()
            out.append(logits[len(p) - 1 : len(p) - 1 + K].cpu())
    return torch.stack(out, dim=1)


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


# ---------------------------------------------------------------------------------------------
# References and candidates
# ---------------------------------------------------------------------------------------------


def program_step(program, params) -> StepFn:
    return lambda batch, kv: program(params, batch, kv)


def spec_step(config, params) -> StepFn:
    return lambda batch, kv: forward(config, params, batch, kv)


def source_of(manifest: dict):
    """The ModelSource an engine was built from (for the spec reference and bisection)."""

    src = manifest.get("source") or {}
    if src.get("preset"):
        return resolve_source(src["preset"])
    model_dir = src.get("model_dir")
    if model_dir:
        if not Path(model_dir).is_dir():
            raise CompiledLLMError(f"the engine's source checkpoint {model_dir} is not at hand; compare needs it")
        return resolve_source(model_dir)
    raise CompiledLLMError("the engine's manifest names no source; compare needs the source checkpoint")


def quantization_of(manifest: dict) -> str | None:
    return build_config(manifest).quantization


def dequantized_model(config, params: dict[str, Tensor], scheme: str):
    """(config, params) of the spec on the weights the quantized program reads: every linear
    weight (the lm_head included) through quantize -> dequantize. A tied lm_head becomes an
    untied one, since the embedding lookup still reads the original table."""
    out = dict(params)
    for name, w in params.items():
        if w.dim() == 2 and (name.startswith("layers.") or name == "lm_head.weight"):
            out[name] = dequantize(*quantize(w, scheme), w.dtype)
    if config.tie_word_embeddings:
        config = dataclasses.replace(config, tie_word_embeddings=False)
        w = params["embed.weight"]
        out["lm_head.weight"] = dequantize(*quantize(w, scheme), w.dtype)
    return config, out


def whole_config(engine):
    """The whole model's config (a tensor-parallel engine's ``config`` is one rank's)."""
    return ModelConfig.from_dict(engine.manifest["model_config"]) if engine.manifest else engine.config


def sharded_step(engine, executor) -> StepFn:
    """A tensor-parallel engine's program over all its ranks: every other rank runs the same
    batch on its weights and a KV cache of its own shaped like this one's."""
    state = {"kv": None}

    def step(batch, kv):
        fresh, state["kv"] = state["kv"] is not kv, kv
        # numpy, not tensors: multiprocessing would share a tensor's memory through a handle
        # only processes it started may open
        executor.send("compare_step", tuple(t.cpu().numpy() for t in batch), tuple(kv.shape), fresh)
        return engine.program(engine.params, batch, kv)

    return step


def reference_logits(kind: str, engine, prompts, tokens: Tensor, max_tokens: int,
                     quantization: str | None = None) -> Tensor:
    """The reference's logits on ``tokens``; with ``quantization``, the spec on the weights
    dequantized from that scheme (``kind`` must then be spec)."""
    if kind == "hf":
        if engine.source_dir is None:
            raise CompiledLLMError("--reference hf needs the source checkpoint directory, which this engine was not built from or which is gone")
        return hf_logits(engine.source_dir, prompts, tokens, engine.dtype, engine.device)
    if kind == "spec":
        config, params = whole_config(engine), load_source_params(source_of(engine.manifest), engine.dtype, engine.device)
        if quantization is not None:
            config, params = dequantized_model(config, params, quantization)
        step = spec_step(config, params)
    else:
        raise CompiledLLMError(f"unknown reference {kind!r}; choose spec or hf")
    logits, _ = run_steps(step, config, prompts, max_tokens, engine.device, engine.dtype, forced=tokens)
    return logits


def check_candidate(step: StepFn, ref_kind: str, engine, prompts, max_tokens: int,
                    quantization: str | None = None, config=None) -> Verdict:
    """The candidate against the reference (the dequantized spec when ``quantization``);
    ``config`` shapes the candidate's KV cache (default: the engine's)."""
    logits, tokens = run_steps(step, config or engine.config, prompts, max_tokens, engine.device, engine.dtype)
    ref = reference_logits("spec" if quantization else ref_kind, engine, prompts, tokens, max_tokens, quantization)
    return judge(logits, tokens, ref, prompts, engine.dtype)


def rebuilt_program(manifest: dict, pass_names: Sequence[str], dtype, device, rank: int = 0):
    """(program, params) of the engine's source rebuilt in memory with ``pass_names``, as rank
    ``rank`` of a tensor-parallel engine computes it."""
    src = source_of(manifest)
    params = load_source_params(src, dtype, device)
    lowered = lower(src.config, params, pass_names, device.type, dtype, build_config(manifest).kernel_prefs,
                    quantization=quantization_of(manifest), tp_rank=rank, tp_size=tp_size_of(manifest))
    return PortableProgram(lowered.gm, lowered.param_names), lowered.params


def bisect_passes(engine, ref_kind: str, prompts, max_tokens: int, on_step=None, executor=None) -> str:
    """Rebuild the engine in memory with passes[:k], k = 0, 1, ...; name the first stage whose
    program fails the check ("capture" when even no passes fail, "artifact" when every
    in-memory rebuild passes and only the saved engine fails). A tensor-parallel engine's
    ranks (``executor``) rebuild their own programs alongside."""

    manifest = engine.manifest
    names = [p["name"] for p in manifest["passes"]]
    scheme = quantization_of(manifest)
    size = tp_size_of(manifest)
    for k in range(len(names) + 1):
        program, params = rebuilt_program(manifest, names[:k], engine.dtype, engine.device)
        step = program_step(program, params)
        config = whole_config(engine)
        if executor is not None:
            executor.send("use_rebuilt_program", names[:k])
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
    return "artifact"


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


def summary_line(v: Verdict, reference: str, culprit: str | None) -> str:
    head = "PASS" if v.ok else "FAIL"
    text = (
        f"{head}: vs {reference}: greedy agreement {v.agreement:.2%} ({v.agree}/{v.steps}), "
        f"max|Δlogit| {v.max_abs_delta:.3e} (relative {v.rel_delta:.2e})"
    )
    if not v.ok:
        text += f"; flips outside top-{TOP_K}: {v.flips_outside_top_k}; needs {v.rule}"
        if culprit:
            text += f"; first pass that changes the numbers: {culprit}"
    return text
