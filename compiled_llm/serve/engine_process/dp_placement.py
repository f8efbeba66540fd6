"""Where each data-parallel replica runs: on CUDA, replica i owns the GPUs [i*TP, (i+1)*TP) of
those this process sees, handed to its engine process as ``CUDA_VISIBLE_DEVICES`` (so inside it
the replica's tensor-parallel ranks are cuda:0..TP-1 as without replicas); on a CPU the replicas
share the CPU, each with its share of the cores as torch's thread count. ``replica_placements``
counts the GPUs and the cores and places every replica (``ReplicaPlacement``, which the replica's
engine process applies first thing): ``compiled-llm serve`` and ``LLM`` place their replicas so.
The rest is plain Python."""

from __future__ import annotations

import dataclasses
import os
from typing import Collection

from compiled_llm.errors import InvalidOptionError

VISIBLE_DEVICES_VAR = "CUDA_VISIBLE_DEVICES"
CPU_THREADS_VAR = "OMP_NUM_THREADS"  # what a replica's own children (tensor-parallel ranks) take


def visible_gpus(visible_devices: str | None, device_count: int) -> list[str]:
    """The GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` names them (indices or UUIDs),
    or 0..device_count-1 when it is unset."""
    if visible_devices is None:
        return [str(i) for i in range(device_count)]
    return [d.strip() for d in visible_devices.split(",") if d.strip()][:device_count]


def replica_gpus(data_parallel_size: int, ranks: int, gpus: list[str]) -> list[str]:
    """Each replica's ``CUDA_VISIBLE_DEVICES``: its ``ranks`` consecutive GPUs of ``gpus`` (one per
    tensor-parallel rank of each pipeline stage); a one-line error when there are fewer than
    DP x ranks."""
    need = data_parallel_size * ranks
    if len(gpus) < need:
        raise InvalidOptionError(
            f"data_parallel_size {data_parallel_size} x {ranks} GPU{'s' if ranks > 1 else ''} a replica (tensor x "
            f"pipeline parallel) needs {need} GPUs, but {len(gpus)} {'is' if len(gpus) == 1 else 'are'} visible")
    return [",".join(gpus[i * ranks:(i + 1) * ranks]) for i in range(data_parallel_size)]


def check_replica_device(device: str, data_parallel_size: int) -> None:
    """Replicas each take GPUs of their own: a device naming one GPU (cuda:N) cannot hold several."""
    if data_parallel_size > 1 and device.startswith("cuda:"):
        raise InvalidOptionError(
            f"--device {device} names one GPU, but data_parallel_size {data_parallel_size} gives each replica GPUs "
            "of its own; pass --device cuda (or auto) and choose the GPUs with CUDA_VISIBLE_DEVICES")


def replica_cpu_threads(data_parallel_size: int, cpus: int) -> int:
    """Each CPU replica's torch threads: its share of the ``cpus`` cores (``data_parallel_size``
    counts every process that steps: replicas times their tensor-parallel ranks). Left at torch's default
    every replica would run one thread per core, and the replicas' spinning thread pools would
    fight over the cores (benchmarks/NOTES.md has what that cost)."""
    return max(1, cpus // data_parallel_size)


@dataclasses.dataclass(frozen=True)
class ReplicaPlacement:
    """One replica's share of the machine: its GPUs (``CUDA_VISIBLE_DEVICES``) or, on a CPU, its
    torch threads. ``apply`` in the replica's engine process before anything touches CUDA there
    (or in the tensor-parallel ranks it starts, which inherit the variables)."""

    visible_devices: str | None = None
    cpu_threads: int | None = None

    def apply(self) -> None:
        if self.visible_devices is not None:
            os.environ[VISIBLE_DEVICES_VAR] = self.visible_devices
        if self.cpu_threads is not None:
            import torch

            os.environ[CPU_THREADS_VAR] = str(self.cpu_threads)
            torch.set_num_threads(self.cpu_threads)


def replica_placements(data_parallel_size: int, device: str, ranks: int,
                       cpus: int | None = None) -> list[ReplicaPlacement]:
    """Where each of ``data_parallel_size`` replicas runs, each an engine of ``ranks`` processes
    (``engine_world_size``) on ``device`` (a build's device: "auto", "cuda", "cpu"): on CUDA its
    own ``ranks`` GPUs of those visible, on a CPU its share of ``cpus`` cores (unset: this
    process's). One-line errors when the GPUs are too few or ``device`` names one."""
    from compiled_llm.model.placement import resolve_device

    check_replica_device(device, data_parallel_size)
    if resolve_device(device).type == "cuda":
        import torch

        gpus = visible_gpus(os.environ.get(VISIBLE_DEVICES_VAR), torch.cuda.device_count())
        return [ReplicaPlacement(visible_devices=v) for v in replica_gpus(data_parallel_size, ranks, gpus)]
    # every rank of every replica is a process with its own thread pool
    threads = replica_cpu_threads(data_parallel_size * ranks, cpus or len(os.sched_getaffinity(0)))
    return [ReplicaPlacement(cpu_threads=threads) for _ in range(data_parallel_size)]


def engine_parallel_sizes(model: str, build, given: Collection[str]) -> tuple[int, int]:
    """(tensor-parallel, pipeline-parallel) size of the engine ``model`` (an engine directory or a
    model source) loaded with ``build`` (a ``BuildConfig``): each size as ``given`` (the build
    options named), else as an engine directory was built, else ``build``'s."""
    from compiled_llm.engine.loader import is_engine_dir

    names = ("tensor_parallel_size", "pipeline_parallel_size")
    sizes = {name: getattr(build, name) for name in names}
    if is_engine_dir(model):
        from compiled_llm.engine.artifact import build_config as built_with, read_manifest

        built = built_with(read_manifest(model))
        sizes = {name: size if name in given else getattr(built, name) for name, size in sizes.items()}
    return sizes["tensor_parallel_size"], sizes["pipeline_parallel_size"]


def engine_world_size(model: str, build, given: Collection[str]) -> int:
    """The processes that engine runs as (tensor-parallel x pipeline-parallel size)."""
    tp, pp = engine_parallel_sizes(model, build, given)
    return tp * pp
