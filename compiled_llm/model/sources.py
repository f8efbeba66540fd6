"""Where a model comes from: a local checkpoint directory, a built-in preset, or a hub id.

``resolve_source`` turns the SOURCE argument of the CLI into a ``ModelSource`` (config only, no
weights yet), in this order: an existing directory, a preset name, then an ``org/name`` hub id
fetched with huggingface_hub (from its cache first; a download is tried only when the network
and HF_HUB_OFFLINE allow, with a short timeout, and otherwise fails saying to pass a local
directory). Weights and tokenizer are loaded separately, so tools that only need the config
stay cheap.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from compiled_llm.errors import CompiledLLMError
from compiled_llm.model.config import ModelConfig, load_config
from compiled_llm.model.presets import PRESET_NAMES, PRESET_SEED, is_preset, preset_config
from compiled_llm.model.tokenizer import byte_level_tokenizer, load_tokenizer
from compiled_llm.model.weights import load_params, random_params

HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*")
# Files a checkpoint needs; everything else in a hub repo (other formats, images) is skipped.
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]
HUB_TIMEOUT_S = 10.0


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
        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=True))
    except Exception:  # not cached (huggingface_hub raises several types for that)
        pass
    hint = "download it elsewhere and pass the local checkpoint directory instead"
    if _offline():
        raise CompiledLLMError(f"{repo_id!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; {hint}")
    # A quick metadata call first, so an unreachable hub fails in seconds rather than hanging.
    try:
        huggingface_hub.HfApi().model_info(repo_id, timeout=HUB_TIMEOUT_S)
    except Exception as e:
        raise CompiledLLMError(f"cannot reach {repo_id!r} on the Hugging Face Hub ({_first_line(e)}); {hint}") from None
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, etag_timeout=HUB_TIMEOUT_S))
    except Exception as e:
        raise CompiledLLMError(f"downloading {repo_id!r} failed ({_first_line(e)}); {hint}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def load_source_params(src: ModelSource, dtype, device) -> dict:
    """The spec's params for ``src``: the checkpoint's weights, or a preset's seeded random ones."""

    if src.model_dir is None:
        return random_params(src.config, dtype=dtype, device=device, seed=PRESET_SEED)
    return load_params(src.config, src.model_dir, dtype=dtype, device=device)


def load_source_tokenizer(src: ModelSource):
    """The source's Tokenizer, or None when a checkpoint directory has no tokenizer files."""

    if src.model_dir is None:
        return byte_level_tokenizer()
    return load_tokenizer(src.model_dir)


def source_eos_token_ids(src: ModelSource, tokenizer=None) -> tuple[int, ...]:
    """Every id that ends generation for ``src``: config.json's, generation_config.json's (which
    chat checkpoints use to add end-of-turn ids) and the tokenizer's."""
    ids = list(src.config.eos_token_ids)
    if src.model_dir is not None:
        gen_path = src.model_dir / "generation_config.json"
        if gen_path.is_file():
            try:
                value = json.loads(gen_path.read_text()).get("eos_token_id")
            except (json.JSONDecodeError, AttributeError):
                value = None
            if isinstance(value, int):
                ids.append(value)
            elif isinstance(value, list):
                ids.extend(int(v) for v in value)
    if tokenizer is not None:
        ids.extend(tokenizer.eos_token_ids)
    vocab = src.config.vocab_size
    return tuple(i for i in dict.fromkeys(ids) if 0 <= i < vocab)
