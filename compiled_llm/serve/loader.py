"""Loading what the engine runs: a built engine directory (manifest.json, via
compiled_llm.engine.artifact.load_engine) or a model source (checkpoint directory, preset, hub id; run
through the eager spec). ``LLM`` hands a source here as it is only with ``enforce_eager=True``;
otherwise it builds it through ``compiled_llm.engine.cache`` first and loads the engine."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from compiled_llm.model.config import ModelConfig
from compiled_llm.errors import CompiledLLMError


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    params: dict[str, torch.Tensor]
    program: Callable  # (params, PackedBatch, kv_cache) -> logits
    tokenizer: Any  # compiled_llm.model.tokenizer.Tokenizer | None
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    is_engine: bool = False
    manifest: dict | None = None
    load_s: float = 0.0
    load_stages: dict[str, float] = dataclasses.field(default_factory=dict)  # engines: artifact stages + tokenizer
    max_model_len: int | None = None  # an engine's build-time limit


def resolve_device(device) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CompiledLLMError("device cuda was asked for but no CUDA GPU is available to torch")
    return device


def resolve_dtype(dtype, device: torch.device) -> torch.dtype | None:
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise CompiledLLMError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    return value


def spec_program(config: ModelConfig) -> Callable:
    from compiled_llm.graph.spec import forward

    def program(params, batch, kv_cache):
        return forward(config, params, batch, kv_cache)

    return program


def is_engine_dir(model: str | Path) -> bool:
    return (Path(model).expanduser() / "manifest.json").is_file()


def load_model(model: str | Path, dtype=None, device=None) -> LoadedModel:
    t0 = time.perf_counter()
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if is_engine_dir(model):
        loaded = _load_engine(Path(model).expanduser(), dtype, device)
    else:
        loaded = _load_source(str(model), dtype, device)
    loaded.load_s = time.perf_counter() - t0
    return loaded


def _load_engine(path: Path, dtype, device: torch.device) -> LoadedModel:
    try:
        from compiled_llm.engine.artifact import load_engine
    except ImportError:
        raise CompiledLLMError(f"{path} is an engine directory but this install cannot load engines (no compiled_llm.engine.artifact)") from None
    from compiled_llm.model.tokenizer import load_tokenizer

    eng = load_engine(path, device=device)
    t0 = time.perf_counter()
    if dtype is not None and dtype != eng.dtype:
        raise CompiledLLMError(
            f"engine {path} was built for {str(eng.dtype).removeprefix('torch.')}; "
            f"rebuild it to run in {str(dtype).removeprefix('torch.')}"
        )
    tokenizer = load_tokenizer(eng.tokenizer_dir) if eng.tokenizer_dir is not None else None
    eos = list(eng.config.eos_token_ids) + list(tokenizer.eos_token_ids if tokenizer else ())
    eos = tuple(i for i in dict.fromkeys(eos) if 0 <= i < eng.config.vocab_size)
    return LoadedModel(
        name=str(path),
        config=eng.config,
        params=eng.params,
        program=eng.program,
        tokenizer=tokenizer,
        eos_token_ids=eos,
        dtype=eng.dtype,
        device=torch.device(eng.device),
        is_engine=True,
        manifest=eng.manifest,
        max_model_len=int(eng.manifest.get("build_options", {}).get("max_model_len") or eng.config.max_position_embeddings),
        load_stages={**eng.stage_seconds, "tokenizer": time.perf_counter() - t0},
    )


def _load_source(source: str, dtype, device: torch.device) -> LoadedModel:
    from compiled_llm.model.sources import load_source_params, load_source_tokenizer, resolve_source, source_eos_token_ids

    src = resolve_source(source)
    if dtype is None:  # "auto": the same rule as a build's
        from compiled_llm.engine.build import resolve_dtype as resolve_auto_dtype

        dtype = resolve_auto_dtype("auto", device, src)
    tokenizer = load_source_tokenizer(src)
    params = load_source_params(src, dtype, device)
    return LoadedModel(
        name=src.name,
        config=src.config,
        params=params,
        program=spec_program(src.config),
        tokenizer=tokenizer,
        eos_token_ids=source_eos_token_ids(src, tokenizer),
        dtype=dtype,
        device=device,
    )
