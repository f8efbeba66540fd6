"""Command-line flags generated from ``EngineConfig``, as vLLM derives its flags from
``EngineArgs``: one flag per field (``max_num_seqs`` -> ``--max-num-seqs``), its help and default
from the field, booleans as ``--name`` / ``--no-name``. ``run`` and ``bench`` add them, and
``engine_options`` reads them back as ``LLM``'s keyword arguments."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from compiled_llm.serve.engine_config import EngineConfig


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(hint) -> type:
    """int for ``int`` and ``int | None``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint


def add_engine_arguments(parser, defaults: dict | None = None) -> None:
    """One flag per ``EngineConfig`` field on ``parser`` (a parser or an argument group).
    ``defaults`` overrides a field's default for this command (say so in its help)."""
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        default = (defaults or {}).get(f.name, f.default)
        kind = _base_type(hints[f.name])
        shown = f" (default {default})" if default is not None else ""
        if kind is bool:
            parser.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=default,
                                help=f.metadata["help"])
        else:
            parser.add_argument(flag(f.name), type=kind, default=default, metavar="N" if kind is int else "X",
                                help=f.metadata["help"] + shown)


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options the flags of ``add_engine_arguments`` parsed, as keyword arguments."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
