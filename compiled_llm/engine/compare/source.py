"""What compare reads off an engine's manifest: the source it was built from (the spec
reference and every rebuild load its original weights), its quantization scheme and the whole
model's config."""

from __future__ import annotations

from pathlib import Path

from compiled_llm.engine.artifact import build_config
from compiled_llm.errors import CompiledLLMError
from compiled_llm.model.config import ModelConfig
from compiled_llm.model.sources import resolve_source


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


def whole_config(engine):
    """The whole model's config (a tensor-parallel engine's ``config`` is one rank's)."""
    return ModelConfig.from_dict(engine.manifest["model_config"]) if engine.manifest else engine.config
