"""Build passes: one file each, run in order by ``manager.PassManager``.

``DEFAULT_PASSES`` is the pipeline; ``register_pass`` adds a pass by name (tests use it to
plant a wrong rewrite and check that ``compare`` names it). The manifest records pass names, and
``compare`` rebuilds prefixes of that list with ``get_pass``.
"""

from __future__ import annotations

from compiled_llm.errors import CompiledLLMError
from compiled_llm.passes import (
    cleanup, cleanup_noop, fuse_add_norm, fuse_moe, fuse_norm_mlp, fuse_qkv_rope, fuse_residual, quantize_weights,
    select_kernels, shard,
)
from compiled_llm.passes.base import Pass, PassContext

DEFAULT_PASSES: tuple[Pass, ...] = (
    cleanup_noop.PASS,
    fuse_moe.PASS,
    shard.PASS,
    fuse_norm_mlp.PASS,
    fuse_residual.PASS,
    fuse_add_norm.PASS,
    fuse_qkv_rope.PASS,
    quantize_weights.PASS,
    select_kernels.PASS,
    cleanup.PASS,
)
_REGISTRY: dict[str, Pass] = {p.name: p for p in DEFAULT_PASSES}


def register_pass(p: Pass) -> None:
    _REGISTRY[p.name] = p


def unregister_pass(name: str) -> None:
    if name not in {p.name for p in DEFAULT_PASSES}:
        _REGISTRY.pop(name, None)


def get_pass(name: str) -> Pass:
    if name not in _REGISTRY:
        raise CompiledLLMError(f"unknown pass {name!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def default_pass_names() -> list[str]:
    return [p.name for p in DEFAULT_PASSES]


def pipeline(names: list[str] | None = None, disabled: tuple[str, ...] | list[str] = ()) -> list[Pass]:
    """The passes to run: ``names`` (default: the standard pipeline) minus ``disabled``."""
    names = list(names) if names is not None else default_pass_names()
    for d in disabled:
        get_pass(d)  # unknown names are an error, not silently ignored
    return [get_pass(n) for n in names if n not in disabled]


__all__ = ["Pass", "PassContext", "DEFAULT_PASSES", "register_pass", "get_pass", "pipeline", "default_pass_names"]
