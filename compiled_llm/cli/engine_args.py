"""Command-line flags generated from option dataclasses, as vLLM derives its flags from
``EngineArgs``: one flag per field (``max_num_seqs`` -> ``--max-num-seqs``), its help and default
from the field, booleans as ``--name`` / ``--no-name``, lists and maps as repeatable flags. A
field's ``metadata`` may respell its flag (``flag``: ``disabled_passes`` -> ``--disable-pass``),
add short ``aliases`` (``-q``) and give ``choices`` and a ``metavar``.

``run``, ``bench`` and ``serve`` add ``EngineConfig``'s (``add_engine_arguments``), ``serve`` also
``ServerConfig``'s; ``build`` adds ``BuildConfig``'s (``add_build_arguments``), and so do ``run``,
``serve`` and ``bench``, which build a SOURCE into the engine cache. ``engine_options`` /
``build_options`` / ``dataclass_options`` read them back as keyword arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from compiled_llm.engine.build_config import BuildConfig, option_flags, option_text
from compiled_llm.serve.engine_config import EngineConfig

_METAVARS = {int: "N", float: "X"}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def field_flag(f: dataclasses.Field) -> str:
    """The long flag of a field: its name, or the ``flag`` its metadata gives."""
    return flag(f.metadata.get("flag", f.name))


def field_default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _base_type(hint) -> type:
    """int for ``int`` and ``int | None``; the container for ``tuple[str, ...]`` and
    ``dict[str, str]``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return typing.get_origin(hint) or hint


def add_dataclass_arguments(parser, cls: type, defaults: dict | None = None, *, exclude=(),
                            unset: bool = False) -> None:
    """One flag per field of the dataclass ``cls`` (each with ``metadata["help"]``) on
    ``parser`` (a parser or an argument group), but those named in ``exclude``. ``defaults``
    overrides a field's default for this command (say so in its help). ``unset``: a flag not
    given parses as None (the help still shows the field's default), for commands that tell
    an option given from one left alone (``build_options``)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        meta = f.metadata
        default = (defaults or {}).get(f.name, field_default(f))
        kind = _base_type(hints[f.name])
        names = [field_flag(f), *meta.get("aliases", ())]
        unstated = default is None or kind is bool or (kind in (tuple, list, dict) and not default)
        shown = "" if unstated else f" (default {option_text(default)})"
        common = dict(dest=f.name, default=None if unset else default, help=meta["help"] + shown)
        if kind is bool:
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, **common)
        elif kind in (tuple, list, dict):  # repeatable: each flag adds one item
            if not unset:
                common["default"] = None  # an empty list, made when read back (argparse appends to its default)
            parser.add_argument(*names, action="append", metavar=meta.get("metavar", "TEXT"), **common)
        else:
            choices = meta.get("choices")
            metavar = meta.get("metavar", None if choices else _METAVARS.get(kind, "TEXT"))
            parser.add_argument(*names, type=kind, choices=choices, metavar=metavar, **common)


def dataclass_options(args: argparse.Namespace, cls: type) -> dict:
    """The fields of ``cls`` that the flags of ``add_dataclass_arguments`` parsed, as keyword
    arguments (a repeatable flag never given: its field's default)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name)
        repeatable = _base_type(hints[f.name]) in (tuple, list, dict)
        out[f.name] = field_default(f) if value is None and repeatable else value
    return out


def add_engine_arguments(parser, defaults: dict | None = None) -> None:
    """One flag per ``EngineConfig`` field (see ``add_dataclass_arguments``)."""
    add_dataclass_arguments(parser, EngineConfig, defaults)


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options the flags of ``add_engine_arguments`` parsed, as keyword arguments."""
    return dataclass_options(args, EngineConfig)


# What run, serve and bench share between the two: --max-model-len is the runtime's limit there
# (a SOURCE is built for the model's maximum, so one cached engine serves every limit).
SHARED_WITH_ENGINE = tuple(f.name for f in dataclasses.fields(BuildConfig)
                           if f.name in {g.name for g in dataclasses.fields(EngineConfig)})


def add_build_arguments(parser, *, for_source: bool = False) -> None:
    """One flag per ``BuildConfig`` field (see ``add_dataclass_arguments``). ``for_source``: the
    flags of a command that takes an engine directory or builds a SOURCE into the engine cache
    (``run``, ``serve``, ``bench``): a flag not given is left to the engine directory (or is
    its field's default for a SOURCE), and ``--max-model-len`` is left to ``EngineConfig``."""
    if for_source:
        add_dataclass_arguments(parser, BuildConfig, exclude=SHARED_WITH_ENGINE, unset=True)
    else:
        add_dataclass_arguments(parser, BuildConfig)


def build_options(args: argparse.Namespace, *, for_source: bool = False) -> dict:
    """The build options the flags of ``add_build_arguments`` parsed, as keyword arguments:
    every one (``build``), or with ``for_source`` only those given."""
    if not for_source:
        return dataclass_options(args, BuildConfig)
    names = [f.name for f in dataclasses.fields(BuildConfig) if f.name not in SHARED_WITH_ENGINE]
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def build_config(args: argparse.Namespace, *, for_source: bool = False) -> BuildConfig:
    """The ``BuildConfig`` of the flags: ``BuildConfig.from_options(build_options(args))``."""
    return BuildConfig.from_options(build_options(args, for_source=for_source))


def build_flags(config: BuildConfig) -> list[str]:
    """The flags of ``compiled-llm build`` that make ``config``: what parses back into it."""
    return [flag for f in dataclasses.fields(BuildConfig) if getattr(config, f.name) != field_default(f)
            for flag in option_flags(f.name, getattr(config, f.name))]
