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
import re
from dataclasses import dataclass
from typing import Any, Callable

from compiled_llm.errors import UnsupportedArchitectureError

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
    # added to every norm weight at load (Gemma's RMSNorms scale by 1 + w: the spec's by w)
    norm_offset: float = 0.0

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


# The rope scaling types rope_fields reads ("su" is old Phi-3 configs' name for longrope)
ROPE_TYPES = ("default", "llama3", "yarn", "linear", "longrope")
ROPE_TYPE_ALIASES = {"su": "longrope"}


def rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and frequency scaling (llama3, yarn, linear or longrope, as ModelConfig
    fields) from either the transformers 4.x keys (rope_theta, rope_scaling) or the 5.x key
    rope_parameters. A yarn model's positions reach factor x original_max_position_embeddings
    (as vLLM derives its longest context), which max_position_embeddings is raised to; a
    longrope model's max_position_embeddings is its long context already."""
    params = _global_rope_parameters(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    # rotary embeddings over part of each head (Phi-4-mini: 0.75) are not in the spec
    for partial in (merged.get("partial_rotary_factor"), hf.get("partial_rotary_factor")):
        if partial is not None and partial != 1.0:
            raise UnsupportedArchitectureError(f"unsupported partial_rotary_factor {partial!r}; supported: 1.0")
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    rope_type = ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type in (None, "default"):
        return {"rope_theta": theta, "rope_scaling": None}
    if rope_type not in ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
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
    if rope_type == "linear":
        # RopeScaling requires an original context; linear scaling has none and leaves it unused
        return {"rope_theta": theta, "rope_scaling": {
            "rope_type": "linear", "factor": float(merged["factor"]), "original_max_position_embeddings": original}}
    if rope_type == "longrope":
        return {"rope_theta": theta, "rope_scaling": _longrope_scaling(hf, merged, max_positions)}
    factor = float(merged["factor"]) if merged.get("factor") is not None else max_positions / original
    optional = {name: float(merged[name]) for name in ("beta_fast", "beta_slow", "attention_factor", "mscale",
                                                       "mscale_all_dim") if merged.get(name)}
    return {
        "rope_theta": theta,
        "max_position_embeddings": max(max_positions, int(factor * original)),
        "rope_scaling": {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
                         "truncate": bool(merged.get("truncate", True)), **optional},
    }


def _global_rope_parameters(params: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 nests rope_parameters by layer type when the types differ (Gemma 3: linear
    scaling on the full-attention layers, none on the sliding ones): the full-attention layers'
    are the ones the table is built from. The sliding layers' theta is their family's to read
    (ModelConfig.rope_local_theta); their table has no scaling, so a scaled one is refused."""
    if "full_attention" not in params and "sliding_attention" not in params:
        return params
    local = params.get("sliding_attention") or {}
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type not in (None, "default"):
        raise UnsupportedArchitectureError(
            f"unsupported rope scaling type {local_type!r} on sliding-attention layers; supported: default")
    return params.get("full_attention") or {}


def _longrope_scaling(hf: dict[str, Any], merged: dict[str, Any], max_positions: int) -> dict[str, Any]:
    """LongRoPE's fields as transformers reads them: original_max_position_embeddings from the
    config's top level first (where Phi-3 keeps it), then the rope parameters; factor, when
    absent, max_position_embeddings / original (it sets the default attention_factor)."""
    original = int(hf.get("original_max_position_embeddings") or merged.get("original_max_position_embeddings")
                   or max_positions)
    factor = float(merged["factor"]) if merged.get("factor") is not None else max_positions / original
    optional = {"attention_factor": float(merged["attention_factor"])} if merged.get("attention_factor") else {}
    return {"rope_type": "longrope", "factor": factor, "original_max_position_embeddings": original,
            "short_factor": [float(x) for x in merged["short_factor"]],
            "long_factor": [float(x) for x in merged["long_factor"]], **optional}


def every_layer_sliding(fields: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with config.json's ``sliding_window`` on every layer (Mistral 7B v0.1: 4,096;
    Phi-3 4k: 2,047): a query attends to the keys less than a window behind it. A window no
    shorter than the context is full attention, and is left out."""
    window = hf.get("sliding_window")
    if window is None or window >= fields["max_position_embeddings"]:
        return fields
    return {**fields, "sliding_window": int(window), "layer_types": ("sliding_attention",) * fields["num_layers"]}