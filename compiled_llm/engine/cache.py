"""The engine cache: a model source is built once, and loaded from its engine afterwards.

``compiled-llm run SOURCE`` and ``LLM(SOURCE)`` (SOURCE a checkpoint directory, a preset or a hub
id; anything but an engine directory) call ``cached_engine``. The first use of a source with a
given set of build options builds it (``compiled_llm.engine.build.build_engine``) into

    <root>/engines/<name>-<key16>

and every later use, in any process, finds that engine and loads it without building.

root: ``$COMPILED_LLM_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/compiled_llm``, else
``~/.cache/compiled_llm``. <name> is a file-name-safe form of the source's name, <key16> the
first 16 hex digits of the key.

The key (``engine_key``) is the sha256 of a canonical JSON (sorted keys, no spaces) of:

- the source: a preset's name; for a checkpoint directory (a hub id's local snapshot included)
  every file's relative path with the sha256 of its content, or, for files over 64 MiB, their
  size, mtime_ns and the sha256 of their first and last MiB;
- the build options (``BuildConfig``), resolved (never "auto"): dtype, device type,
  max_model_len, disabled passes, kernel preferences, and the quantization, tensor-parallel
  size and ``dump_ir`` when they are not their defaults;
- the versions: compiled_llm (and a hash of its own source files, so an edited pass or kernel
  never serves an engine built by the old code), torch, triton when importable, and the GPU
  architecture on CUDA.

So a changed weight file, a changed option or a different install gives a new engine instead of
a stale one. Two processes asking for the same engine serialise on an exclusive ``flock`` of
``<root>/engines/<name>-<key16>.lock``: the second waits while the first builds, then loads what
it built. Nothing here deletes old entries; remove their directories to reclaim the space.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Iterator

import torch

from compiled_llm.engine.artifact import build_config, package_version, read_manifest
from compiled_llm.engine.build import WarmUp, build_engine, resolve_config
from compiled_llm.engine.build_config import BuildConfig
from compiled_llm.cache_dir import cache_root
from compiled_llm.errors import EngineError
from compiled_llm.model.sources import resolve_source

log = logging.getLogger(__name__)

KEY_VERSION = 1  # bump when the key's layout changes
KEY_CHARS = 16
FULL_HASH_MAX_BYTES = 64 << 20
EDGE_BYTES = 1 << 20
_CODE_SUFFIXES = (".py", ".cu", ".cuh", ".cpp", ".c", ".h")


def engines_dir() -> Path:
    return cache_root() / "engines"


# ---------------------------------------------------------------------------------------------
# The key
# ---------------------------------------------------------------------------------------------


def _sha256(path: Path, limit: int | None = None, tail: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if limit is None:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        else:
            if tail:
                f.seek(max(os.fstat(f.fileno()).st_size - limit, 0))
            h.update(f.read(limit))
    return h.hexdigest()


def file_fingerprint(path: Path) -> dict:
    """What the key records of one checkpoint file."""
    st = path.stat()
    if st.st_size <= FULL_HASH_MAX_BYTES:
        return {"size": st.st_size, "sha256": _sha256(path)}
    # A real model's weights are gigabytes: hashing them all on every start would cost seconds
    # (about one per GB) on every run and every LLM(...). Size + mtime_ns catch a rewritten file;
    # the first MiB (a safetensors header: every tensor's name, dtype, shape and offsets) and the
    # last MiB catch most edits that kept both.
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "head_sha256": _sha256(path, EDGE_BYTES),
        "tail_sha256": _sha256(path, EDGE_BYTES, tail=True),
    }


def source_fingerprint(src) -> dict:
    """What the key records of a ``sources.ModelSource``: a preset's name, or a checkpoint
    directory's files. Hidden files and directories (.git, huggingface_hub's .cache/) are
    bookkeeping, not the model, and are left out."""
    if src.model_dir is None:
        return {"preset": src.preset}
    root = Path(src.model_dir)
    files = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        files[rel.as_posix()] = file_fingerprint(path)
    return {"checkpoint_files": files}


@functools.lru_cache(maxsize=None)
def _code_hash() -> str:
    """sha256 of compiled_llm's own source files (the passes, spec and kernels an engine is made of)."""
    root = Path(__file__).resolve().parents[1]  # the compiled_llm package
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in _CODE_SUFFIXES and "__pycache__" not in path.parts and path.is_file():
            h.update(path.relative_to(root).as_posix().encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def versions(device: torch.device) -> dict:
    """The versions an engine depends on (the key's "versions")."""
    try:
        import triton  # optional: CPU installs may not have it

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    arch = None
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        arch = f"sm_{major}{minor}"
    return {
        "compiled_llm": package_version(),
        "compiled_llm_code": _code_hash(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "gpu_arch": arch,
    }


def key_payload(src, resolved: BuildConfig, device: torch.device) -> dict:
    """Everything the key hashes, of a config ``resolve_config`` resolved (no "auto", no unset
    length) for ``device``."""
    build = {
        "dtype": resolved.dtype,
        "device": device.type,
        "max_model_len": int(resolved.max_model_len),
        "disabled_passes": sorted(set(resolved.disabled_passes)),
        "kernel_prefs": dict(sorted(resolved.kernel_prefs.items())),
    }
    # options at their defaults are left out, so that the entries built before each option
    # existed keep their keys
    if resolved.quantization is not None:
        build["quantization"] = resolved.quantization
    if resolved.tensor_parallel_size != 1:
        build["tensor_parallel_size"] = resolved.tensor_parallel_size
    if resolved.pipeline_parallel_size != 1:
        build["pipeline_parallel_size"] = resolved.pipeline_parallel_size
    if resolved.dump_ir:
        build["dump_ir"] = True
    if resolved.load_format != "auto":  # a dummy engine's weights are random: never the checkpoint's entry
        build["load_format"] = resolved.load_format
    if resolved.decode_backend != "per-op":
        build["decode_backend"] = resolved.decode_backend
    return {
        "key_version": KEY_VERSION,
        "source": source_fingerprint(src),
        "build": build,
        "versions": versions(device),
        "device": device.type,
    }


def engine_key(payload: dict) -> str:
    """sha256 (hex) of ``payload`` as canonical JSON."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _entry_name(src) -> str:
    """<name> of an entry: the preset, the hub id (org--name), or the checkpoint directory's name."""
    if src.preset is not None:
        raw = src.preset
    elif Path(src.name).expanduser().is_dir():
        raw = Path(src.model_dir).resolve().name
    else:
        raw = src.name.replace("/", "--")
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", raw).strip("-.")[:64]
    return name or "model"


# ---------------------------------------------------------------------------------------------
# Lookup and build
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as f:  # "a": create it if missing, never truncate
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that is building %s", lock_path.with_suffix(""))
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _usable_entry(path: Path, warmed: bool) -> bool:
    """An engine (its manifest reads), and with ``warmed`` not a CUDA entry built without the
    kernel warm-up (by a caller that gave none), which every load would pay for by compiling
    its kernels."""
    try:
        manifest = read_manifest(path)
    except EngineError:
        return False
    return not (warmed and build_config(manifest).device_type == "cuda" and manifest.get("kernel_cache") is None)


def _plan(source, config: BuildConfig):
    src = resolve_source(str(source))
    resolved, dev, _ = resolve_config(config, src)
    path = engines_dir() / f"{_entry_name(src)}-{engine_key(key_payload(src, resolved, dev))[:KEY_CHARS]}"
    return src, resolved, path


def engine_path(source: str, config: BuildConfig | None = None, **options) -> Path:
    """Where ``cached_engine`` keeps (or would build) the engine of ``source`` built as
    ``config`` says (or, for short, its fields as keyword ``options``); builds nothing."""
    return _plan(source, _config(config, options))[-1]


def cached_engine(
    source: str,
    config: BuildConfig | None = None,
    *,
    progress: bool | None = None,
    warm_up: WarmUp | None = None,
    **options,
) -> Path:
    """The engine directory of ``source`` built as ``config`` says (or, for short, its fields as
    keyword ``options``): the cached one, or built now (under the entry's lock) when there is
    none or it is not a valid engine. ``progress``: build progress bars; None (the default)
    shows them when stderr is a terminal. ``warm_up``: the CUDA kernel warm-up ``build_engine``
    runs (``warm_kernels`` of ``serve/kernel_warmup.py``, passed by the runtime's layer)."""
    src, resolved, path = _plan(source, _config(config, options))
    path.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(path.parent / f"{path.name}.lock"):
        if _usable_entry(path, warmed=warm_up is not None):
            log.debug("using the cached engine %s for %s", path, src.name)
            return path
        if path.exists():  # not an engine (say, its manifest was damaged), or a CUDA entry built
            shutil.rmtree(path)  # without the kernel warm-up it is now given: build it afresh
        log.info("building engine for %s into %s (first use; cached for next time)", src.name, path)
        build_engine(str(source), path, resolved, progress=sys.stderr.isatty() if progress is None else progress,
                     warm_up=warm_up)
    return path


def _config(config: BuildConfig | None, options: dict) -> BuildConfig:
    if config is None:
        return BuildConfig.from_options(options)
    if options:
        raise TypeError(f"give a BuildConfig or its options, not both ({', '.join(options)})")
    return config
