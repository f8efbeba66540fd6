"""Command-line flags generated from option dataclasses, as vLLM derives its flags from
``EngineArgs``: one flag per field (``max_num_seqs`` -> ``--max-num-seqs``), its help and default
from the field, booleans as ``--name`` / ``--no-name``. ``run``, ``bench`` and ``serve`` add
``EngineConfig``'s (``add_engine_arguments``), ``serve`` also ``ServerConfig``'s, and
``engine_options`` / ``dataclass_options`` read them back as keyword arguments."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from compiled_llm.serve.engine_config import EngineConfig

_METAVARS = {int: "N", float: "X"}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(hint) -> type:
    """int for ``int`` and ``int | None``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint


def add_dataclass_arguments(parser, cls: type, defaults: dict | None = None) -> None:
    """One flag per field of the dataclass ``cls`` (each with ``metadata["help"]``) on
    ``parser`` (a parser or an argument group). ``defaults`` overrides a field's default for
    this command (say so in its help)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = (defaults or {}).get(f.name, f.default)
        kind = _base_type(hints[f.name])
        shown = f" (default {default})" if default is not None else ""
        if kind is bool:
            parser.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=default,
                                help=f.metadata["help"])
        else:
            parser.add_argument(flag(f.name), type=kind, default=default, metavar=_METAVARS.get(kind, "TEXT"),
                                help=f.metadata["help"] + shown)


def dataclass_options(args: argparse.Namespace, cls: type) -> dict:
    """The fields of ``cls`` that the flags of ``add_dataclass_arguments`` parsed, as keyword
    arguments."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}


def add_engine_arguments(parser, defaults: dict | None = None) -> None:
    """One flag per ``EngineConfig`` field (see ``add_dataclass_arguments``)."""
    add_dataclass_arguments(parser, EngineConfig, defaults)


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options the flags of ``add_engine_arguments`` parsed, as keyword arguments."""
    return dataclass_options(args, EngineConfig)
