"""What an engine's manifest must hold before anything else in the engine is read.

Every field the loader (or ``build -o``) reads is checked for its type and for a range the model
can have, so that a malformed or tampered manifest is one EngineError that names the file and
the field, never a traceback from deep inside a load (a ``head_dim`` of 0 dividing by zero, a
``num_layers`` of 10^9 sizing a 4 TB KV cache, a 5,000-character path failing in ``stat``).

Two format versions are known: the current one, which loads, and format 1 (compiled_llm before
the pickle-free program), which loads no more but is still recognised as an engine of ours so
that ``build -o`` may replace it in place. Both are checked equally strictly: the keys their
writer always wrote, and a ``files`` map of relative paths to sha256 digests.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from compiled_llm.engine.build_config import BuildConfig
from compiled_llm.errors import CompiledLLMError, EngineError, InvalidOptionError
from compiled_llm.model import sharding
from compiled_llm.model.config import ModelConfig

# format version -> the keys every manifest its writer wrote has
REQUIRED_KEYS = {
    1: ("model_config", "build_options", "program", "files", "backend", "kernels"),
    2: ("model_config", "build_options", "program", "files", "kernels"),
}
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
MAX_FILES = 1 << 16  # a CUDA engine lists a few hundred kernel files
MAX_PATH_CHARS = 1024
MAX_NAME_CHARS = 255  # one path component (NAME_MAX)
MAX_PARAMS = 1 << 16
MAX_PARAM_NAME_CHARS = 256
MAX_KERNEL_ENTRIES = 1024


def malformed(path: Path, field: str, why: str | None = None) -> EngineError:
    detail = f" ({why})" if why else ""
    return EngineError(f"{path} has a malformed {field!r} entry{detail}; rebuild the engine")


def check_required_keys(manifest: dict, version: int, path: Path) -> None:
    for key in REQUIRED_KEYS[version]:
        if key not in manifest:
            raise EngineError(f"{path} lacks {key!r}; rebuild the engine")


def check_files_map(files: Any, path: Path) -> None:
    """``files``: relative paths of sane length, each mapped to a sha256 hex digest."""
    if not isinstance(files, dict) or not files:
        raise malformed(path, "files", "it must map the engine's files to their sha256")
    if len(files) > MAX_FILES:
        raise malformed(path, "files", f"{len(files)} files, more than {MAX_FILES}")
    for rel, digest in files.items():
        why = path_problem(rel)
        if why is None and not (isinstance(digest, str) and SHA256_HEX.fullmatch(digest)):
            why = f"the digest of {rel} is not a sha256"
        if why is not None:
            raise malformed(path, "files", why)


def path_problem(rel: Any) -> str | None:
    """Why ``rel`` cannot be a path an engine lists (too long, empty, a NUL), or None. Where it
    leads is ``artifact.inside``'s to check."""
    if not isinstance(rel, str) or not rel:
        return "a path that is not a non-empty string"
    if len(rel) > MAX_PATH_CHARS or any(len(part) > MAX_NAME_CHARS for part in rel.split("/")):
        return f"a path of {len(rel)} characters, longer than a file name may be"
    if "\0" in rel:
        return "a path with a NUL character"
    return None


def check_current_manifest(manifest: dict, path: Path) -> ModelConfig:
    """Every field of a current-format manifest the loader reads; returns its model config."""
    check_required_keys(manifest, 2, path)
    try:
        config = ModelConfig.checked_from_dict(manifest["model_config"])
    except (ValueError, TypeError) as e:
        raise malformed(path, "model_config", str(e)) from None
    build = _check_build_options(manifest["build_options"], config, path)
    _check_program_entry(manifest["program"], path)
    if build.pipeline_parallel_size > 1:
        _check_pipeline(manifest.get("pipeline"), build.pipeline_parallel_size, config, path)
    if build.decode_backend == "megakernel":
        entry = manifest.get("megakernel")
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or path_problem(entry["file"]) is not None:
            raise malformed(path, "megakernel", "a megakernel engine names its schedule's file")
    check_files_map(manifest["files"], path)
    kernels = manifest["kernels"]
    if not is_map(kernels) or len(kernels) > MAX_KERNEL_ENTRIES or any(
            len(k) > 128 or len(v) > 128 for k, v in kernels.items()):
        raise malformed(path, "kernels")
    source = manifest.get("source")
    if not (source is None or is_map(source, (str, type(None)))):
        raise malformed(path, "source")
    for key in ("tokenizer", "kernel_cache"):
        value = manifest.get(key)
        if value is not None and (not isinstance(value, str) or path_problem(value) is not None):
            raise malformed(path, key)
    return config


def check_older_manifest(manifest: dict, version: int, path: Path) -> None:
    """A manifest of an older format that its writer would have written: its keys, a program
    entry naming a listed file, and a ``files`` map of sha256 digests."""
    check_required_keys(manifest, version, path)
    for key in ("model_config", "build_options", "program", "kernels"):
        if not isinstance(manifest[key], dict):
            raise malformed(path, key)
    _build_config(manifest["build_options"], path)  # BuildConfig reads what every format wrote
    check_files_map(manifest["files"], path)
    if manifest["program"].get("file") not in manifest["files"]:
        raise malformed(path, "program", "its file is not one the manifest lists")


def _check_build_options(opts: Any, config: ModelConfig, path: Path) -> BuildConfig:
    """The build options as a ``BuildConfig`` (which checks each one's type and choices), with a
    length and a tensor-parallel size this model can have."""
    build = _build_config(opts, path)
    if not 2 <= build.max_model_len <= config.max_position_embeddings:
        raise malformed(path, "build_options",
                        f"max_model_len must be an integer in 2..{config.max_position_embeddings}")
    try:
        sharding.plan(config, build.tensor_parallel_size)
    except CompiledLLMError as e:
        raise malformed(path, "build_options", f"tensor_parallel_size {build.tensor_parallel_size}: {e}") from None
    return build


def _build_config(opts: Any, path: Path) -> BuildConfig:
    try:
        return BuildConfig.from_manifest(opts)
    except InvalidOptionError as e:
        raise malformed(path, "build_options", str(e)) from None


def _check_pipeline(pipeline: Any, size: int, config: ModelConfig, path: Path) -> None:
    """A pipelined engine's stages: one program entry each, their layers in order and all of
    them, and counts of the activations each takes and returns."""
    stages = pipeline.get("stages") if isinstance(pipeline, dict) else None
    if not isinstance(stages, list) or len(stages) != size:
        raise malformed(path, "pipeline", f"it does not list the {size} stages of pipeline_parallel_size {size}")
    layer = 0
    for k, stage in enumerate(stages):
        _check_program_entry(stage, path)
        counts = [stage.get(key) for key in ("first_layer", "num_layers", "inputs", "outputs")]
        if not all(type(c) is int and 0 <= c <= 1 << 16 for c in counts) or counts[0] != layer or counts[1] < 1:
            raise malformed(path, "pipeline", f"stage {k}'s layers or activation counts are not valid")
        if k > 0 and counts[2] != stages[k - 1].get("outputs"):
            raise malformed(path, "pipeline", f"stage {k} takes {counts[2]} activations but stage {k - 1} sends "
                                              f"{stages[k - 1].get('outputs')}")
        layer += counts[1]
    if stages[0].get("inputs") != 0 or stages[-1].get("outputs") != 1:
        raise malformed(path, "pipeline", "the first stage must take no activations and the last return the logits alone")
    if layer != config.num_layers:
        raise malformed(path, "pipeline", f"its stages hold {layer} of the model's {config.num_layers} layers")


def _check_program_entry(program: Any, path: Path) -> None:
    if not isinstance(program, dict) or not isinstance(program.get("file"), str):
        raise malformed(path, "program")
    names = program.get("param_names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise malformed(path, "program")
    if len(names) > MAX_PARAMS or any(not n or len(n) > MAX_PARAM_NAME_CHARS for n in names):
        raise malformed(path, "program", "param_names holds an empty or overlong name, or too many")
    if len(set(names)) != len(names):
        raise malformed(path, "program", "param_names names a weight twice")


def is_map(value: Any, values: type | tuple = str) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, values) for k, v in value.items())
