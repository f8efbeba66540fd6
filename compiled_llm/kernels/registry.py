"""Kernel providers of the ``cllm::`` ops, and the choice of one per op for a target.

A provider is a custom op with the *identical schema* as the semantic op it implements, named
``cllm::<op>__<provider>`` (e.g. ``cllm::paged_attention__triton``). The semantic op itself is the
"reference" provider, registered here for every op. The build's ``select_kernels`` pass rewrites
each semantic op call to the chosen provider's op and records ``{op: provider}`` in the manifest.

Provider modules live next to this file (``compiled_llm/kernels/<anything>.py``) and register
themselves at import with ``register_provider``; ``load_providers()`` imports them all, skipping
(with a note in ``failed_provider_modules()``) any whose imports fail on this machine, e.g. a
Triton module where Triton is missing.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import warnings
from typing import Any, Callable, Collection, Mapping

import torch

from compiled_llm.errors import CompiledLLMError
from compiled_llm.graph import fused_ops, ops

REFERENCE = "reference"


@dataclasses.dataclass(frozen=True)
class Provider:
    """One implementation of a semantic op.

    ``supports(device_type, dtype)`` says whether it can run on e.g. ("cuda", torch.bfloat16);
    among the providers that support a target the highest ``priority`` wins.
    """

    name: str
    op: Any  # OpOverloadPacket (torch.ops.cllm.x) or OpOverload
    supports: Callable[[str, torch.dtype], bool]
    priority: int = 0

    @property
    def overload(self) -> torch._ops.OpOverload:
        """The overload FX nodes call (``.default`` of a packet)."""
        op = self.op
        return op if isinstance(op, torch._ops.OpOverload) else op.default


_PROVIDERS: dict[str, list[Provider]] = {}
_FAILED_MODULES: dict[str, str] = {}
_LOADED = False


def register_provider(op_name: str, provider: Provider) -> None:
    """Add (or replace, by name) a provider of the semantic op ``op_name``."""
    if op_name not in _PROVIDERS:
        raise CompiledLLMError(f"cannot register provider {provider.name!r}: no semantic op cllm::{op_name}")
    plist = [p for p in _PROVIDERS[op_name] if p.name != provider.name]
    plist.append(provider)
    _PROVIDERS[op_name] = plist


def unregister_provider(op_name: str, provider_name: str) -> None:
    """Remove a provider (tests; the reference provider stays)."""
    if provider_name != REFERENCE and op_name in _PROVIDERS:
        _PROVIDERS[op_name] = [p for p in _PROVIDERS[op_name] if p.name != provider_name]


def _register_semantic(op_name: str) -> None:
    op = getattr(torch.ops.cllm, op_name)
    _PROVIDERS.setdefault(op_name, [])
    register_provider(op_name, Provider(REFERENCE, op, lambda device_type, dtype: True, priority=0))


for _name in (*ops.SEMANTIC_OPS, *fused_ops.FUSED_OPS):
    _register_semantic(_name)


def op_names() -> list[str]:
    return list(_PROVIDERS)


def providers(op_name: str) -> list[Provider]:
    if op_name not in _PROVIDERS:
        raise CompiledLLMError(f"unknown op {op_name!r}; known: {', '.join(_PROVIDERS)}")
    return sorted(_PROVIDERS[op_name], key=lambda p: -p.priority)


def get_provider(op_name: str, provider_name: str) -> Provider:
    for p in providers(op_name):
        if p.name == provider_name:
            return p
    known = ", ".join(p.name for p in providers(op_name))
    raise CompiledLLMError(
        f"no provider {provider_name!r} for cllm::{op_name} on this machine (available: {known})"
    )


def semantic_op_name(target: Any) -> str | None:
    """The semantic op name of an FX call target if it is a semantic ``cllm::`` op (not a
    provider variant), else None."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    ns, _, rest = target.name().partition("::")
    name = rest.split(".")[0]
    if ns == "cllm" and name in _PROVIDERS:
        return name
    return None


def choose_providers(
    device_type: str,
    dtype: torch.dtype,
    prefer: Mapping[str, str] | None = None,
    allow: Collection[str] | None = None,
) -> dict[str, str]:
    """{op name: provider name} for a target device type and dtype.

    ``prefer`` forces a provider for some ops (it must exist and support the target);
    ``allow`` restricts the candidates by provider name ("reference" is always allowed).
    """
    prefer = dict(prefer or {})
    for op_name in prefer:
        if op_name not in _PROVIDERS:
            raise CompiledLLMError(f"--kernel names unknown op {op_name!r}; known: {', '.join(_PROVIDERS)}")
    choice: dict[str, str] = {}
    for op_name in _PROVIDERS:
        if op_name in prefer:
            p = get_provider(op_name, prefer[op_name])
            if not p.supports(device_type, dtype):
                raise CompiledLLMError(
                    f"provider {p.name!r} of cllm::{op_name} does not support {device_type}/{_dtype_name(dtype)}"
                )
            choice[op_name] = p.name
            continue
        candidates = [
            p for p in providers(op_name)
            if (allow is None or p.name in allow or p.name == REFERENCE) and _safe_supports(p, device_type, dtype)
        ]
        choice[op_name] = candidates[0].name if candidates else REFERENCE
    return choice


def _safe_supports(p: Provider, device_type: str, dtype: torch.dtype) -> bool:
    try:
        return bool(p.supports(device_type, dtype))
    except Exception as e:  # a provider's probe must never break a build
        warnings.warn(f"provider {p.name!r} support check failed: {e}")
        return False


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def load_providers() -> None:
    """Import every provider module of this package once (they register themselves)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    import compiled_llm.kernels as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name == "registry" or info.name.startswith("_") or info.name.startswith("test"):
            continue
        try:
            importlib.import_module(f"{pkg.__name__}.{info.name}")
        except ImportError as e:
            _FAILED_MODULES[info.name] = str(e)
        except Exception as e:  # a broken provider module must not take the reference path down
            _FAILED_MODULES[info.name] = f"{type(e).__name__}: {e}"
            warnings.warn(f"kernel provider module {info.name!r} failed to import: {e}")


def failed_provider_modules() -> dict[str, str]:
    return dict(_FAILED_MODULES)
