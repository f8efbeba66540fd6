"""``BuildConfig``: how a model source is built into an engine, the one place the build options'
names, defaults, choices and help live.

``build_engine`` takes one; ``compiled-llm build`` makes a flag of each field, and so do ``run``,
``serve`` and ``bench``, which build a SOURCE into the engine cache (``cli/engine_args.py``);
``LLM(SOURCE, ...)`` takes them as keywords; the engine cache keys its entries by the resolved
config; and an engine's manifest records it as ``build_options`` (``to_manifest`` /
``from_manifest``), which every reader of a manifest reads through this type.

A config as given may say "auto" (dtype, device) and leave ``max_model_len`` unset; the build
resolves it (``engine.build.resolve_config``) against the source and the machine, and a manifest
holds only resolved configs. Plain Python: building the command line imports no torch.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Mapping

from compiled_llm.errors import InvalidOptionError

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_CHOICES = ("auto", *DTYPES, *DTYPE_ALIASES)
DEVICE_TYPES = ("cpu", "cuda")
DEVICE_CHOICES = ("auto", *DEVICE_TYPES)
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]{1,3})?")
# the weight-only schemes quantize_weights applies (graph/quantized_ops.py implements each)
QUANTIZATIONS = ("int8", "int4")
# where the weights come from: the source's ("auto"), or random at load, none stored ("dummy")
LOAD_FORMATS = ("auto", "dummy")
# how a decode step of a few sequences runs: the post-pass program op by op, or one schedule of
# instructions per SM (compiled_llm/megakernel)
DECODE_BACKENDS = ("per-op", "megakernel")
MAX_TENSOR_PARALLEL = 64
# ranks of one engine (pipeline stages x tensor-parallel ranks): each is a process of this host
MAX_RANKS = 64
# keys an older build wrote into build_options that no build reads any more (format 1's backend)
RETIRED_MANIFEST_KEYS = ("backend",)


def _option(default, help: str, **flag):
    """A field with its help and how its flag is spelled (``cli/engine_args.py`` reads
    ``flag``, ``aliases``, ``choices`` and ``metavar``)."""
    if isinstance(default, dict):
        return dataclasses.field(default_factory=dict, metadata={"help": help, **flag})
    return dataclasses.field(default=default, metadata={"help": help, **flag})


def _shown(value: Any) -> str:
    """``repr(value)``, cut short: a bad value goes into a one-line error."""
    try:
        text = repr(value)
    except ValueError:  # an int of more digits than Python prints
        return f"an {type(value).__name__} too large to show"
    return text if len(text) <= 60 else text[:57] + "..."


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """The build options (see the module docstring)."""

    dtype: str = _option(
        "auto", "weight and activation dtype: auto = the checkpoint's float16/bfloat16 on a GPU (bfloat16 when "
                "it is float32 or says nothing), float32 on a CPU; fp32, bf16 and fp16 are short names",
        choices=DTYPE_CHOICES)
    device: str = _option(
        "auto", "target device: auto = cuda when available, else cpu; cpu, cuda or cuda:N", metavar="DEVICE")
    max_model_len: int | None = _option(None, "longest context the engine serves; unset: the model's maximum")
    disabled_passes: tuple[str, ...] = _option(
        (), "skip a pass (repeatable); see `compiled-llm inspect` for the pass names",
        flag="disable_pass", metavar="NAME")
    kernel_prefs: dict[str, str] = _option(
        {}, "force a kernel provider for a cllm op, e.g. paged_attention=triton (repeatable)",
        flag="kernel", metavar="OP=PROVIDER")
    dump_ir: bool = _option(
        False, "keep the graph code after every pass in ENGINE_DIR/ir (otherwise the captured and final only)")
    quantization: str | None = _option(
        None, "weight-only quantization of the linear layers and the lm_head: int8 (per output channel) or "
              "int4 (groups of 128 along K); unset: none", choices=QUANTIZATIONS, aliases=("-q",))
    tensor_parallel_size: int = _option(
        1, "shard the model over N GPUs (N processes over gloo on a CPU): heads and MLP columns split, one "
           "weights file per rank", aliases=("-tp",))
    load_format: str = _option(
        "auto", "auto: the source's weights (a preset's seeded random ones); dummy: random weights made on the "
                "device at load and none stored, as vLLM's --load-format dummy (speed at real shapes without "
                "the disk a checkpoint takes)", choices=LOAD_FORMATS)
    pipeline_parallel_size: int = _option(
        1, "split the model's layers into N pipeline stages, each on its own GPU or tensor-parallel group (N "
           "processes over gloo on a CPU): one program per stage, activations sent from stage to stage",
        aliases=("-pp",))
    decode_backend: str = _option(
        "per-op", "how decode steps of 1-8 sequences run: per-op (the program's kernels, one launch each) or "
                  "megakernel (the build schedules the step's tiles onto the GPU's SMs as instructions with "
                  "dependency counters, stored in the engine; on a CPU the schedule runs in its interpreter)",
        choices=DECODE_BACKENDS)

    def __post_init__(self):
        dtype = self.dtype
        if not isinstance(dtype, str) or dtype not in DTYPE_CHOICES:
            raise InvalidOptionError(f"unknown dtype {_shown(dtype)}; the choices are: {', '.join(DTYPE_CHOICES)}")
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(dtype, dtype))
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise InvalidOptionError(f"unknown device {_shown(self.device)}; the choices are: auto, cpu, cuda, cuda:N")
        size = self.max_model_len
        if size is not None and (type(size) is not int or size < 2):
            raise InvalidOptionError(f"max_model_len must be an integer >= 2, got {_shown(size)}")
        object.__setattr__(self, "disabled_passes", _pass_names(self.disabled_passes))
        object.__setattr__(self, "kernel_prefs", _kernel_prefs(self.kernel_prefs))
        if type(self.dump_ir) is not bool:
            raise InvalidOptionError(f"dump_ir must be True or False, got {_shown(self.dump_ir)}")
        if self.quantization is not None and (not isinstance(self.quantization, str)
                                              or self.quantization not in QUANTIZATIONS):
            raise InvalidOptionError(
                f"unknown quantization {_shown(self.quantization)}; the choices are: {', '.join(QUANTIZATIONS)}")
        size = self.tensor_parallel_size
        if type(size) is not int or not 1 <= size <= MAX_TENSOR_PARALLEL:
            raise InvalidOptionError(
                f"tensor_parallel_size must be an integer in 1..{MAX_TENSOR_PARALLEL}, got {_shown(size)}")
        stages = self.pipeline_parallel_size
        if type(stages) is not int or not 1 <= stages <= MAX_RANKS:
            raise InvalidOptionError(
                f"pipeline_parallel_size must be an integer in 1..{MAX_RANKS}, got {_shown(stages)}")
        if stages * size > MAX_RANKS:
            raise InvalidOptionError(
                f"pipeline_parallel_size {stages} x tensor_parallel_size {size} is {stages * size} ranks, more than "
                f"the {MAX_RANKS} one engine runs")
        if not isinstance(self.load_format, str) or self.load_format not in LOAD_FORMATS:
            raise InvalidOptionError(
                f"unknown load_format {_shown(self.load_format)}; the choices are: {', '.join(LOAD_FORMATS)}")
        if self.load_format == "dummy" and self.quantization is not None:
            raise InvalidOptionError("load_format dummy stores no weights to quantize; drop --quantization")
        if not isinstance(self.decode_backend, str) or self.decode_backend not in DECODE_BACKENDS:
            raise InvalidOptionError(
                f"unknown decode_backend {_shown(self.decode_backend)}; the choices are: {', '.join(DECODE_BACKENDS)}")
        if self.decode_backend == "megakernel":
            others = [f for f, on in (("--quantization", self.quantization is not None),
                                      ("--tensor-parallel-size", size > 1), ("--pipeline-parallel-size", stages > 1))
                      if on]
            if others:
                raise InvalidOptionError(f"--decode-backend megakernel does not cover {others[0]} yet; "
                                         "build with --decode-backend per-op")

    # ---- as the keyword arguments of an API -------------------------------------------------

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "BuildConfig":
        """The config of keyword options, refusing a name that is not a build option."""
        names = field_names()
        unknown = [k for k in options if k not in names]
        if unknown:
            raise InvalidOptionError(f"unknown build option {unknown[0]!r}; the options are: {', '.join(names)}")
        return cls(**options)

    # ---- in a manifest ----------------------------------------------------------------------

    @property
    def is_resolved(self) -> bool:
        """Nothing left to the machine or the model: a dtype, a device and a length."""
        return self.dtype != "auto" and self.device != "auto" and self.max_model_len is not None

    @property
    def device_type(self) -> str | None:
        """"cpu" or "cuda" (None for "auto")."""
        return None if self.device == "auto" else self.device.partition(":")[0]

    def to_manifest(self) -> dict:
        """The manifest's ``build_options`` of a resolved config (the device as its type: an
        engine built on one GPU loads on any)."""
        if not self.is_resolved:
            raise ValueError(f"only a resolved config goes into a manifest, not {self}")
        return {
            "dtype": self.dtype, "device": self.device_type, "max_model_len": self.max_model_len,
            "disabled_passes": list(self.disabled_passes), "kernel_prefs": dict(self.kernel_prefs),
            "dump_ir": self.dump_ir, "quantization": self.quantization,
            "tensor_parallel_size": self.tensor_parallel_size, "load_format": self.load_format,
            "pipeline_parallel_size": self.pipeline_parallel_size, "decode_backend": self.decode_backend,
        }

    @classmethod
    def from_manifest(cls, options: Any) -> "BuildConfig":
        """The config a manifest's ``build_options`` records: what ``to_manifest`` writes, and
        what builds before wrote (format 1 had a ``backend``; the options added since, say
        ``quantization`` or ``tensor_parallel_size``, are missing from older engines and take
        their defaults). An InvalidOptionError (one line) for anything else, so a damaged or
        tampered manifest is refused, never half read."""
        if not isinstance(options, Mapping):
            raise InvalidOptionError(f"build options must be an object, got {type(options).__name__}")
        values = {k: v for k, v in options.items() if k not in RETIRED_MANIFEST_KEYS}
        unknown = [k for k in values if k not in field_names()]
        if unknown:
            raise InvalidOptionError(f"unknown build option {_shown(unknown[0])} (written by a newer compiled_llm?)")
        disabled = values.get("disabled_passes", [])
        if not isinstance(disabled, list):  # JSON has lists; a string would be read letter by letter
            raise InvalidOptionError(f"disabled_passes must be a list of pass names, got {_shown(disabled)}")
        if not isinstance(values.get("kernel_prefs", {}), dict):
            raise InvalidOptionError(f"kernel_prefs must map ops to providers, got {_shown(values['kernel_prefs'])}")
        for key in ("dtype", "device", "max_model_len"):
            if values.get(key) is None:
                raise InvalidOptionError(f"build options lack the {key} the engine was built with")
        config = cls(**values)
        if values["dtype"] not in DTYPES or values["device"] not in DEVICE_TYPES:
            raise InvalidOptionError(f"build options record dtype {_shown(values['dtype'])} and device "
                                     f"{_shown(values['device'])}; a build records {'/'.join(DTYPES)} and cpu/cuda")
        return config

    def mismatches(self, built: "BuildConfig", names: Iterable[str]) -> list[tuple[str, Any, Any]]:
        """(option, this config's value, ``built``'s) of each of the options ``names`` (those
        asked for) that differs from what the engine ``built`` was built with; "auto" matches
        any dtype and device, and an unset max_model_len any length."""
        out = []
        for name in names:
            asked, was = getattr(self, name), getattr(built, name)
            if name == "device":
                asked, was = self.device_type, built.device_type
            if asked in ("auto", None) and name in ("dtype", "device", "max_model_len"):
                continue
            if asked != was:
                out.append((name, asked, was))
        return out

def field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(BuildConfig))


def option_flag(name: str) -> str:
    """The command-line flag of the option ``name``: ``--disable-pass`` for disabled_passes."""
    (f,) = [f for f in dataclasses.fields(BuildConfig) if f.name == name]
    return "--" + f.metadata.get("flag", name).replace("_", "-")


def option_flags(name: str, value: Any) -> list[str]:
    """The flags that set the option ``name`` to ``value``: repeated for each item of a list
    or map, ``--no-...`` for False."""
    flag = option_flag(name)
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag.removeprefix("--")]
    if isinstance(value, Mapping):
        return [item for op, provider in value.items() for item in (flag, f"{op}={provider}")]
    if isinstance(value, (tuple, list)):
        return [item for v in value for item in (flag, str(v))]
    return [flag, str(value)]


def option_text(value: Any) -> str:
    """An option's value as its flags spell it: "none" for nothing, lists and maps joined."""
    if value is None or (isinstance(value, (tuple, list, dict)) and not value):
        return "none"
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return str(value)


def _pass_names(value: Any) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidOptionError(f"disabled_passes (--disable-pass) must be a list of pass names, got {_shown(value)}")
    names = tuple(value)
    for name in names:
        if not isinstance(name, str) or not name:
            raise InvalidOptionError(f"disabled_passes (--disable-pass) names a pass {_shown(name)}; a pass name is text")
    return names


def _kernel_prefs(value: Any) -> dict[str, str]:
    """{op: provider} of a mapping, or of "OP=PROVIDER" strings (the flag's spelling)."""
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidOptionError(f"kernel_prefs (--kernel) must map ops to providers, got {_shown(value)}")
    else:
        items = []
        for item in value:
            op, sep, provider = item.partition("=") if isinstance(item, str) else ("", "", "")
            if not sep:
                raise InvalidOptionError(f"kernel_prefs (--kernel) entry {_shown(item)} is not OP=PROVIDER")
            items.append((op, provider))
    for op, provider in items:
        if not (isinstance(op, str) and op and isinstance(provider, str) and provider):
            raise InvalidOptionError(
                f"kernel_prefs (--kernel) entry {_shown(op)}: {_shown(provider)} does not name an op and a provider")
    return dict(items)
