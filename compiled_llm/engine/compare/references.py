"""The references, fed the candidate's tokens (teacher forcing) so that every step compares
logits for the same context:

  spec       the spec with no passes, on the source's original weights (or, for a weight-only
             quantized engine, on the weights its program reads: quantized, then dequantized)
  hf         transformers' model from the source checkpoint directory
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from compiled_llm.engine.compare.source import source_of, whole_config
from compiled_llm.engine.compare.steps import run_steps, spec_step
from compiled_llm.errors import CompiledLLMError
from compiled_llm.graph.quantized_ops import dequantize, quantize
from compiled_llm.model.sources import load_source_params


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
