"""The build pipeline: source -> capture -> passes -> program (+ GPU kernels) -> engine dir.

Stages, each timed and shown as a tqdm bar: load (config, weights, tokenizer, the sampling
defaults and EOS ids of generation_config.json), capture
(torch.export of the spec), passes (the PassManager, one bar step per pass), write (program.json,
weights, tokenizer, ir/, manifest with checksums), kernels (CUDA: the runtime run once over the
written engine so every Triton kernel it launches is compiled into the engine: the ``warm_up``
its caller passes, ``warm_kernels`` of ``serve/kernel_warmup.py``, since the runtime lives above this
layer; kernel_cache.py keeps the files). The finished engine is swapped into place only at the
end (output_dir.py). What to build is a ``BuildConfig`` (build_config.py).

``lower`` is the in-memory part (capture + passes) that ``compare`` also uses to rebuild with a
prefix of the pass list.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor
from tqdm import tqdm

from compiled_llm.engine import artifact, dummy_weights, kernel_cache
from compiled_llm.engine import output_dir as engine_output
from compiled_llm.engine.build_config import BuildConfig
from compiled_llm.errors import CompiledLLMError
from compiled_llm.graph.export import capture, param_placeholder_names
from compiled_llm.kernels import registry
from compiled_llm.megakernel import scheduler
from compiled_llm.megakernel.check import check_schedule, check_weights
from compiled_llm.megakernel.lowering import lower_decode
from compiled_llm.megakernel.schedule import DEFAULT_NUM_SMS
from compiled_llm.model import sharding
from compiled_llm.model.config import ModelConfig
from compiled_llm.model.placement import dtype_name, resolve_device, resolve_dtype
from compiled_llm.model.sources import (
    GENERATION_CONFIG,
    generation_defaults,
    generation_eos_token_ids,
    load_source_params,
    load_source_tokenizer,
    read_generation_config,
    resolve_source,
)
from compiled_llm.passes import get_pass, pipeline, pipeline_split
from compiled_llm.passes.base import PassContext
from compiled_llm.passes.manager import PassManager

log = logging.getLogger(__name__)


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
    quantization: str | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> Lowered:
    """Capture the spec and run the named passes (in order) on it; ``quantization`` is the
    weight-only scheme quantize_weights applies (None: none); ``tp_rank`` of ``tp_size`` is the
    tensor-parallel rank whose program and weights the shard pass makes."""

    registry.load_providers()
    t0 = time.perf_counter()
    captured = capture(config, params)
    t1 = time.perf_counter()
    passes = [get_pass(n) for n in pass_names]
    choice = registry.choose_providers(device_type, dtype, prefer=kernel_prefs)
    ctx = PassContext(config, dict(params), device_type, dtype, choice, quantization, tp_rank, tp_size)
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


def resolve_config(config: BuildConfig, src) -> tuple[BuildConfig, torch.device, torch.dtype]:
    """(``config`` with nothing left to "auto", the device, the dtype) for the model source
    ``src`` (a ``sources.ModelSource``) on this machine: the device "auto" is cuda when
    available, else cpu; the dtype "auto" is ``auto_dtype`` (the checkpoint's float16/bfloat16 on
    a GPU, float32 on a CPU); an unset max_model_len is the model's maximum."""
    dev = resolve_device(config.device)
    torch_dtype = resolve_dtype(config.dtype, dev, src)
    resolved = dataclasses.replace(config, dtype=dtype_name(torch_dtype), device=str(dev),
                                   max_model_len=check_max_len(config.max_model_len, src.config))
    return resolved, dev, torch_dtype


WarmUp = Callable[[Path, torch.device], None]


def build_engine(
    source: str,
    out_dir: str | Path,
    config: BuildConfig | None = None,
    *,
    progress: bool = True,
    warm_up: WarmUp | None = None,
    pass_names: Sequence[str] | None = None,
    **options,
) -> dict:
    """Build ``source`` (checkpoint dir, preset or hub id) into an engine directory as
    ``config`` says (``BuildConfig``; or, for short, its fields as keyword ``options``); returns
    the manifest, whose ``build_options`` is the config resolved (``resolve_config``).

    ``warm_up(engine_dir, device)``: on a CUDA build, runs the runtime over the engine just
    written with Triton compiling into ``engine_dir/kernels/triton`` (the runtime's layer passes
    ``warm_kernels`` of ``serve/kernel_warmup.py``), before the engine is swapped into place; None ships
    no compiled kernels (a load then compiles them on first use). ``pass_names`` replaces the
    default pipeline (tests plant passes this way)."""

    if config is None:
        config = BuildConfig.from_options(options)
    elif options:
        raise TypeError(f"build_engine takes a BuildConfig or its options, not both ({', '.join(options)})")
    resolve_device(config.device)  # a device this machine lacks is refused before the output is touched
    out_dir = engine_output.prepare_output_dir(out_dir)
    passes = [p.name for p in pipeline(list(pass_names) if pass_names is not None else None,
                                       tuple(config.disabled_passes))]
    if config.quantization is not None and "quantize_weights" not in passes:
        raise CompiledLLMError(f"--quantization {config.quantization} needs the quantize_weights pass, which is disabled")
    size = config.tensor_parallel_size
    stages = config.pipeline_parallel_size
    times: dict[str, float] = {}

    with _Stage("load", times, progress):
        src = resolve_source(str(source))
        resolved, dev, torch_dtype = resolve_config(config, src)
        sharding.plan(src.config, size)  # refuses a shape that does not split, before any work
        pipeline_split.check_size(src.config.num_layers, stages)
        if size > 1 and "shard" not in passes:
            raise CompiledLLMError(f"--tensor-parallel-size {size} needs the shard pass, which is disabled")
        dummy = resolved.load_format == "dummy"
        params = load_source_params(src, torch_dtype, dev, uninitialised=dummy_weights.is_dummy if dummy else None)
        tokenizer = load_source_tokenizer(src)
        generation_file = read_generation_config(src.model_dir)
        generation = artifact.generation_config_entry(
            generation_defaults(generation_file, f"{GENERATION_CONFIG} of {src.name}"),
            generation_eos_token_ids(generation_file),
        )

    try:
        work = engine_output.make_work_dir(out_dir)
    except OSError as e:
        raise CompiledLLMError(f"cannot write into {out_dir.parent}: {e.strerror or e}") from None
    try:
        lowered = None
        first_stages: list[pipeline_split.StageProgram] | None = None  # rank 0's, which every rank's must equal
        for rank in range(size):
            rank_lowered = lower(
                src.config, params, passes, dev.type, torch_dtype, resolved.kernel_prefs,
                ir_dir=work / artifact.IR_DIR if rank == 0 else None, dump_code=True, progress=progress and rank == 0,
                quantization=resolved.quantization, tp_rank=rank, tp_size=size,
            )
            if size > 1:
                _check_same_program(lowered, rank_lowered, rank)
            if stages > 1:
                rank_stages = pipeline_split.split(rank_lowered.gm, src.config.num_layers, stages)
                _check_same_stages(first_stages, rank_stages, rank)
                first_stages = first_stages or rank_stages
                with _Stage("write", times, progress):
                    for k, stage in enumerate(rank_stages):
                        stored, metadata = _file_contents({n: rank_lowered.params[n] for n in stage.param_names}, dummy)
                        artifact.save_weights(work, stored, artifact.weights_file(rank, size, k, stages), metadata)
            elif size > 1:
                with _Stage("write", times, progress):
                    stored, metadata = _file_contents(rank_lowered.params, dummy)
                    artifact.save_weights(work, stored, artifact.weights_file(rank, size), metadata)
            if rank == 0:
                lowered = rank_lowered
            del rank_lowered
        del params
        times["capture"] = lowered.capture_seconds
        times["passes"] = lowered.passes_seconds
        if not resolved.dump_ir:
            _keep_first_and_last_code(work / artifact.IR_DIR)

        with _Stage("write", times, progress):
            try:
                if first_stages is None:
                    artifact.write_program(work, lowered.gm)
                for k, stage in enumerate(first_stages or ()):
                    artifact.write_program(work, stage.gm, artifact.stage_program_file(k))
            except ValueError as e:  # the graph calls something an engine may not carry
                raise CompiledLLMError(f"cannot store the post-pass program: {e}") from None
            manifest = artifact.make_manifest(
                config=src.config,
                source={"name": src.name, "model_dir": str(src.model_dir.resolve()) if src.model_dir else None,
                        "preset": src.preset},
                build_options=resolved.to_manifest(),
                lowered=lowered,
                stage_seconds=times,
                generation_config=generation,
            )
            if resolved.decode_backend == "megakernel":
                manifest["megakernel"] = artifact.write_schedule(
                    work, decode_schedule(lowered, src.config.num_layers, schedule_sms(dev)))
            if first_stages is not None:
                manifest["pipeline"] = {"size": stages, "stages": [_stage_entry(k, s) for k, s in enumerate(first_stages)]}
                manifest["program"] = manifest["pipeline"]["stages"][0]
            stored, metadata = _file_contents(lowered.params, dummy)
            artifact.save_engine(work, manifest, stored if size == 1 and stages == 1 else None, tokenizer, metadata)
        del lowered
        warmed = dev.type == "cuda" and warm_up is not None
        host = None
        if warmed:
            with _Stage("kernels", times, progress):
                (work / kernel_cache.KERNELS_DIR).mkdir(parents=True, exist_ok=True)
                warm_up(work, dev)
                kernel_cache.remove_partial_entries(work)
                host = kernel_cache.split_host_binaries(work)
        elif dev.type == "cuda":
            log.warning("no kernel warm-up given: the CUDA engine ships no compiled kernels (each load compiles them)")
        manifest = artifact.write_manifest(work, {
            **artifact.read_manifest(work),
            "kernel_cache": kernel_cache.KERNELS_DIR if warmed else None,
            "stage_seconds": {k: round(v, 4) for k, v in times.items()},
        })
        if warmed:
            kernel_cache.install_local(work, manifest, host)
        engine_output.swap_into_place(work, out_dir)
    finally:
        engine_output.discard_work_dir(work)
    return artifact.read_manifest(out_dir)


def schedule_sms(dev: torch.device) -> int:
    """The SMs a megakernel schedule is made for: the build GPU's (the persistent kernel runs one
    program an SM, all resident), DEFAULT_NUM_SMS on a CPU."""
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count
    return DEFAULT_NUM_SMS


def decode_schedule(lowered: Lowered, num_layers: int, num_sms: int = DEFAULT_NUM_SMS):
    """The megakernel schedule of the lowered program's decode step (a model of ``num_layers``),
    checked: a schedule the scheduler got wrong fails the build, not a step."""
    shapes = {n: tuple(t.shape) for n, t in lowered.params.items()}
    made = scheduler.schedule(lower_decode(lowered.gm, shapes, num_sms), scheduler.Machine(num_sms))
    check_schedule(made)
    check_weights(made, shapes, num_layers)
    return made


def _file_contents(params: dict, dummy: bool) -> tuple[dict, dict | None]:
    """(the weights an engine's file holds, its extra metadata): all of them, or a dummy engine's
    small ones and its record of the matrices a load makes."""
    return (dummy_weights.stored(params), dummy_weights.file_metadata(params)) if dummy else (params, None)


def _check_same_program(first: Lowered | None, lowered: Lowered, rank: int) -> None:
    """Every rank runs one program on its own weights: the shard pass must give each the same
    graph."""
    if first is not None and artifact.graph_to_json(first.gm) != artifact.graph_to_json(lowered.gm):
        raise CompiledLLMError(f"the passes gave rank {rank} a program that differs from rank 0's; a pass depends on the rank")


def _check_same_stages(first: list | None, stages: list, rank: int) -> None:
    """Each stage's TP ranks run one program, as without pipelining (``_check_same_program``)."""
    if first is None:
        return
    for k, (a, b) in enumerate(zip(first, stages)):
        if artifact.graph_to_json(a.gm) != artifact.graph_to_json(b.gm):
            raise CompiledLLMError(f"the passes gave rank {rank} a stage {k} program that differs from rank 0's")


def _stage_entry(k: int, stage: pipeline_split.StageProgram) -> dict:
    """A pipeline stage's entry in the manifest (``artifact.program_entry``)."""
    return {"file": artifact.stage_program_file(k), "param_names": list(stage.param_names),
            "first_layer": stage.first_layer, "num_layers": stage.num_layers,
            "inputs": stage.num_inputs, "outputs": stage.num_outputs}


def check_max_len(max_model_len: int | None, config: ModelConfig) -> int:
    if max_model_len is None:
        return config.max_position_embeddings
    if max_model_len < 2 or max_model_len > config.max_position_embeddings:
        raise CompiledLLMError(
            f"--max-model-len {max_model_len} is outside 2..{config.max_position_embeddings} (the model's maximum)"
        )
    return max_model_len


def _keep_first_and_last_code(ir_dir: Path) -> None:
    """Without --dump-ir only the captured and the final IR code are kept (histograms stay)."""
    code = sorted(ir_dir.glob("*.py"))
    for f in code[1:-1]:
        f.unlink()
