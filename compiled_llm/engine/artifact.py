"""The engine artifact: a directory that is all ``run`` needs, and its validating loader.

    manifest.json          format version, model config, build options, versions, passes with
                           match counts, kernel choices, sha256 of every file, and what the
                           source's generation_config.json says (sampling defaults, EOS ids)
    weights.safetensors    post-pass weights (merged qkv / gate_up stored once); a
                           tensor-parallel engine's are weights.rank<R>.safetensors, a pipelined
                           one's weights.stage<K>[.rank<R>].safetensors (a stage's layers only)
    program.json           the post-pass graph as plain data (graph/serialize.py): no pickle,
                           no constants (weights are inputs); a pipelined engine has one
                           program.stage<K>.json per stage instead, listed in the manifest's
                           ``pipeline`` entry with the layers each holds
    megakernel.json        (``--decode-backend megakernel``) the decode step's schedule: ops, tiles,
                           SMs and dependency counters as plain data (megakernel/schedule.py)
    kernels/triton/        (CUDA builds) Triton's compile cache, warmed by the build on every
                           kernel specialisation the runtime launches; GPU code (cubins)
    ir/                    IR dumps: NN_<stage>.py (graph code), NN_<stage>.ops.json (op histogram)
    tokenizer/             tokenizer files, when the source has a tokenizer

Loading never unpickles: the manifest and program are JSON, weights are safetensors, the
tokenizer is JSON/text (or a sentencepiece protobuf). Every path the manifest names must stay
inside the engine directory (no ``..``, no absolute path, no symlink), and a listed file that
carries a pickle or a zip archive (torch.save, .pt2) is refused. Checksums detect corruption,
not tampering: whoever writes an engine writes its manifest.

``load_engine`` refuses a missing file, a checksum mismatch, a format it does not read or an
engine built for another device with a one-line EngineError. Between the files and the engine
sits one validation layer, each check in a module of its own: every file's size before it is
read (limits.py), every manifest field's type and range (manifest_check.py), program.json against
the program's schema (graph/program_check.py) and the weights' safetensors header against the
config (weights_header.py); the program's first step checks that it runs (program.py).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import threading
import time
from pathlib import Path, PurePosixPath
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from compiled_llm.engine import dummy_weights, kernel_cache, limits, manifest_check, weights_header
from compiled_llm.engine.build_config import BuildConfig
from compiled_llm.engine.loaded_model import LoadedModel
from compiled_llm.engine.pipeline_stage import PipelineStage
from compiled_llm.engine.program import PortableProgram
from compiled_llm.errors import EngineError
from compiled_llm.graph.logits_rows import yields_chosen_rows
from compiled_llm.graph.serialize import graph_from_json, graph_to_json
from compiled_llm.kernels import registry
from compiled_llm.megakernel.check import ScheduleError, check_matches_program, check_schedule, check_weights
from compiled_llm.megakernel.program import MegakernelProgram, check_fits
from compiled_llm.megakernel.schedule import Schedule, schedule_from_json, schedule_to_json
from compiled_llm.model import sharding
from compiled_llm.model.config import ModelConfig
from compiled_llm.model.sources import checked_generation_default
from compiled_llm.model.tokenizer import load_tokenizer

# 2: program.json replaced program.pt2 (pickle-free), kernels/triton added, Inductor cache gone
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
WEIGHTS_FILE = "weights.safetensors"
PROGRAM_FILE = "program.json"
MEGAKERNEL_FILE = "megakernel.json"
IR_DIR = "ir"
TOKENIZER_DIR = "tokenizer"
# First bytes of what pickle-based formats write: a pickle stream (protocol 2-5) or a zip archive
# (torch.save, torch.export's .pt2). safetensors files are checked by their own parser instead:
# their first 8 bytes are a header length that may start with these bytes.
_PICKLE_MAGIC = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"PK\x03\x04")


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def package_version() -> str | None:
    """compiled_llm's installed version; None when it runs from a checkout that is not
    installed (through PYTHONPATH)."""
    try:
        return importlib.metadata.version("compiled_llm")
    except importlib.metadata.PackageNotFoundError:
        return None


def _versions() -> dict[str, Any]:
    try:
        import triton  # optional: CPU installs may not have it

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "compiled_llm": package_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
    }


def generation_config_entry(defaults: dict[str, int | float], eos_token_ids) -> dict:
    """The manifest's ``generation_config``: the source's sampling defaults (SamplingParams
    names) and end-of-sequence ids from its generation_config.json, so that a loaded engine
    needs no source checkpoint. Engines from before it have no such entry."""
    return {"defaults": dict(defaults), "eos_token_ids": [int(i) for i in eos_token_ids]}


def make_manifest(*, config, source, build_options, lowered, stage_seconds, generation_config=None) -> dict:
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
        "kernel_cache": None,  # KERNELS_DIR once a CUDA build has warmed it
        "stage_seconds": {k: round(v, 4) for k, v in stage_seconds.items()},
        "generation_config": generation_config or generation_config_entry({}, ()),
    }


def write_program(engine_dir: Path, gm: torch.fx.GraphModule, name: str = PROGRAM_FILE) -> None:
    """The post-pass graph as ``program.json`` (see graph/serialize.py), or a pipeline stage's
    as ``name``."""
    (Path(engine_dir) / name).write_text(json.dumps(graph_to_json(gm), separators=(",", ":")) + "\n")


def write_schedule(engine_dir: Path, schedule: Schedule) -> dict:
    """The megakernel schedule as ``megakernel.json``; returns the manifest's ``megakernel`` entry."""
    (Path(engine_dir) / MEGAKERNEL_FILE).write_text(json.dumps(schedule_to_json(schedule), separators=(",", ":")) + "\n")
    return {"file": MEGAKERNEL_FILE, "num_sms": schedule.num_sms, "max_rows": schedule.max_rows,
            "instructions": len(schedule.instructions), "counters": schedule.num_counters,
            "estimated_step_us": round(max((i.end_us for i in schedule.instructions), default=0.0), 3)}


def load_schedule(engine_dir: Path, manifest: dict) -> Schedule:
    """The engine's megakernel schedule, refused (one line) unless it is well formed and safe
    (megakernel/check.py)."""
    rel = manifest["megakernel"]["file"]
    if rel not in manifest["files"]:
        raise EngineError(f"manifest of {engine_dir} does not list {rel}; rebuild the engine")
    data = limits.read_capped(inside(engine_dir, rel), rel, limits.MAX_PROGRAM_BYTES)
    try:
        data = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise EngineError(f"cannot read {rel} as JSON ({type(e).__name__}); rebuild the engine") from None
    schedule = schedule_from_json(data)
    try:
        check_schedule(schedule)
    except ScheduleError as e:
        raise EngineError(f"{rel}: {e}; rebuild the engine") from None
    return schedule


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _all_files(engine_dir: Path) -> list[str]:
    return sorted(
        p.relative_to(engine_dir).as_posix() for p in engine_dir.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def weights_file(rank: int = 0, tp_size: int = 1, stage: int = 0, pp_size: int = 1) -> str:
    """The weights file of one tensor-parallel rank (of one pipeline stage): each rank reads
    only its own."""
    if pp_size > 1:
        return f"weights.stage{stage}.safetensors" if tp_size == 1 else f"weights.stage{stage}.rank{rank}.safetensors"
    return WEIGHTS_FILE if tp_size == 1 else f"weights.rank{rank}.safetensors"


def stage_program_file(stage: int) -> str:
    return f"program.stage{stage}.json"


def pp_size_of(manifest: dict) -> int:
    return build_config(manifest).pipeline_parallel_size


def program_entry(manifest: dict, stage: int = 0) -> dict:
    """The manifest's entry of the program stage ``stage`` runs: ``file`` and ``param_names``
    (and for a pipeline stage its ``first_layer``, ``num_layers``, ``inputs`` and ``outputs``)."""
    if pp_size_of(manifest) == 1:
        return manifest["program"]
    return manifest["pipeline"]["stages"][stage]


def all_weights_files(manifest: dict) -> list[str]:
    tp, pp = tp_size_of(manifest), pp_size_of(manifest)
    return [weights_file(r, tp, s, pp) for s in range(pp) for r in range(tp)]


def build_config(manifest: dict) -> BuildConfig:
    """The config the engine of ``manifest`` (one ``read_manifest`` checked) was built with."""
    return BuildConfig.from_manifest(manifest["build_options"])


def tp_size_of(manifest: dict) -> int:
    return build_config(manifest).tensor_parallel_size


def save_weights(engine_dir: Path, params: dict[str, Tensor], name: str = WEIGHTS_FILE,
                 metadata: dict[str, str] | None = None) -> None:
    save_file({n: t.detach().contiguous().cpu() for n, t in params.items()}, str(Path(engine_dir) / name),
              metadata={"format": "pt", **(metadata or {})})


def save_engine(engine_dir: Path, manifest: dict, params: dict[str, Tensor] | None, tokenizer=None,
                weights_metadata: dict[str, str] | None = None) -> None:
    """Write weights (unless None: a sharded build wrote each rank's already), tokenizer and
    the manifest (with checksums of everything else) into ``engine_dir``, which already holds
    the program, ir/ and any kernels."""
    engine_dir = Path(engine_dir)
    if params is not None:
        save_weights(engine_dir, params, metadata=weights_metadata)
    if tokenizer is not None:
        tokenizer.save(engine_dir / TOKENIZER_DIR)
    write_manifest(engine_dir, {**manifest, "tokenizer": TOKENIZER_DIR if tokenizer is not None else None})


def write_manifest(engine_dir: Path, manifest: dict) -> dict:
    """Write ``manifest`` with the checksum of every file in the engine (files it already
    lists keep their checksum: only the build writes into its engine); returns it."""
    engine_dir = Path(engine_dir)
    known = manifest.get("files") or {}
    manifest = {**manifest, "files": {f: known.get(f) or sha256_file(engine_dir / f) for f in _all_files(engine_dir)}}
    (engine_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def read_manifest(engine_dir: str | Path) -> dict:
    """The manifest, checked for shape, format version and paths (files are not verified here)."""
    engine_dir = Path(engine_dir)
    manifest, version = _read_manifest_file(engine_dir)
    path = engine_dir / MANIFEST
    if version > FORMAT_VERSION:
        raise EngineError(
            f"{path}: engine format version {version} is newer than this compiled_llm supports ({FORMAT_VERSION}); "
            "upgrade compiled_llm or rebuild the engine"
        )
    if version < FORMAT_VERSION:
        raise EngineError(
            f"{path}: engine format version {version} is older than this compiled_llm reads ({FORMAT_VERSION}); "
            "rebuild the engine"
        )
    manifest_check.check_current_manifest(manifest, path)
    if not _is_generation_config(manifest.get("generation_config")):
        raise manifest_check.malformed(path, "generation_config")
    _check_paths(engine_dir, manifest)
    return manifest


def read_older_manifest(engine_dir: str | Path) -> dict | None:
    """The manifest of an engine that an earlier compiled_llm wrote (a known older format
    version, which loads no more but may be rebuilt in place), checked as strictly as its
    writer wrote it: an EngineError when it falls short, None when its format version is not a
    known older one."""
    engine_dir = Path(engine_dir)
    manifest, version = _read_manifest_file(engine_dir)
    path = engine_dir / MANIFEST
    if version >= FORMAT_VERSION or version not in manifest_check.REQUIRED_KEYS:
        return None
    manifest_check.check_older_manifest(manifest, version, path)
    _check_paths(engine_dir, manifest)
    return manifest


def _read_manifest_file(engine_dir: Path) -> tuple[dict, int]:
    """(the manifest's JSON object, its format version), read within its size cap."""
    if not engine_dir.is_dir():
        raise EngineError(f"engine directory {engine_dir} does not exist")
    path = engine_dir / MANIFEST
    if path.is_symlink() or not path.is_file():
        raise EngineError(f"{engine_dir} is not an engine: {MANIFEST} is missing")
    data = limits.read_capped(path, MANIFEST, limits.MAX_MANIFEST_BYTES)
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON, bad UTF-8, a 5,000-digit number
        raise EngineError(f"{path} is not valid JSON ({type(e).__name__}); rebuild the engine") from None
    if not isinstance(manifest, dict) or type(manifest.get("format_version")) is not int:
        raise EngineError(f"{path} has no format_version; rebuild the engine")
    return manifest, manifest["format_version"]


def _check_paths(engine_dir: Path, manifest: dict) -> None:
    program = manifest["program"]
    for rel in (*manifest["files"], program.get("file"), manifest.get("tokenizer"), manifest.get("kernel_cache")):
        if rel is not None:
            inside(engine_dir, rel)


def _is_generation_config(entry: Any) -> bool:
    """Absent (an engine from before generation defaults), or exactly what
    ``generation_config_entry`` writes: known sampling fields with values SamplingParams
    accepts, stored as they were checked (a value that needs converting was not written by a
    build), and integer EOS ids."""
    if entry is None:
        return True
    if not isinstance(entry, dict) or set(entry) != {"defaults", "eos_token_ids"}:
        return False
    defaults, eos = entry["defaults"], entry["eos_token_ids"]
    if not manifest_check.is_map(defaults, (int, float)) or not isinstance(eos, list):
        return False
    for name, value in defaults.items():
        try:
            checked = checked_generation_default(name, value)
        except ValueError:
            return False
        if type(checked) is not type(value) or checked != value:
            return False
    return all(isinstance(i, int) and not isinstance(i, bool) for i in eos)


def inside(engine_dir: Path, rel: Any) -> Path:
    """``engine_dir / rel`` when ``rel`` is a relative path that stays inside the engine and
    crosses no symlink; otherwise an EngineError naming it."""
    if not isinstance(rel, str) or not rel:
        raise EngineError(f"manifest names a path {str(rel)[:40]!r} that is not a relative path; refusing to load")
    why = manifest_check.path_problem(rel)
    if why is not None:  # checked before any stat: a 5,000-character name fails in the OS
        raise EngineError(f"manifest names {why}; refusing to load")
    parts = PurePosixPath(rel).parts
    if rel.startswith(("/", "\\")) or PurePosixPath(rel).is_absolute() or ".." in parts or "\\" in rel or ":" in rel:
        raise EngineError(f"manifest path {rel!r} leaves the engine directory; refusing to load")
    path = engine_dir
    for part in parts:
        path = path / part
        if path.is_symlink():
            raise EngineError(f"manifest path {rel!r} goes through a symlink; refusing to load")
    return path


def unlisted_in_folder(engine_dir: Path, folder: str, files) -> str | None:
    """The first entry under ``folder`` (one the engine reads whole, as the tokenizer's) that is
    a link, or a file ``files`` does not list; None when there is none, or no such folder."""
    root = engine_dir / folder
    if root.is_symlink() or not root.is_dir():
        return None
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(engine_dir).as_posix()
        if path.is_symlink() or (not path.is_dir() and rel not in files):
            return rel
    return None


def check_listed_files(engine_dir: Path, manifest: dict) -> None:
    """Every file the manifest lists is present (and the ones a load needs are listed), and
    none but the weights starts like a pickle or a zip archive (torch.save, .pt2): the loader
    reads no such format, so an engine carrying one is refused rather than trusted. The
    safetensors header is checked by its own parser: its first bytes are a length."""
    programs = [program_entry(manifest, s)["file"] for s in range(pp_size_of(manifest))]
    for required in (*all_weights_files(manifest), *programs):
        if required not in manifest["files"]:
            raise EngineError(f"manifest of {engine_dir} does not list {required}; rebuild the engine")
    tok = manifest.get("tokenizer")
    if tok:  # the tokenizer loader reads its directory, not a file list: all of it must be listed
        inside(engine_dir, tok)
        rel = unlisted_in_folder(engine_dir, tok, manifest["files"])
        if rel is not None:
            raise EngineError(f"engine file {rel} is not one the manifest lists; refusing to load (the engine's "
                              f"{tok}/ holds only its own files: move yours out of it)")
    for rel in manifest["files"]:
        path = inside(engine_dir, rel)
        if not path.is_file():
            raise EngineError(f"engine file {rel} is missing from {engine_dir}; rebuild the engine")
        cap = limits.file_cap(rel)
        if cap is None:  # weights: their header decides their size (weights_header.py)
            continue
        limits.check_size(path, rel, cap)
        with open(path, "rb") as f:
            if f.read(4).startswith(_PICKLE_MAGIC):
                raise EngineError(
                    f"engine file {rel} holds a pickle or zip archive, which engines may not carry; refusing to load"
                )


def verify_files(engine_dir: Path, manifest: dict) -> None:
    """Every file the manifest lists has its checksum."""
    for rel, digest in manifest["files"].items():
        if sha256_file(inside(engine_dir, rel)) != digest:
            raise EngineError(f"engine file {rel} fails its checksum (corrupt or modified); rebuild the engine")


class _Background:
    """Runs ``fn`` on a thread (hashing releases the GIL, so it overlaps the weight copy and
    program load); ``result()`` re-raises its error."""

    def __init__(self, fn: Callable[[], None]):
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name="verify-engine")
        self._thread.start()

    def _run(self, fn):
        try:
            fn()
        except BaseException as e:  # handed to the caller by result()
            self._error = e

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _config(manifest: dict) -> ModelConfig:
    try:
        return ModelConfig.checked_from_dict(manifest["model_config"])
    except (TypeError, KeyError, ValueError) as e:
        raise EngineError(f"manifest model_config is not valid ({e}); rebuild the engine") from None


def _device(manifest: dict, device: str | torch.device | None) -> torch.device:
    built_for = build_config(manifest).device
    dev = torch.device(device) if device is not None else torch.device(built_for)
    if dev.type != built_for:
        raise EngineError(f"engine was built for {built_for} but {dev.type} was asked for; rebuild with --device {dev.type}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError("engine was built for cuda but no CUDA device is available here")
    return dev


def _check_kernels(manifest: dict) -> None:
    """Every provider the program calls is registered here. Only engines that call kernel
    providers import them (a CPU engine calls the reference ops and needs no Triton)."""
    if all(p == registry.REFERENCE for p in manifest["kernels"].values()):
        return
    registry.load_providers()
    for op, provider in manifest["kernels"].items():
        try:
            registry.get_provider(op, provider)
        except Exception:
            failed = registry.failed_provider_modules()
            why = f" (provider modules that failed to import: {', '.join(failed)})" if failed else ""
            raise EngineError(
                f"the engine's manifest names kernel {provider!r} for cllm::{op}, which is not available here{why}"
            ) from None


def _load_program(engine_dir: Path, manifest: dict, stage: int = 0) -> torch.fx.GraphModule:
    entry = program_entry(manifest, stage)
    rel = entry["file"]
    data = limits.read_capped(inside(engine_dir, rel), rel, limits.MAX_PROGRAM_BYTES)
    try:
        data = json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested thousands deep
        raise EngineError(f"cannot read {rel} as a JSON program ({type(e).__name__}); rebuild the engine") from None
    return graph_from_json(data, entry["param_names"], build_config(manifest).device, entry.get("inputs", 0))


def attention_windows(gm: torch.fx.GraphModule) -> list[int]:
    """The sliding window of each paged-attention call of a program (0: global), in graph order
    (one call per layer), whichever kernel provider the call was given."""
    from compiled_llm.graph.ops import OPS

    window_at = OPS["paged_attention"].params.index("sliding_window")
    windows = []
    for node in gm.graph.nodes:
        name = getattr(node.target, "name", lambda: "")() if node.op == "call_function" else ""
        if name == "cllm::paged_attention" or name.startswith("cllm::paged_attention__"):
            window = node.args[window_at] if len(node.args) > window_at else node.kwargs.get("sliding_window", 0)
            windows.append(window)
    return windows


def _check_windows(gm: torch.fx.GraphModule, config: ModelConfig, layers: range | None = None) -> None:
    """The manifest's sliding windows are the program's: the runtime gives back KV blocks behind
    ``config.kv_window``, which is only safe when no attention call reads further back.
    ``layers``: those a pipeline stage's program holds."""
    expected = [config.layer_window(n) for n in (layers if layers is not None else range(config.num_layers))]
    if attention_windows(gm) != expected:
        raise EngineError("manifest model_config's sliding windows (sliding_window, layer_types) are not the "
                          "program's attention windows; rebuild the engine")


def _load_weights(engine_dir: Path, manifest: dict, device: torch.device, rank: int,
                  config: ModelConfig) -> dict[str, Tensor]:
    stage, tp_rank = divmod(rank, tp_size_of(manifest))
    name = weights_file(tp_rank, tp_size_of(manifest), stage, pp_size_of(manifest))
    path = inside(engine_dir, name)
    build = build_config(manifest)
    entry = program_entry(manifest, stage)
    names = entry["param_names"]
    layers = range(entry["first_layer"], entry["first_layer"] + entry["num_layers"]) if "first_layer" in entry else None
    made: list[str] = []
    if build.load_format == "dummy":  # the matrices are made here, at the shapes the config implies
        expected = weights_header.expected_tensors(config, build)
        made = [n for n in names if n in expected and dummy_weights.is_dummy(n, expected[n][1])]
    weights_header.check_header(path, name, config, build, [n for n in names if n not in made], layers)
    try:
        tensors = load_file(str(path), device=str(device))
        metadata = None
        if build.load_format == "dummy":
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata()
    except Exception as e:
        raise EngineError(f"cannot read {name} as safetensors ({type(e).__name__}); rebuild the engine") from None
    if build.load_format == "dummy":
        dummy_weights.check_file(metadata, set(tensors), {n: expected[n] for n in made}, name)
        tensors.update(dummy_weights.make(made, expected, device))
    missing = [n for n in names if n not in tensors]
    if missing:
        raise EngineError(f"{name} lacks {missing[0]!r} that the program reads; rebuild the engine")
    # safetensors may hand out views of one shared buffer (CPU); give each weight its own
    # storage so no program sees storage offsets the build never saw.
    return {n: tensors[n].clone() if tensors[n]._base is not None else tensors[n] for n in names}


def loaded_weight_bytes(engine_dir: str | Path) -> int:
    """Bytes of the weights a load of the engine holds on its device (one rank's): what its
    weights file holds, or for a dummy engine what the load makes as well."""
    manifest = read_manifest(engine_dir)
    expected = weights_header.expected_tensors(_config(manifest), build_config(manifest))
    return sum(math.prod(shape) * getattr(torch, dtype).itemsize
               for dtype, shape in (expected[n] for n in manifest["program"]["param_names"] if n in expected))


def load_engine(
    engine_dir: str | Path,
    device: str | torch.device | None = None,
    verify: bool = True,
    rank: int = 0,
) -> LoadedModel:
    """Validate and load an engine directory (of a tensor-parallel or pipelined engine, rank
    ``rank``'s weights, program and config; ranks go stage-major, ``pipeline_stage.py``);
    ``load_stages`` says where the time went."""
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    check_listed_files(engine_dir, manifest)
    checks = _Background(lambda: verify_files(engine_dir, manifest)) if verify else None
    config = _config(manifest)
    dev = _device(manifest, device)
    dtype = getattr(torch, build_config(manifest).dtype)  # one of BuildConfig's DTYPES: read_manifest checked it
    t1 = time.perf_counter()
    times["manifest"] = t1 - t0
    params = _load_weights(engine_dir, manifest, dev, rank, config)
    t2 = time.perf_counter()
    times["weights"] = t2 - t1
    _check_kernels(manifest)
    tp, pp = tp_size_of(manifest), pp_size_of(manifest)
    stage, tp_rank = divmod(rank, tp)
    entry = program_entry(manifest, stage)
    gm = _load_program(engine_dir, manifest, stage)
    layers = None
    if pp == 1:
        _check_windows(gm, config)
        program = PortableProgram(gm, entry["param_names"])
        if build_config(manifest).decode_backend == "megakernel":
            schedule = load_schedule(engine_dir, manifest)
            shapes = {n: tuple(t.shape) for n, t in params.items()}
            try:
                check_matches_program(schedule, gm, shapes)
                check_weights(schedule, shapes, config.num_layers)
            except ScheduleError as e:
                raise EngineError(f"{manifest['megakernel']['file']}: {e}; rebuild the engine") from None
            check_fits(schedule, dev)
            program = MegakernelProgram(program, schedule)
    else:
        layers = range(entry["first_layer"], entry["first_layer"] + entry["num_layers"])
        _check_windows(gm, config, layers)
        last = gm if stage == pp - 1 else _load_program(engine_dir, manifest, pp - 1)
        program = PipelineStage(gm, entry["param_names"], stage=stage, stages=pp, tp_rank=tp_rank, tp_size=tp,
                                num_inputs=entry["inputs"], num_outputs=entry["outputs"],
                                yields_chosen_rows=yields_chosen_rows(last))
    t3 = time.perf_counter()
    times["program"] = t3 - t2
    if checks is not None:
        checks.result()  # kernels are used only from files that passed their checksums
    t4 = time.perf_counter()
    times["verify"] = t4 - t3
    kernel_cache.use_engine_kernels(engine_dir, manifest, dev)
    times["kernels"] = time.perf_counter() - t4

    t5 = time.perf_counter()
    tok = manifest.get("tokenizer")
    tokenizer = load_tokenizer(inside(engine_dir, tok)) if tok else None
    generation = manifest.get("generation_config") or {}
    eos = [*config.eos_token_ids, *generation.get("eos_token_ids", ()), *(tokenizer.eos_token_ids if tokenizer else ())]
    times["tokenizer"] = time.perf_counter() - t5
    source_dir = (manifest.get("source") or {}).get("model_dir")
    return LoadedModel(
        name=str(engine_dir),
        config=sharding.local_config(config, tp),
        params=params,
        program=program,
        tokenizer=tokenizer,
        eos_token_ids=tuple(i for i in dict.fromkeys(eos) if 0 <= i < config.vocab_size),
        tp_rank=tp_rank,
        tp_size=tp,
        pp_rank=stage,
        pp_size=pp,
        kv_layers=None if layers is None else len(layers),
        dtype=dtype,
        device=dev,
        manifest=manifest,
        engine_dir=engine_dir,
        source_dir=_existing_dir(source_dir),
        generation_defaults=dict(generation.get("defaults", {})),
        load_stages=times,
    )


def _existing_dir(path: str | None) -> Path | None:
    """The source checkpoint's directory when it is on this machine (a hint: any path that
    cannot be looked at is none)."""
    try:
        return Path(path) if path and Path(path).is_dir() else None
    except (OSError, ValueError):  # a name too long, a NUL
        return None
