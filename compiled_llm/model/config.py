"""ModelConfig: the few numbers and switches that tell the model families apart.

Every family (GPT-2, Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3) is one spec (``model/spec.py``);
a family is a set of values of this dataclass, read from a Hugging Face ``config.json`` by the
family's module in ``model/families/``.
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
    (``ops.rope_cos_sin``): "llama3" (Llama 3.1 on), "yarn" (Qwen2.5 and Qwen3 past 32k),
    "linear" (Gemma 3's global layers) or "longrope" (Phi-3 128k, Phi-3.5). Fields are
    transformers' names; those of the other types keep their defaults."""

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
    # longrope: each dimension's frequency divided by its own factor (head_dim / 2 of them),
    # the short ones at positions below the original context, the long ones from it on; cos/sin
    # scaled by attention_factor (None: from factor). linear: every frequency divided by factor.
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self):
        # from_dict passes a JSON object's lists: kept as tuples, so that the config stays
        # hashable and compares equal to the one it was written from
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(float(x) for x in value))


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
    # sliding-window attention: a query at position p of a "sliding_attention" layer sees the
    # keys at p - sliding_window + 1 .. p; layer_types names each layer's kind (empty: all
    # "full_attention"). Mistral: every layer sliding; Gemma 2: every other; Gemma 3: 5 of 6.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # RoPE base of the sliding layers when it differs from the global one (Gemma 3: 10,000 vs
    # 1,000,000); their table has no frequency scaling
    rope_local_theta: float | None = None
    # Gemma: cap * tanh(x / cap) on attention scores and on the final logits
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # Gemma: scores scaled by query_pre_attn_scalar ** -0.5 rather than head_dim ** -0.5
    query_pre_attn_scalar: float | None = None
    # Gemma: embeddings times sqrt(hidden_size) (rounded to the activations' dtype, as
    # transformers does); a norm after the attention and after the MLP as well as before each
    embed_scale: bool = False
    sandwich_norms: bool = False
    # mixture of experts (Qwen3-MoE, Mixtral): the layers in moe_layers replace the MLP by
    # num_experts SwiGLU experts of moe_intermediate_size, num_experts_per_tok of them per token,
    # weighted by the router's softmax over them (renormalised over the chosen when norm_topk_prob)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    def layer_window(self, layer: int) -> int:
        """The sliding window of ``layer``'s attention, 0 for a global layer."""
        sliding = self.layer_types and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding and self.sliding_window else 0

    @property
    def kv_window(self) -> int | None:
        """The window when every layer is a sliding one (Mistral 7B v0.1, Phi-3 4k): no step
        reads a key more than a window behind its queries, so the cache may drop those blocks;
        None when some layer attends to the whole context."""
        windows = {self.layer_window(n) for n in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 and 0 not in windows else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        d["layer_types"] = tuple(d.get("layer_types") or ())
        d["moe_layers"] = tuple(d.get("moe_layers") or ())
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
        mlp = (2 if self.mlp_type == "gelu_tanh" else 3) * h * i
        moe = self.num_experts * (3 * h * self.moe_intermediate_size + h)  # experts and the router
        n = L * attn + (L - len(self.moe_layers)) * mlp + len(self.moe_layers) * moe + self.vocab_size * h
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
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}  # a multimodal config's decoder
    eos = _eos_ids(hf["eos_token_id"] if hf.get("eos_token_id") is not None else text.get("eos_token_id"))
    bos = hf["bos_token_id"] if hf.get("bos_token_id") is not None else text.get("bos_token_id")
    fields = family_of(arch).config_fields(hf)
    return ModelConfig.from_dict({"architecture": arch, **fields, "bos_token_id": bos, "eos_token_ids": eos})


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

    respelled = _respelled_for_transformers(raw)
    try:
        if respelled is None:
            full = AutoConfig.from_pretrained(str(model_dir)).to_dict()
        else:
            full = AutoConfig.for_model(**respelled).to_dict()
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


def _respelled_for_transformers(raw: dict[str, Any]) -> dict[str, Any] | None:
    """``raw`` with the spellings transformers no longer reads put in today's, or None when it
    has none: Phi-3's first 128k configs call LongRoPE "su", which transformers 5's Phi3Config
    renames only after checking for a field the "su" configs keep elsewhere, and so refuses."""
    scaling = raw.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("type") == "su" and "model_type" in raw:
        return {**raw, "rope_scaling": {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": "longrope"}}
    return None


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
    "mlp_type": ("silu_glu", "gelu_tanh_glu", "gelu_tanh"),
    "position_type": ("rope", "learned"),
}
CONFIG_FLAGS = ("qkv_bias", "o_bias", "qk_norm", "tie_word_embeddings", "embed_scale", "sandwich_norms",
                "norm_topk_prob")
LAYER_TYPES = ("full_attention", "sliding_attention")
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
    _check_attention_variants(d)
    _check_experts(d)
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
ROPE_TYPE_FIELDS = {"llama3": ("low_freq_factor", "high_freq_factor"), "yarn": (), "linear": (),
                    "longrope": ("short_factor", "long_factor")}
# longrope's lists of per-dimension factors: one per rotated pair of a head's dimensions
ROPE_FACTOR_LISTS = ("short_factor", "long_factor")
MAX_ROPE_FACTORS = CONFIG_INT_RANGES["head_dim"][1] // 2


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
    required = ("factor", *ROPE_TYPE_FIELDS[rope_type])
    for name in (*(n for n in required if n not in ROPE_FACTOR_LISTS),
                 *(n for n in ("beta_fast", "beta_slow") if n in scaling)):
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
    _check_rope_factor_lists(scaling, required)


def _check_rope_factor_lists(scaling: dict[str, Any], required: tuple[str, ...]) -> None:
    """longrope's short_factor and long_factor: lists of positive numbers, of one length (that
    it is head_dim / 2 is checked where the table is built), required when ``required`` names them."""
    lengths = {}
    for name in ROPE_FACTOR_LISTS:
        value = scaling.get(name)
        if value is None and name not in required:
            continue
        if not isinstance(value, (list, tuple)) or not 1 <= len(value) <= MAX_ROPE_FACTORS:
            raise ValueError(f"model_config rope_scaling.{name} is {_shown(value)}; it must be a list of 1.."
                             f"{MAX_ROPE_FACTORS} positive numbers")
        bad = next((i for i, x in enumerate(value) if not _positive_float(x)), None)
        if bad is not None:
            raise ValueError(f"model_config rope_scaling.{name}[{bad}] is {_shown(value[bad])}; "
                             "it must be a positive number")
        lengths[name] = len(value)
    if len(set(lengths.values())) > 1:
        raise ValueError(f"model_config rope_scaling.long_factor has {lengths['long_factor']} entries but "
                         f"short_factor has {lengths['short_factor']}; they must be as many")


def _check_attention_variants(d: dict[str, Any]) -> None:
    """The sliding-window, soft-capping and scaling fields (all optional)."""
    window = d.get("sliding_window")
    if window is not None and (not _is_int(window) or not 1 <= window <= CONFIG_INT_RANGES["max_position_embeddings"][1]):
        raise ValueError(f"model_config sliding_window is {_shown(window)}; it must be null or a positive integer")
    types = d.get("layer_types", ())
    if not isinstance(types, (list, tuple)) or (types and len(types) != d["num_layers"]):
        raise ValueError(f"model_config layer_types is {_shown(types)}; it must list one kind per layer "
                         f"({d['num_layers']})")
    bad = next((t for t in types if t not in LAYER_TYPES), None)
    if bad is not None:
        raise ValueError(f"model_config layer_types holds {_shown(bad)}; each must be one of {', '.join(LAYER_TYPES)}")
    if window is None and "sliding_attention" in types:
        raise ValueError("model_config layer_types has sliding layers but sliding_window is null")
    if d.get("rope_local_theta") is not None and not _positive_float(d["rope_local_theta"]):
        raise ValueError(f"model_config rope_local_theta is {_shown(d['rope_local_theta'])}; it must be null or a "
                         "positive number")
    # caps and scales the kernels take as float32 constants: bounded far past any model's
    for name, (lo, hi) in {"attn_softcap": (1e-3, 1e4), "final_softcap": (1e-3, 1e4),
                           "query_pre_attn_scalar": (1e-3, 1e6)}.items():
        value = d.get(name)
        if value is not None and not (_positive_float(value) and lo <= value <= hi):
            raise ValueError(f"model_config {name} is {_shown(value)}; it must be null or a number in [{lo:g}, {hi:g}]")


MAX_EXPERTS = 1024
MAX_EXPERT_LAYERS = 1 << 15  # DeepSeek-V3: 256 experts x 58 layers = 14,848


def _check_experts(d: dict[str, Any]) -> None:
    """The mixture-of-experts fields: none set, or experts, a top-k among them and the layers
    that have them."""
    layers = d.get("moe_layers", ())
    if not isinstance(layers, (list, tuple)) or len(layers) > d["num_layers"] or not all(
            _is_int(n) and 0 <= n < d["num_layers"] for n in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"model_config moe_layers is {_shown(layers)}; it must list distinct layers "
                         f"below num_layers ({d['num_layers']})")
    experts, top_k, size = (d.get(n, 0) for n in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"))
    for name, value, hi in (("num_experts", experts, MAX_EXPERTS), ("num_experts_per_tok", top_k, MAX_EXPERTS),
                            ("moe_intermediate_size", size, CONFIG_INT_RANGES["intermediate_size"][1])):
        if not _is_int(value) or not (1 if layers else 0) <= value <= (hi if layers else 0):
            raise ValueError(f"model_config {name} is {_shown(value)}; it must be an integer in "
                             f"{'1..' + str(hi) if layers else '0..0 (no layer has experts)'}")
    if top_k > experts:
        raise ValueError(f"model_config num_experts_per_tok is {top_k}; it must not exceed num_experts ({experts})")
    if experts * len(layers) > MAX_EXPERT_LAYERS:  # each a weight file entry, checked one by one at load
        raise ValueError(f"model_config has {experts} experts in each of {len(layers)} layers; at most "
                         f"{MAX_EXPERT_LAYERS} in all")


def _shown(value: Any) -> str:
    """A value in an error message, cut short (a tampered field may be megabytes long)."""
    if isinstance(value, (dict, list, tuple)):  # never repr a container: it may nest deeply
        return f"a {'list' if isinstance(value, (list, tuple)) else 'object'} of {len(value)}"
    if type(value) is int and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value) if not isinstance(value, str) or len(value) <= 40 else repr(value[:37])
    return text if len(text) <= 40 else text[:37] + "..."
