"""ModelConfig: the few numbers and switches that tell the model families apart.

GPT-2, Llama, Qwen2 and Qwen3 are one spec (``model/spec.py``); a family is a set of values of
this dataclass, read from a Hugging Face ``config.json`` by the family's module in
``model/families/``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from compiled_llm.errors import CompiledLLMError
from compiled_llm.model.families import SUPPORTED_ARCHITECTURES, architecture_of, family_of


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Frequency scaling of the rotary embedding, computed into its cos/sin table at build
    (``ops.rope_cos_sin``): "llama3" (Llama 3.1 on) or "yarn" (Qwen2.5 and Qwen3 past 32k).
    Fields are transformers' names; those of the other type keep their defaults."""

    factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"
    # llama3: wavelengths between original / high_freq_factor and original / low_freq_factor
    # are interpolated, longer ones divided by factor
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    # yarn: dimensions ramp from extrapolated to interpolated between beta_fast and beta_slow
    # rotations over the original context; cos/sin are scaled by attention_factor (None: from
    # factor, with mscale / mscale_all_dim when both are set)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float
    # "rms" (Llama, Qwen) or "layer" (GPT-2, with bias)
    norm_type: str
    # "silu_glu" (SwiGLU: gate/up/down) or "gelu_tanh" (GPT-2: fc/proj with bias)
    mlp_type: str
    # "rope" or "learned" (GPT-2 absolute position embeddings)
    position_type: str
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)

    @classmethod
    def checked_from_dict(cls, d: Any) -> "ModelConfig":
        """``from_dict`` of a dict that nobody vouches for (an engine's manifest): every field
        of the right type and within what a model can have, or a ValueError of one line that
        names the field."""
        return cls.from_dict(checked_config_dict(d))

    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        mlp = (3 if self.mlp_type == "silu_glu" else 2) * h * i
        n = L * (attn + mlp) + self.vocab_size * h
        if not self.tie_word_embeddings:
            n += self.vocab_size * h
        if self.position_type == "learned":
            n += self.max_position_embeddings * h
        return n


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from the dict of a Hugging Face config.json: its family's fields,
    and the token ids every family names alike."""
    arch = architecture_of(hf)
    eos = _eos_ids(hf.get("eos_token_id"))
    fields = family_of(arch).config_fields(hf)
    return ModelConfig.from_dict(
        {"architecture": arch, **fields, "bos_token_id": hf.get("bos_token_id"), "eos_token_ids": eos}
    )


def load_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CompiledLLMError(f"no config.json in {model_dir}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CompiledLLMError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise CompiledLLMError(f"{path} does not hold a JSON object")
    # Check the architecture on the raw file first so an unknown model gets our message, then
    # let transformers fill in the class defaults that save_pretrained leaves out of the file.
    arch = architecture_of(raw)
    from transformers import AutoConfig  # seconds to import: only checkpoints need it, engines never

    try:
        full = AutoConfig.from_pretrained(str(model_dir)).to_dict()
    except Exception as e:  # transformers raises ValueError/KeyError/OSError for bad configs
        text = str(e).strip()
        raise CompiledLLMError(f"cannot read {path}: {text.splitlines()[0] if text else type(e).__name__}") from None
    full.setdefault("architectures", raw.get("architectures"))
    try:
        return config_from_hf(full)
    except KeyError as e:
        raise CompiledLLMError(f"{path} lacks the field {e.args[0]!r} that {arch} needs") from None
    except (TypeError, ValueError) as e:
        raise CompiledLLMError(f"{path} has an invalid value: {e}") from None


# ---------------------------------------------------------------------------------------------
# Checking a config that comes from a file nobody vouches for
# ---------------------------------------------------------------------------------------------

# Bounds on what a model can have: a few times the largest released models (vocabularies of
# 256k, 16k hidden, 126 layers, 128 heads, million-token contexts), far below what would make
# a KV cache or a weight table overflow.
CONFIG_INT_RANGES = {
    "vocab_size": (1, 1 << 22),
    "hidden_size": (1, 1 << 16),
    "intermediate_size": (1, 1 << 18),
    "num_layers": (1, 1024),
    "num_heads": (1, 1024),
    "num_kv_heads": (1, 1024),
    "head_dim": (1, 1024),
    "max_position_embeddings": (2, 1 << 24),
}
CONFIG_CHOICES = {
    "architecture": SUPPORTED_ARCHITECTURES,
    "norm_type": ("rms", "layer"),
    "mlp_type": ("silu_glu", "gelu_tanh"),
    "position_type": ("rope", "learned"),
}
CONFIG_FLAGS = ("qkv_bias", "o_bias", "qk_norm", "tie_word_embeddings")
MAX_EOS_TOKEN_IDS = 64


def _is_int(value: Any) -> bool:
    return type(value) is int


def _positive_float(value: Any) -> bool:
    if type(value) is int:  # math.isfinite overflows on integers past a float's range
        return 0 < value < (1 << 64)
    return type(value) is float and math.isfinite(value) and value > 0


def checked_config_dict(d: Any) -> dict[str, Any]:
    """``d`` when it is what ``ModelConfig.to_dict`` writes for a model this engine can run;
    otherwise a ValueError naming the field (see ``ModelConfig.checked_from_dict``)."""
    if not isinstance(d, dict):
        raise ValueError("model_config is not an object")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    required = {f.name for f in dataclasses.fields(ModelConfig)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    unknown = next((k for k in d if k not in fields), None)
    if unknown is not None:
        raise ValueError(f"model_config has an unknown field {str(unknown)[:64]!r}")
    missing = next((k for k in sorted(required) if k not in d), None)
    if missing is not None:
        raise ValueError(f"model_config lacks {missing!r}")
    for name, (lo, hi) in CONFIG_INT_RANGES.items():
        if not _is_int(d[name]) or not lo <= d[name] <= hi:
            raise ValueError(f"model_config {name} is {_shown(d[name])}; it must be an integer in {lo}..{hi}")
    for name, choices in CONFIG_CHOICES.items():
        if d[name] not in choices:
            raise ValueError(f"model_config {name} is {_shown(d[name])}; it must be one of {', '.join(choices)}")
    for name in CONFIG_FLAGS:
        if type(d.get(name, False)) is not bool:
            raise ValueError(f"model_config {name} is {_shown(d[name])}; it must be true or false")
    if not _positive_float(d["norm_eps"]) or d["norm_eps"] >= 1:
        raise ValueError(f"model_config norm_eps is {_shown(d['norm_eps'])}; it must be a number in (0, 1)")
    if not _positive_float(d.get("rope_theta", 1.0)):
        raise ValueError(f"model_config rope_theta is {_shown(d['rope_theta'])}; it must be a positive number")
    if d["num_kv_heads"] > d["num_heads"] or d["num_heads"] % d["num_kv_heads"]:
        raise ValueError(f"model_config num_kv_heads is {d['num_kv_heads']}; it must divide num_heads ({d['num_heads']})")
    if d["position_type"] == "rope" and d["head_dim"] % 2:
        raise ValueError(f"model_config head_dim is {d['head_dim']}; rotary embeddings need an even head_dim")
    _check_rope_scaling(d.get("rope_scaling"))
    bos = d.get("bos_token_id")
    # token ids outside the vocabulary occur in real configs (a tiny GPT-2 keeps 50256): the
    # loader drops them, so only their type and sign are checked
    if bos is not None and (not _is_int(bos) or not 0 <= bos < (1 << 31)):
        raise ValueError(f"model_config bos_token_id is {_shown(bos)}; it must be null or a token id")
    eos = d.get("eos_token_ids", [])
    if not isinstance(eos, (list, tuple)) or len(eos) > MAX_EOS_TOKEN_IDS or not all(
            _is_int(i) and 0 <= i < (1 << 31) for i in eos):
        raise ValueError(f"model_config eos_token_ids is {_shown(eos)}; it must be a list of token ids")
    return d


# Each rope type's required fields (beyond factor and original_max_position_embeddings)
ROPE_TYPE_FIELDS = {"llama3": ("low_freq_factor", "high_freq_factor"), "yarn": ()}


def _check_rope_scaling(scaling: Any) -> None:
    if scaling is None:
        return
    names = {f.name for f in dataclasses.fields(RopeScaling)}
    if not isinstance(scaling, dict):
        raise ValueError(f"model_config rope_scaling is {_shown(scaling)}; it must be null or an object")
    unknown = sorted(str(k) for k in set(scaling) - names)
    if unknown:
        raise ValueError(f"model_config rope_scaling holds {_shown(unknown[0])}, which is no field of it; its fields "
                         f"are {', '.join(sorted(names))}")
    rope_type = scaling.get("rope_type", "llama3")
    if not isinstance(rope_type, str) or rope_type not in ROPE_TYPE_FIELDS:
        raise ValueError(f"model_config rope_scaling.rope_type is {_shown(rope_type)}; it must be one of "
                         f"{', '.join(ROPE_TYPE_FIELDS)}")
    for name in ("factor", *ROPE_TYPE_FIELDS[rope_type], *(n for n in ("beta_fast", "beta_slow") if n in scaling)):
        if not _positive_float(scaling.get(name)):
            raise ValueError(f"model_config rope_scaling.{name} is {_shown(scaling.get(name))}; it must be a positive number")
    for name in ("attention_factor", "mscale", "mscale_all_dim", "low_freq_factor", "high_freq_factor"):
        if scaling.get(name) is not None and not _positive_float(scaling[name]):
            raise ValueError(f"model_config rope_scaling.{name} is {_shown(scaling[name])}; it must be null or a positive number")
    if type(scaling.get("truncate", True)) is not bool:
        raise ValueError(f"model_config rope_scaling.truncate is {_shown(scaling['truncate'])}; it must be true or false")
    original = scaling.get("original_max_position_embeddings")
    if not _is_int(original) or not 1 <= original <= CONFIG_INT_RANGES["max_position_embeddings"][1]:
        raise ValueError(f"model_config rope_scaling.original_max_position_embeddings is {_shown(original)}; "
                         "it must be a positive integer")
    if rope_type == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError("model_config rope_scaling.high_freq_factor must be above low_freq_factor")


def _shown(value: Any) -> str:
    """A value in an error message, cut short (a tampered field may be megabytes long)."""
    if isinstance(value, (dict, list, tuple)):  # never repr a container: it may nest deeply
        return f"a {'list' if isinstance(value, (list, tuple)) else 'object'} of {len(value)}"
    if type(value) is int and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value) if not isinstance(value, str) or len(value) <= 40 else repr(value[:37])
    return text if len(text) <= 40 else text[:37] + "..."
