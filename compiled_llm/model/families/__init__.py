"""The model families compiled_llm reads, one module each, and the registry that finds a
checkpoint's family by its config.json (``architectures``, else ``model_type``).

A new family is one module here (a ``FAMILY``: see ``base.Family``) and one line in
``FAMILIES``; as long as it runs on the spec's existing ModelConfig switches, nothing else
changes (Gemma 2 brought the switches for sandwich norms, soft-capping, GeGLU and scaled
embeddings; Mistral the sliding window).
"""

from __future__ import annotations

from typing import Any

from compiled_llm.errors import UnsupportedArchitectureError
from compiled_llm.model.families import gemma2, gemma3, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen3, qwen3_moe
from compiled_llm.model.families.base import Family

# In the order the unsupported-architecture error lists them.
FAMILIES: tuple[Family, ...] = (
    gpt2.FAMILY,
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    mistral.FAMILY,
    phi3.FAMILY,
    gemma2.FAMILY,
    gemma3.FAMILY,
    gemma3.MULTIMODAL_FAMILY,
    qwen3_moe.FAMILY,
    mixtral.FAMILY,
)

_BY_ARCHITECTURE: dict[str, Family] = {a: f for f in FAMILIES for a in f.architectures}
_BY_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILIES for t in f.model_types}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_BY_ARCHITECTURE)


def architecture_of(hf: dict[str, Any]) -> str:
    """The architecture a config.json names (its first ``architectures`` entry, else the one
    its ``model_type`` stands for), or a one-line UnsupportedArchitectureError naming the
    supported ones."""
    archs = hf.get("architectures") or []
    if archs:
        arch = archs[0]
    else:
        model_type = hf.get("model_type")
        family = _BY_MODEL_TYPE.get(model_type or "")
        arch = family.architectures[0] if family is not None else str(model_type)
    family_of(arch)
    return arch


def family_of(architecture: str) -> Family:
    """The family of ``architecture`` (ModelConfig.architecture), or the one-line error."""
    # a config.json may hold anything where the name should be: only a string can name one
    family = _BY_ARCHITECTURE.get(architecture) if isinstance(architecture, str) else None
    if family is None:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return family
