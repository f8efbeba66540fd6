"""What a model family is: the checkpoints it reads, how their ``config.json`` becomes
ModelConfig fields, and how their tensor names become the spec's param names.

Every family runs the one spec (``model/spec.py``) at some values of ModelConfig, so a family is
data plus pure functions of plain dicts and strings. It imports nothing of the model's:
``config.py`` and ``weights.py`` consult the families, not the other way round. ``config_fields``
returns the dict that ``ModelConfig.to_dict`` writes (less the fields every family reads alike:
architecture, bos/eos ids), and ``config.py`` makes the ModelConfig of it.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable

from compiled_llm.errors import UnsupportedArchitectureError

logger = logging.getLogger(__name__)

# {name} or {name:a|b|c} in a TensorName template
_FIELD = re.compile(r"\{(\w+)(?::([^}]*))?\}")
# a field whose alternatives neither template gives is a number (a layer, an expert)
_NUMBER = r"\d+"


@dataclass(frozen=True)
class TensorName:
    """One checkpoint tensor name and the spec param name it holds, written as two templates
    over the same fields, so one line serves both directions (loading, and naming a missing
    tensor in an error). ``{layer}`` is a number; ``{proj:q|k|v}`` is one of the alternatives,
    given once on either side.

        TensorName("model.layers.{layer}.mlp.{proj:gate|up|down}_proj.weight", "layers.{layer}.{proj}.weight")
    """

    checkpoint: str
    spec: str

    def to_spec(self, checkpoint_name: str) -> str | None:
        return _translate(self.checkpoint, self.spec, checkpoint_name)

    def to_checkpoint(self, spec_name: str) -> str | None:
        return _translate(self.spec, self.checkpoint, spec_name)


def _translate(source: str, target: str, name: str) -> str | None:
    """``name`` read with template ``source`` and written with ``target``; None if it does not fit."""
    m = _pattern(source, target).fullmatch(name)
    if m is None:
        return None
    return _FIELD.sub(lambda f: m.group(f.group(1)), target)


@functools.lru_cache(maxsize=None)
def _pattern(template: str, other: str) -> re.Pattern[str]:
    """The regex of ``template``, each field a named group of its alternatives (from either
    template) or a number."""
    choices = {f.group(1): f.group(2) for t in (template, other) for f in _FIELD.finditer(t) if f.group(2)}
    parts, end = [], 0
    for f in _FIELD.finditer(template):
        parts += [re.escape(template[end:f.start()]), f"(?P<{f.group(1)}>{choices.get(f.group(1), _NUMBER)})"]
        end = f.end()
    parts.append(re.escape(template[end:]))
    return re.compile("".join(parts))


def layer_projection(spec_name: str) -> str | None:
    """"q" of "layers.3.q.weight": the projection a layer param belongs to; None for the rest
    (embeddings, the final norm, lm_head)."""
    parts = spec_name.split(".")
    return parts[2] if len(parts) == 4 and parts[0] == "layers" else None


def with_projection(spec_name: str, projection: str) -> str:
    """"layers.3.k.weight" for ("layers.3.qkv.weight", "k")."""
    parts = spec_name.split(".")
    return ".".join(parts[:2] + [projection] + parts[3:])


@dataclass(frozen=True)
class Family:
    """One family of checkpoints the spec runs (see the module docstring)."""

    name: str
    # config.json's "model_type" values it reads
    model_types: tuple[str, ...]
    # config.json's "architectures" values it reads; the first stands for a config.json that
    # gives a model_type alone
    architectures: tuple[str, ...]
    # config.json (as transformers completes it) -> ModelConfig fields; a one-line
    # UnsupportedArchitectureError for a variant the spec cannot run
    config_fields: Callable[[dict[str, Any]], dict[str, Any]]
    tensor_names: tuple[TensorName, ...]
    # a prefix some checkpoints put on every tensor (GPT2LMHeadModel's "transformer.", which
    # checkpoints of the bare GPT2Model lack): read with or without it, written with it
    checkpoint_prefix: str = ""
    # checkpoint tensors (without the prefix) that are no weights of the spec's, read and dropped
    ignored: str | None = None
    # projections whose weight the checkpoint stores [in, out] (GPT-2's Conv1D), not [out, in]
    transposed: tuple[str, ...] = ()
    # (stored, parts): a checkpoint tensor that holds the parts' rows stacked, in that order
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def spec_name(self, checkpoint_name: str) -> str | None:
        """The spec param a checkpoint tensor holds (a fused name such as "layers.0.qkv.weight"
        for stacked parts); None for an ignored tensor, "" for one with no place in the spec."""
        name = checkpoint_name.removeprefix(self.checkpoint_prefix)
        if self.ignored is not None and re.fullmatch(self.ignored, name):
            return None
        return next((s for s in (t.to_spec(name) for t in self.tensor_names) if s is not None), "")

    def checkpoint_name(self, spec_name: str) -> str:
        """The checkpoint tensor that holds spec param ``spec_name`` (the spec name if none
        does): for error messages about a tensor the checkpoint lacks."""
        stored = self._stored_name(spec_name)
        for t in self.tensor_names:
            name = t.to_checkpoint(stored)
            if name is not None:
                return self.checkpoint_prefix + name
        return spec_name

    def spec_params(self, spec_name: str) -> tuple[str, ...]:
        """The spec params the checkpoint tensor named ``spec_name`` holds: its parts when it is
        a fused one, else itself."""
        parts = dict(self.fused).get(layer_projection(spec_name) or "", ())
        return tuple(with_projection(spec_name, p) for p in parts) or (spec_name,)

    def _stored_name(self, spec_name: str) -> str:
        """The name of the tensor ``spec_name`` is stored in: the fused one its projection is a
        part of, else itself."""
        projection = layer_projection(spec_name)
        for stored, parts in self.fused:
            if projection in parts:
                return with_projection(spec_name, stored)
        return spec_name


# ---------------------------------------------------------------------------------------------
# What several families read alike
# ---------------------------------------------------------------------------------------------


def rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and frequency scaling (llama3 or yarn, as ModelConfig fields) from either the
    transformers 4.x keys (rope_theta, rope_scaling) or the 5.x key rope_parameters. A yarn
    model's positions reach factor x original_max_position_embeddings (as vLLM derives its
    longest context), which max_position_embeddings is raised to."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    # rotary embeddings over part of each head (Phi-4-mini: 0.75) are not in the spec
    for partial in (merged.get("partial_rotary_factor"), hf.get("partial_rotary_factor")):
        if partial is not None and partial != 1.0:
            raise UnsupportedArchitectureError(f"unsupported partial_rotary_factor {partial!r}; supported: 1.0")
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type in (None, "default"):
        return {"rope_theta": theta, "rope_scaling": None}
    if rope_type not in ("llama3", "yarn"):
        raise UnsupportedArchitectureError(
            f"unsupported rope scaling type {rope_type!r}; supported: default, llama3, yarn"
        )
    max_positions = hf.get("max_position_embeddings", 2048)
    original = int(merged.get("original_max_position_embeddings") or max_positions)
    if rope_type == "llama3":
        return {"rope_theta": theta, "rope_scaling": {
            "rope_type": "llama3",
            "factor": float(merged["factor"]),
            "low_freq_factor": float(merged["low_freq_factor"]),
            "high_freq_factor": float(merged["high_freq_factor"]),
            "original_max_position_embeddings": original,
        }}
    factor = float(merged["factor"]) if merged.get("factor") is not None else max_positions / original
    optional = {name: float(merged[name]) for name in ("beta_fast", "beta_slow", "attention_factor", "mscale",
                                                       "mscale_all_dim") if merged.get(name)}
    return {
        "rope_theta": theta,
        "max_position_embeddings": max(max_positions, int(factor * original)),
        "rope_scaling": {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
                         "truncate": bool(merged.get("truncate", True)), **optional},
    }


def context_within_window(fields: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with max_position_embeddings cut to config.json's ``sliding_window`` when
    that is shorter (Mistral 7B v0.1, Phi-3 4k): a query attends to the keys less than a window
    behind it, so within a context no longer than the window, full attention is the same. The
    attention kernels take no window yet; this keeps such models exact, over a shorter context."""
    window = hf.get("sliding_window")
    if window is not None and window < fields["max_position_embeddings"]:
        logger.warning("sliding_window %d is shorter than max_position_embeddings %d: the context is cut to %d "
                       "tokens (sliding-window attention is not supported yet)", window,
                       fields["max_position_embeddings"], window)
        fields = {**fields, "max_position_embeddings": window}
    return fields
