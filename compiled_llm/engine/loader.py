"""Loading what the runtime runs: a built engine directory (``artifact.load_engine``) or, only
with ``enforce_eager=True``, a model source (checkpoint directory, preset, hub id) run through the
eager spec. ``LLM`` builds any other source through the engine cache first and loads that
engine."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from compiled_llm.engine.artifact import MANIFEST, load_engine
from compiled_llm.engine.loaded_model import LoadedModel
from compiled_llm.errors import CompiledLLMError
from compiled_llm.model.spec import SpecProgram
from compiled_llm.model.config import ModelConfig
from compiled_llm.model.placement import dtype_name, parse_dtype, resolve_device, resolve_dtype
from compiled_llm.model.sources import (
    load_source_params,
    load_source_tokenizer,
    resolve_source,
    source_eos_token_ids,
    source_generation_defaults,
)


def is_engine_dir(model: str | Path) -> bool:
    return (Path(model).expanduser() / MANIFEST).is_file()


def spec_program(config: ModelConfig) -> Callable:
    return SpecProgram(config)


def load_model(model: str | Path, dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = None) -> LoadedModel:
    """``dtype``/``device`` None or "auto" resolve as a build does (``model.placement``); an
    engine runs in the dtype it was built for, and refuses another."""
    t0 = time.perf_counter()
    device = resolve_device(device)
    if is_engine_dir(model):
        loaded = load_engine(Path(model).expanduser(), device=device)
        if dtype not in (None, "auto") and parse_dtype(dtype) != loaded.dtype:
            raise CompiledLLMError(
                f"engine {model} was built for {dtype_name(loaded.dtype)}; "
                f"rebuild it to run in {dtype_name(parse_dtype(dtype))}"
            )
    else:
        loaded = _load_source(str(model), dtype, device)
    loaded.load_s = time.perf_counter() - t0
    return loaded


def _load_source(source: str, dtype, device: torch.device) -> LoadedModel:
    src = resolve_source(source)
    dtype = resolve_dtype(dtype, device, src)
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
        source_dir=src.model_dir,
        generation_defaults=source_generation_defaults(src),
    )
