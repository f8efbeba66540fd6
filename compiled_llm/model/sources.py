"""Where a model comes from: a local checkpoint directory, a built-in preset, or a hub id.

``resolve_source`` turns the SOURCE argument of the CLI into a ``ModelSource`` (config only, no
weights yet), in this order: an existing directory, a preset name, then an ``org/name`` hub id
fetched with huggingface_hub (from its cache first; a download is tried only when the network
and HF_HUB_OFFLINE allow, with a short timeout, and otherwise fails saying to pass a local
directory). Weights and tokenizer are loaded separately, so tools that only need the config
stay cheap.

A checkpoint's ``generation_config.json`` contributes end-of-sequence ids and, as in vLLM
(``--generation-config auto``), sampling defaults: the fields it sets among temperature, top_p,
top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens), whatever ``do_sample`` says.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from compiled_llm.errors import CompiledLLMError, first_line
from compiled_llm.model.config import ModelConfig, load_config
from compiled_llm.model.presets import PRESET_NAMES, PRESET_SEED, is_preset, preset_config
from compiled_llm.model.tokenizer import byte_level_tokenizer, load_tokenizer
from compiled_llm.model.weights import load_params, random_params

HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*")
# Files a checkpoint needs; everything else in a hub repo (other formats, images) is skipped.
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]
# Mistral's repos also ship their weights once more in Mistral's own format (consolidated.*)
HUB_IGNORE_PATTERNS = ["consolidated*"]
HUB_TIMEOUT_S = 10.0
GENERATION_CONFIG = "generation_config.json"
# generation_config.json's sampling fields -> the SamplingParams fields they default (vLLM's
# ModelConfig.get_diff_sampling_param reads these and no others).
GENERATION_DEFAULT_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# The values SamplingParams accepts for each of them (serve/sampling_params.py is the authority; model/
# does not import serve/, and tests/model/test_generation_defaults.py checks that the two agree).
_INTEGER_DEFAULTS = {"top_k", "max_tokens"}
_DEFAULT_RANGES = {
    "temperature": (lambda v: v >= 0.0, ">= 0"),
    "top_p": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "top_k": (lambda v: v >= 1 or v in (-1, 0), "-1, 0 or >= 1"),
    "min_p": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    "repetition_penalty": (lambda v: v > 0.0, "> 0"),
    "max_tokens": (lambda v: v >= 1, ">= 1"),
}

log = logging.getLogger("compiled_llm.model.sources")


@dataclass(frozen=True)
class ModelSource:
    name: str
    config: ModelConfig
    model_dir: Path | None  # local checkpoint directory; None for presets
    preset: str | None


def resolve_source(source: str) -> ModelSource:
    path = Path(source).expanduser()
    if path.is_dir():
        return ModelSource(name=source, config=load_config(path), model_dir=path, preset=None)
    if is_preset(source):
        return ModelSource(name=source, config=preset_config(source), model_dir=None, preset=source)
    if path.exists():
        raise CompiledLLMError(f"{source} is a file; pass a checkpoint directory, a preset or a hub id")
    if HUB_ID.fullmatch(source):
        model_dir = _hub_snapshot(source)
        return ModelSource(name=source, config=load_config(model_dir), model_dir=model_dir, preset=None)
    raise CompiledLLMError(
        f"model source {source!r} is not a directory, a preset ({', '.join(PRESET_NAMES)}) "
        "or a hub id (org/name)"
    )


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_snapshot(repo_id: str) -> Path:
    """A local snapshot of ``repo_id``: the cached one, else a fresh download."""
    try:
        import huggingface_hub  # optional: only hub ids need it
    except ImportError:
        raise CompiledLLMError(
            f"{repo_id!r} looks like a hub id but huggingface_hub is not installed; pass a local directory"
        ) from None
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=HUB_PATTERNS,
                                                      ignore_patterns=HUB_IGNORE_PATTERNS, local_files_only=True))
    except Exception:  # not cached (huggingface_hub raises several types for that)
        pass
    hint = "download it elsewhere and pass the local checkpoint directory instead"
    if _offline():
        raise CompiledLLMError(f"{repo_id!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; {hint}")
    # A quick metadata call first, so an unreachable hub fails in seconds rather than hanging.
    try:
        huggingface_hub.HfApi().model_info(repo_id, timeout=HUB_TIMEOUT_S)
    except Exception as e:
        raise CompiledLLMError(f"cannot reach {repo_id!r} on the Hugging Face Hub ({first_line(e, limit=None)}); {hint}") from None
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=HUB_PATTERNS,
                                                      ignore_patterns=HUB_IGNORE_PATTERNS, etag_timeout=HUB_TIMEOUT_S))
    except Exception as e:
        raise CompiledLLMError(f"downloading {repo_id!r} failed ({first_line(e, limit=None)}); {hint}") from None


def load_source_params(src: ModelSource, dtype, device, uninitialised=None) -> dict:
    """The spec's params for ``src``: the checkpoint's weights, or a preset's seeded random ones;
    with ``uninitialised`` (a dummy engine's test of a weight's name and shape), random ones
    whatever the source, the weights it picks left uninitialised."""

    if uninitialised is not None:
        return random_params(src.config, dtype=dtype, device=device, seed=PRESET_SEED, uninitialised=uninitialised)
    if src.model_dir is None:
        return random_params(src.config, dtype=dtype, device=device, seed=PRESET_SEED)
    return load_params(src.config, src.model_dir, dtype=dtype, device=device)


def load_source_tokenizer(src: ModelSource):
    """The source's Tokenizer, or None when a checkpoint directory has no tokenizer files."""

    if src.model_dir is None:
        return byte_level_tokenizer()
    return load_tokenizer(src.model_dir)


def read_generation_config(model_dir: Path | None) -> dict:
    """``model_dir``'s generation_config.json as a dict; {} when there is none or it is not a
    JSON object (an unreadable one is logged, never fatal: it only holds defaults)."""
    if model_dir is None:
        return {}
    path = Path(model_dir) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        log.warning("%s is not readable JSON (%s); using no generation defaults from it", path, type(e).__name__)
        return {}
    if not isinstance(data, dict):
        log.warning("%s is not a JSON object; using no generation defaults from it", path)
        return {}
    return data


def generation_eos_token_ids(generation_config: Mapping) -> tuple[int, ...]:
    """The ``eos_token_id`` (one id or a list) of a generation config; chat checkpoints add
    their end-of-turn ids there."""
    value = generation_config.get("eos_token_id")
    values = value if isinstance(value, list) else [value]
    return tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool))


def checked_generation_default(name: str, value) -> int | float:
    """``value`` as the default of SamplingParams field ``name`` (a float, or an int for top_k
    and max_tokens); a ValueError saying what is wrong with it otherwise."""
    if name not in _DEFAULT_RANGES:
        raise ValueError(f"{name!r} is not a sampling default")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
        isinstance(value, float) and not math.isfinite(value)
    ):
        raise ValueError("not a finite number")
    if name in _INTEGER_DEFAULTS:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError("not an integer")
        value = int(value)
    else:
        try:
            value = float(value)
        except OverflowError:  # an integer too large for a float
            raise ValueError("out of range") from None
    in_range, allowed = _DEFAULT_RANGES[name]
    if not in_range(value):
        raise ValueError(f"must be {allowed}")
    return value


def generation_defaults(generation_config: Mapping, origin: str = GENERATION_CONFIG) -> dict[str, int | float]:
    """The sampling defaults a generation config sets, under SamplingParams' names: only the
    fields it sets (null counts as unset), as vLLM's get_diff_sampling_param. A bad value is
    left out with a warning naming it and ``origin``."""
    defaults: dict[str, int | float] = {}
    for key, name in GENERATION_DEFAULT_FIELDS.items():
        value = generation_config.get(key)
        if value is None:
            continue
        try:
            defaults[name] = checked_generation_default(name, value)
        except ValueError as e:
            log.warning("%s: ignoring %s=%r (%s)", origin, key, value, e)
    return defaults


def source_generation_defaults(src: ModelSource) -> dict[str, int | float]:
    """The sampling defaults of ``src``'s generation_config.json ({} for presets)."""
    if src.model_dir is None:
        return {}
    return generation_defaults(read_generation_config(src.model_dir), f"{GENERATION_CONFIG} of {src.name}")


def source_eos_token_ids(src: ModelSource, tokenizer=None) -> tuple[int, ...]:
    """Every id that ends generation for ``src``: config.json's, generation_config.json's (which
    chat checkpoints use to add end-of-turn ids) and the tokenizer's."""
    ids = list(src.config.eos_token_ids)
    ids.extend(generation_eos_token_ids(read_generation_config(src.model_dir)))
    if tokenizer is not None:
        ids.extend(tokenizer.eos_token_ids)
    vocab = src.config.vocab_size
    return tuple(i for i in dict.fromkeys(ids) if 0 <= i < vocab)
