"""The build pipeline: source -> capture -> passes -> program (+ Inductor cache) -> engine dir.

Stages, each timed and shown as a tqdm bar: load (config, weights, tokenizer), capture
(torch.export of the spec), passes (the PassManager, one bar step per pass), export (the post-pass
program exported again with weights as inputs, for the .pt2), backend (CUDA: Inductor compile,
warm, cache saved), write (weights, tokenizer, ir/, manifest with checksums).

``lower`` is the in-memory part (capture + passes) that ``compare`` also uses to rebuild with a
prefix of the pass list.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from compiled_llm.config import ModelConfig
from compiled_llm.errors import CompiledLLMError

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise CompiledLLMError(f"unsupported dtype {name!r}; choose from float32, bfloat16, float16")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise CompiledLLMError(f"unknown device {name!r}; use cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise CompiledLLMError(f"unsupported device {name!r}; use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CompiledLLMError("--device cuda asked for, but no CUDA device is available")
    return device


@dataclasses.dataclass
class Lowered:
    """The result of capture + passes, in memory."""

    gm: torch.fx.GraphModule
    params: dict[str, Tensor]  # post-pass weights, in the program's input order
    param_names: list[str]
    results: list  # list[PassResult]
    histograms: dict[str, dict[str, int]]  # stage -> op histogram
    kernels: dict[str, str]  # op -> provider, for the ops the program calls
    capture_seconds: float
    passes_seconds: float


def program_kernels(gm: torch.fx.GraphModule) -> dict[str, str]:
    """{semantic op: provider} of every cllm:: call in the graph (providers are named
    cllm::<op>__<provider>; the semantic op itself is "reference")."""
    kernels: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not hasattr(node.target, "name"):
            continue
        ns, _, rest = node.target.name().partition("::")
        if ns != "cllm":
            continue
        op, _, provider = rest.split(".")[0].partition("__")
        kernels[op] = provider or "reference"
    return dict(sorted(kernels.items()))


def lower(
    config: ModelConfig,
    params: dict[str, Tensor],
    pass_names: Sequence[str],
    device_type: str,
    dtype: torch.dtype,
    kernel_prefs: dict[str, str] | None = None,
    ir_dir: Path | None = None,
    dump_code: bool = True,
    progress: bool = False,
) -> Lowered:
    """Capture the spec and run the named passes (in order) on it."""
    from compiled_llm.graph.export import capture, param_placeholder_names
    from compiled_llm.kernels import registry
    from compiled_llm.passes import get_pass
    from compiled_llm.passes.base import PassContext
    from compiled_llm.passes.manager import PassManager

    registry.load_providers()
    t0 = time.perf_counter()
    captured = capture(config, params)
    t1 = time.perf_counter()
    passes = [get_pass(n) for n in pass_names]
    choice = registry.choose_providers(device_type, dtype, prefer=kernel_prefs)
    ctx = PassContext(config, dict(params), device_type, dtype, choice)
    bar = _bar(len(passes), "passes", progress)
    manager = PassManager(passes, ir_dir, dump_code, on_pass=lambda r: (bar.set_postfix_str(r.name), bar.update()))
    try:
        results = manager.run(captured.gm, ctx)
    finally:
        bar.close()
    t2 = time.perf_counter()
    names = param_placeholder_names(captured.gm)
    return Lowered(
        gm=captured.gm,
        params={n: ctx.params[n] for n in names},
        param_names=names,
        results=results,
        histograms=manager.histograms,
        kernels=program_kernels(captured.gm),
        capture_seconds=t1 - t0,
        passes_seconds=t2 - t1,
    )


def _bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=f"{desc:>8}", disable=not enabled, leave=True, dynamic_ncols=True)


class _Stage:
    """Times one build stage and shows it as a one-step bar."""

    def __init__(self, name: str, times: dict[str, float], progress: bool):
        self.name, self.times, self.progress = name, times, progress

    def __enter__(self):
        self.bar = _bar(1, self.name, self.progress)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.times[self.name] = self.times.get(self.name, 0.0) + time.perf_counter() - self.t0
        if exc[0] is None:
            self.bar.update()
        self.bar.close()
        return False


def build_engine(
    source: str,
    out_dir: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    max_model_len: int | None = None,
    disabled_passes: Sequence[str] = (),
    pass_names: Sequence[str] | None = None,
    dump_ir: bool = False,
    kernel_prefs: dict[str, str] | None = None,
    backend: str = "auto",
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    progress: bool = True,
) -> dict:
    """Build ``source`` (checkpoint dir, preset or hub id) into an engine directory; returns the
    manifest. ``pass_names`` replaces the default pipeline (tests plant passes this way);
    ``backend`` is "auto" (Inductor on CUDA, portable on CPU), "portable" or "inductor"."""
    from compiled_llm import artifact, backend as backends
    from compiled_llm.graph.export import reexport
    from compiled_llm.passes import pipeline
    from compiled_llm.sources import load_source_params, load_source_tokenizer, resolve_source

    torch_dtype = parse_dtype(dtype)
    dev = parse_device(device)
    backend = _resolve_backend(backend, dev)
    out_dir = Path(out_dir)
    _check_out_dir(out_dir)
    passes = [p.name for p in pipeline(list(pass_names) if pass_names is not None else None, tuple(disabled_passes))]
    times: dict[str, float] = {}

    with _Stage("load", times, progress):
        src = resolve_source(str(source))
        config = src.config
        max_len = _check_max_len(max_model_len, config)
        params = load_source_params(src, torch_dtype, dev)
        tokenizer = load_source_tokenizer(src)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
    work.chmod(0o755)
    try:
        lowered = lower(
            config, params, passes, dev.type, torch_dtype, kernel_prefs,
            ir_dir=work / artifact.IR_DIR, dump_code=True, progress=progress,
        )
        del params
        times["capture"] = lowered.capture_seconds
        times["passes"] = lowered.passes_seconds
        if not dump_ir:
            _keep_first_and_last_code(work / artifact.IR_DIR)

        with _Stage("export", times, progress):
            try:
                ep = reexport(lowered.gm, lowered.params, config)
            except Exception as e:
                raise CompiledLLMError(f"exporting the post-pass program failed: {type(e).__name__}: {_first_line(e)}") from e
            # export keeps its example inputs (the weights!) for saving; the artifact stores
            # weights once, in the safetensors
            ep.example_inputs = None
            torch.export.save(ep, str(work / artifact.PROGRAM_FILE))

        cache_file = None
        if backend == backends.INDUCTOR:
            with _Stage("backend", times, progress):
                # compile the graph as the loader will see it (read back from the .pt2): the
                # compile caches are keyed by the graph, so this is what lets a load hit them
                saved_gm = torch.export.load(str(work / artifact.PROGRAM_FILE)).graph_module
                program = backends.InductorProgram(saved_gm, lowered.param_names)
                backends.warm(program, lowered.params, config, dev, torch_dtype)
                if backends.save_compiled(work / artifact.INDUCTOR_CACHE_FILE):
                    cache_file = artifact.INDUCTOR_CACHE_FILE

        with _Stage("write", times, progress):
            manifest = artifact.make_manifest(
                config=config,
                source={"name": src.name, "model_dir": str(src.model_dir.resolve()) if src.model_dir else None,
                        "preset": src.preset},
                build_options={
                    "dtype": dtype_name(torch_dtype), "device": dev.type, "max_model_len": max_len,
                    "disabled_passes": list(disabled_passes), "kernel_prefs": dict(kernel_prefs or {}),
                    "backend": backend, "dump_ir": dump_ir,
                },
                lowered=lowered,
                backend={"kind": backend, "cache_file": cache_file, "fingerprint": backends.machine_fingerprint(dev)},
                buckets=[b for b in buckets],
                stage_seconds=times,
            )
            artifact.save_engine(work, manifest, lowered.params, tokenizer)
            _replace_dir(work, out_dir)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return artifact.read_manifest(out_dir)


def _resolve_backend(backend: str, device: torch.device) -> str:
    from compiled_llm import backend as backends

    if backend == "auto":
        return backends.INDUCTOR if device.type == "cuda" else backends.PORTABLE
    if backend not in backends.BACKENDS:
        raise CompiledLLMError(f"unknown backend {backend!r}; choose auto, portable or inductor")
    return backend


def _check_max_len(max_model_len: int | None, config: ModelConfig) -> int:
    if max_model_len is None:
        return config.max_position_embeddings
    if max_model_len < 2 or max_model_len > config.max_position_embeddings:
        raise CompiledLLMError(
            f"--max-model-len {max_model_len} is outside 2..{config.max_position_embeddings} (the model's maximum)"
        )
    return max_model_len


def _check_out_dir(out_dir: Path) -> None:
    from compiled_llm.artifact import MANIFEST

    if out_dir.exists() and not out_dir.is_dir():
        raise CompiledLLMError(f"output {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MANIFEST).is_file():
        raise CompiledLLMError(f"output directory {out_dir} is not empty and holds no engine; refusing to overwrite it")


def _replace_dir(work: Path, out_dir: Path) -> None:
    """Move the finished build into place (an older engine there is replaced)."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(work), str(out_dir))


def _keep_first_and_last_code(ir_dir: Path) -> None:
    """Without --dump-ir only the captured and the final IR code are kept (histograms stay)."""
    code = sorted(ir_dir.glob("*.py"))
    for f in code[1:-1]:
        f.unlink()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
