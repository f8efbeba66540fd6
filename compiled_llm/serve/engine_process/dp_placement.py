"""Where each data-parallel replica runs: on CUDA, replica i owns the GPUs [i*TP, (i+1)*TP) of
those this process sees, handed to its engine process as ``CUDA_VISIBLE_DEVICES`` (so inside it
the replica's tensor-parallel ranks are cuda:0..TP-1 as without replicas); on a CPU the replicas
share the CPU, each with its share of the cores as torch's thread count. Plain Python: the
caller counts the GPUs and the cores."""

from __future__ import annotations

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
