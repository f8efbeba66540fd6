"""The engine artifact: a directory that is all ``run`` needs, and its validating loader.

    manifest.json          format version, model config, build options, versions, passes with
                           match counts, kernel choices, batch buckets, sha256 of every file
    weights.safetensors    post-pass weights (merged qkv / gate_up stored once)
    program.pt2            torch.export.save of the post-pass program, weights as inputs
    inductor_cache.bin     (CUDA builds) torch.compiler cache artifacts of the compiled program
    ir/                    IR dumps: NN_<stage>.py (graph code), NN_<stage>.ops.json (op histogram)
    tokenizer/             tokenizer files, when the source has a tokenizer

``load_engine`` refuses a missing file, a checksum mismatch, a format from the future or an
engine built for another device with a one-line EngineError; a compiled cache that does not fit
this machine falls back to the portable program with a warning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from compiled_llm.config import ModelConfig
from compiled_llm.errors import EngineError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS_FILE = "weights.safetensors"
PROGRAM_FILE = "program.pt2"
INDUCTOR_CACHE_FILE = "inductor_cache.bin"
IR_DIR = "ir"
TOKENIZER_DIR = "tokenizer"


@dataclasses.dataclass(frozen=True)
class LoadedEngine:
    engine_dir: Path
    config: ModelConfig
    manifest: dict
    params: dict[str, Tensor]  # post-pass names, on device
    program: Callable  # program(params, batch: PackedBatch, kv_cache) -> logits[S, V]
    dtype: torch.dtype
    device: torch.device
    tokenizer_dir: Path | None
    source_dir: Path | None
    backend: str  # "portable" or "inductor" (what actually runs, after any fallback)

    @property
    def max_model_len(self) -> int:
        return int(self.manifest["build_options"]["max_model_len"])

    @property
    def batch_buckets(self) -> list[int]:
        return list(self.manifest.get("batch_buckets", []))


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def _versions() -> dict[str, Any]:
    import compiled_llm

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "compiled_llm": getattr(compiled_llm, "__version__", "0.1.0"),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
    }


def make_manifest(*, config, source, build_options, lowered, backend, buckets, stage_seconds) -> dict:
    hist = lowered.histograms
    stages = list(hist)
    return {
        "format_version": FORMAT_VERSION,
        "model_config": config.to_dict(),
        "source": source,
        "build_options": build_options,
        "versions": _versions(),
        "passes": [r.to_dict() for r in lowered.results],
        "ir_stages": stages,
        "ops_before": hist[stages[0]],
        "ops_after": hist[stages[-1]],
        "kernels": lowered.kernels,
        "program": {"file": PROGRAM_FILE, "param_names": lowered.param_names},
        "backend": backend,
        "batch_buckets": list(buckets),
        "stage_seconds": {k: round(v, 4) for k, v in stage_seconds.items()},
    }


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _all_files(engine_dir: Path) -> list[str]:
    return sorted(
        str(p.relative_to(engine_dir)) for p in engine_dir.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def save_engine(engine_dir: Path, manifest: dict, params: dict[str, Tensor], tokenizer=None) -> None:
    """Write weights, tokenizer and the manifest (with checksums of everything else) into
    ``engine_dir``, which already holds the program and ir/."""
    from safetensors.torch import save_file

    engine_dir = Path(engine_dir)
    save_file({n: t.detach().contiguous().cpu() for n, t in params.items()}, str(engine_dir / WEIGHTS_FILE),
              metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(engine_dir / TOKENIZER_DIR)
    manifest = dict(manifest)
    manifest["tokenizer"] = TOKENIZER_DIR if tokenizer is not None else None
    manifest["files"] = {f: sha256_file(engine_dir / f) for f in _all_files(engine_dir)}
    (engine_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def read_manifest(engine_dir: str | Path) -> dict:
    """The manifest, checked for shape and format version (files are not verified here)."""
    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir():
        raise EngineError(f"engine directory {engine_dir} does not exist")
    path = engine_dir / MANIFEST
    if not path.is_file():
        raise EngineError(f"{engine_dir} is not an engine: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngineError(f"{path} is not valid JSON ({e}); rebuild the engine") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("format_version"), int):
        raise EngineError(f"{path} has no format_version; rebuild the engine")
    version = manifest["format_version"]
    if version > FORMAT_VERSION:
        raise EngineError(
            f"engine format version {version} is newer than this compiled_llm supports ({FORMAT_VERSION}); "
            "upgrade compiled_llm or rebuild the engine"
        )
    if version < 1:
        raise EngineError(f"engine format version {version} is not valid; rebuild the engine")
    for key in ("model_config", "build_options", "program", "files", "backend", "kernels"):
        if key not in manifest:
            raise EngineError(f"{path} lacks {key!r}; rebuild the engine")
    return manifest


def verify_files(engine_dir: Path, manifest: dict) -> None:
    """Every file the manifest lists exists with its checksum; no listed file is missing."""
    for rel, digest in manifest["files"].items():
        path = engine_dir / rel
        if not path.is_file():
            raise EngineError(f"engine file {rel} is missing from {engine_dir}; rebuild the engine")
        if sha256_file(path) != digest:
            raise EngineError(f"engine file {rel} fails its checksum (corrupt or modified); rebuild the engine")
    for required in (WEIGHTS_FILE, manifest["program"]["file"]):
        if required not in manifest["files"]:
            raise EngineError(f"manifest of {engine_dir} does not list {required}; rebuild the engine")


def _config(manifest: dict) -> ModelConfig:
    try:
        return ModelConfig.from_dict(manifest["model_config"])
    except (TypeError, KeyError) as e:
        raise EngineError(f"manifest model_config is not valid ({e}); rebuild the engine") from None


def _device(manifest: dict, device: str | torch.device | None) -> torch.device:
    built_for = manifest["build_options"]["device"]
    dev = torch.device(device) if device is not None else torch.device(built_for)
    if dev.type != built_for:
        raise EngineError(f"engine was built for {built_for} but {dev.type} was asked for; rebuild with --device {dev.type}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError("engine was built for cuda but no CUDA device is available here")
    return dev


def _check_kernels(manifest: dict) -> None:
    from compiled_llm.kernels import registry

    registry.load_providers()
    for op, provider in manifest["kernels"].items():
        try:
            registry.get_provider(op, provider)
        except Exception:
            failed = registry.failed_provider_modules()
            why = f" (provider modules that failed to import: {', '.join(failed)})" if failed else ""
            raise EngineError(
                f"engine uses kernel {provider!r} for cllm::{op}, which is not available here{why}"
            ) from None


def _load_program(engine_dir: Path, manifest: dict) -> torch.fx.GraphModule:
    path = engine_dir / manifest["program"]["file"]
    try:
        ep = torch.export.load(str(path))
    except Exception as e:
        raise EngineError(f"cannot load {path.name} ({type(e).__name__}); rebuild the engine") from None
    return ep.graph_module


def _load_weights(engine_dir: Path, manifest: dict, device: torch.device) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(engine_dir / WEIGHTS_FILE), device=str(device))
    except Exception as e:
        raise EngineError(f"cannot read {WEIGHTS_FILE} ({type(e).__name__}); rebuild the engine") from None
    names = manifest["program"]["param_names"]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise EngineError(f"{WEIGHTS_FILE} lacks {missing[0]!r} that the program reads; rebuild the engine")
    # safetensors may hand out views of one shared buffer (CPU); compiled graphs would then see
    # storage-offset symbols the build never saw and miss their cache. Own storage per weight.
    return {n: tensors[n].clone() if tensors[n]._base is not None else tensors[n] for n in names}


def choose_backend(manifest: dict, device: torch.device, backend: str | None) -> tuple[str, str | None]:
    """(backend to run, warning or None). The saved Inductor result is used only when it was
    built on this kind of machine; otherwise the portable program runs."""
    from compiled_llm import backend as backends

    info = manifest["backend"]
    wanted = backend or info.get("kind", backends.PORTABLE)
    if wanted not in backends.BACKENDS:
        raise EngineError(f"unknown backend {wanted!r}; choose portable or inductor")
    if wanted == backends.PORTABLE:
        return backends.PORTABLE, None
    if info.get("kind") != backends.INDUCTOR or not info.get("cache_file"):
        return backends.PORTABLE, "engine holds no compiled program; running the portable program"
    reason = backends.fingerprint_mismatch(info.get("fingerprint", {}), backends.machine_fingerprint(device))
    if reason is not None:
        return backends.PORTABLE, f"compiled program does not fit this machine ({reason}); running the portable program"
    return backends.INDUCTOR, None


def load_engine(
    engine_dir: str | Path,
    device: str | torch.device | None = None,
    backend: str | None = None,
    verify: bool = True,
) -> LoadedEngine:
    """Validate and load an engine directory. ``backend`` overrides the manifest's ("portable"
    forces the uncompiled program)."""
    from compiled_llm import backend as backends

    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    if verify:
        verify_files(engine_dir, manifest)
    config = _config(manifest)
    dev = _device(manifest, device)
    dtype = getattr(torch, manifest["build_options"]["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise EngineError(f"manifest dtype {manifest['build_options']['dtype']!r} is not valid; rebuild the engine")
    _check_kernels(manifest)
    gm = _load_program(engine_dir, manifest)
    params = _load_weights(engine_dir, manifest, dev)
    names = manifest["program"]["param_names"]

    kind, warning = choose_backend(manifest, dev, backend)
    if warning:
        warnings.warn(warning, stacklevel=2)
    if kind == backends.INDUCTOR:
        try:
            backends.load_compiled(engine_dir / manifest["backend"]["cache_file"])
            program = backends.InductorProgram(gm, names)
        except Exception as e:
            warnings.warn(f"loading the compiled program failed ({type(e).__name__}); running the portable program")
            kind, program = backends.PORTABLE, backends.PortableProgram(gm, names)
    else:
        program = backends.PortableProgram(gm, names)

    tok = manifest.get("tokenizer")
    source_dir = manifest.get("source", {}).get("model_dir")
    return LoadedEngine(
        engine_dir=engine_dir,
        config=config,
        manifest=manifest,
        params=params,
        program=program,
        dtype=dtype,
        device=dev,
        tokenizer_dir=engine_dir / tok if tok else None,
        source_dir=Path(source_dir) if source_dir and Path(source_dir).is_dir() else None,
        backend=kind,
    )
