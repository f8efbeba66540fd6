"""Kernel providers of the ``cllm::`` ops, and the choice of one per op for a target.

A provider is one implementation of an op. The op itself is the "reference" provider, registered
here for every op; a kernel is registered with ``register_kernel``, the one helper that makes a
provider, which defines ``cllm::<op>__<provider>`` (e.g. ``cllm::paged_attention__triton``) from
the op's definition (``ops.OpDef``: its schema and its fake), so a provider never spells the
op's signature. Each provider keeps the Python function behind its op: the runtime program calls
it directly (engine/program.py), and so does the sampler (``kernel_for``).

The build's ``select_kernels`` pass rewrites each semantic op call to the chosen provider's op
and the manifest records ``{op: provider}``. The sampler's ops, which no graph names, are chosen
the same way when they run (``kernel_for``).

The kernels live in modules next to this file (``triton_*.py``, ``cuda_*.py``), which only define
them; ``providers.py`` registers them all, in one table per op. ``load_providers()`` imports every
module of this package (so ``providers.py`` among them), skipping (with a note in
``failed_provider_modules()``) any whose imports fail on this machine, e.g. a Triton module where
Triton is missing.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import operator
import pkgutil
import warnings
from pathlib import Path
from typing import Any, Callable, Collection, Mapping

import torch

from compiled_llm.errors import CompiledLLMError
from compiled_llm.graph import collective_ops as _collective_ops, fused_ops as _fused_ops, ops, quantized_ops as _quantized_ops  # noqa: F401  (they define their ops)

REFERENCE = "reference"


@dataclasses.dataclass(frozen=True)
class Provider:
    """One implementation of a semantic op.

    ``overload`` is the op FX graphs call (``cllm::<op>__<name>``; the op itself for the
    reference) and ``fn`` the Python function behind it. ``supports(device_type, dtype)`` says
    whether it can run on e.g. ("cuda", torch.bfloat16); among the providers that support a
    target the highest ``priority`` wins.
    """

    name: str
    overload: Any  # torch OpOverload
    fn: Callable
    supports: Callable[[str, torch.dtype], bool]
    priority: int = 0


_PROVIDERS: dict[str, list[Provider]] = {}
_KERNEL_OPS: dict[str, tuple[Callable, Callable | None, Provider]] = {}  # "<op>__<provider>" -> what made it
_CHOSEN: dict[tuple[str, str, torch.dtype], Callable] = {}  # kernel_for()'s cache
_FAILED_MODULES: dict[str, str] = {}
_LOADED = False


def register_provider(op_name: str, provider: Provider) -> None:
    """Add (or replace, by name) a provider of the semantic op ``op_name``."""
    if op_name not in _PROVIDERS:
        raise CompiledLLMError(f"cannot register provider {provider.name!r}: no semantic op cllm::{op_name}")
    plist = [p for p in _PROVIDERS[op_name] if p.name != provider.name]
    plist.append(provider)
    _PROVIDERS[op_name] = plist
    _CHOSEN.clear()


def unregister_provider(op_name: str, provider_name: str) -> None:
    """Remove a provider (tests; the reference provider stays)."""
    if provider_name != REFERENCE and op_name in _PROVIDERS:
        _PROVIDERS[op_name] = [p for p in _PROVIDERS[op_name] if p.name != provider_name]
        _CHOSEN.clear()


def register_kernel(
    op_name: str,
    provider: str,
    kernel: Callable,
    *,
    supports: Callable[[str, torch.dtype], bool],
    priority: int = 0,
    handles: Callable[..., bool] | None = None,
) -> Provider:
    """Make ``kernel`` the provider ``provider`` of ``cllm::<op_name>`` and register it.

    The provider op ``cllm::<op_name>__<provider>`` gets the op's schema, mutations and fake
    (``OpDef.define``). ``kernel`` takes the op's arguments positionally, in schema order
    (trailing arguments left at their defaults may be missing, so it keeps the op's defaults),
    and returns what the reference returns.

    ``handles``, when given, says whether the kernel takes a call's arguments; calls it does not
    take go to the op's reference instead (the choice of provider is per op and dtype, not per
    shape). It receives the op arguments its parameters name, e.g. ``lambda x, residual: ...``,
    which must be ones without a default.

    Registering the same kernel again (after ``unregister_provider``) only puts the registry
    entry back: a torch op cannot be defined twice.
    """
    op = ops.OPS.get(op_name)
    if op is None:
        raise CompiledLLMError(f"cannot register provider {provider!r}: no semantic op cllm::{op_name}")
    qualname = f"{op_name}__{provider}"
    made = _KERNEL_OPS.get(qualname)
    if made is not None:
        if made[:2] != (kernel, handles):
            raise CompiledLLMError(f"cllm::{qualname} is already defined with another kernel")
        entry = dataclasses.replace(made[2], supports=supports, priority=priority)
    else:
        fn = kernel if handles is None else _or_reference(qualname, op, kernel, handles)
        entry = Provider(provider, op.define(qualname, fn), fn, supports, priority)
    _KERNEL_OPS[qualname] = (kernel, handles, entry)
    register_provider(op_name, entry)
    return entry


def _or_reference(qualname: str, op: ops.OpDef, kernel: Callable, handles: Callable[..., bool]) -> Callable:
    """``kernel`` for the calls ``handles`` accepts, the op's reference for the others."""
    wanted = list(inspect.signature(handles).parameters)
    for name in wanted:
        if name not in op.params[: op.required]:
            raise CompiledLLMError(f"handles of cllm::{qualname} reads {name!r}, not an argument without a default")
    pick = operator.itemgetter(*(op.params.index(name) for name in wanted))
    reference = op.reference
    if len(wanted) == 1:
        def call(*args):
            return kernel(*args) if handles(pick(args)) else reference(*args)
    else:
        def call(*args):
            return kernel(*args) if handles(*pick(args)) else reference(*args)
    call.__name__ = call.__qualname__ = qualname  # how the runtime program's code names it
    return call


for _op in ops.OPS.values():
    _PROVIDERS[_op.name] = [Provider(REFERENCE, _op.overload, _op.reference, lambda device_type, dtype: True, 0)]
_SEMANTIC = {_op.overload: _op.name for _op in ops.OPS.values()}


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
    return _SEMANTIC.get(target)


def direct_calls() -> dict[Any, Callable]:
    """Kernel provider op -> the Python function behind it, for every registered kernel (not
    the references). The op-by-op runtime program calls these directly: the dispatcher and the
    custom-op wrapper around each call cost more host time than launching the kernels (a
    prefill step is host-bound without it)."""
    return {p.overload: p.fn for plist in _PROVIDERS.values() for p in plist if p.name != REFERENCE}


def _best(op_name: str, device_type: str, dtype: torch.dtype, allow: Collection[str] | None = None) -> Provider:
    """The highest-priority provider (among ``allow``, plus the reference) that supports the target."""
    for p in providers(op_name):
        if (allow is None or p.name in allow or p.name == REFERENCE) and _safe_supports(p, device_type, dtype):
            return p
    return get_provider(op_name, REFERENCE)


def kernel_for(op_name: str, device_type: str, dtype: torch.dtype) -> Callable:
    """The function of the provider ``choose_providers`` would pick for this target: how ops
    that no graph names (the sampler's) choose their kernel when they run. Cached per target.
    A CPU target imports no provider module (no kernel module targets the CPU: its reference
    runs there, and Triton stays unimported); any other loads them first."""
    key = (op_name, device_type, dtype)
    fn = _CHOSEN.get(key)
    if fn is None:
        if device_type != "cpu":
            load_providers()
        fn = _CHOSEN[key] = _best(op_name, device_type, dtype).fn
    return fn


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
        choice[op_name] = _best(op_name, device_type, dtype, allow).name
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
    """Import every module of this package once (providers.py registers the kernels)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name == "registry" or info.name.startswith("_") or info.name.startswith("test"):
            continue
        try:
            importlib.import_module(f"{__package__}.{info.name}")
        except ImportError as e:
            _FAILED_MODULES[info.name] = str(e)
        except Exception as e:  # a broken provider module must not take the reference path down
            _FAILED_MODULES[info.name] = f"{type(e).__name__}: {e}"
            warnings.warn(f"kernel provider module {info.name!r} failed to import: {e}")


def failed_provider_modules() -> dict[str, str]:
    return dict(_FAILED_MODULES)
