"""``EngineConfig``: the engine's options, the one place their names, defaults and help live.

``LLM(...)`` takes them as keyword arguments (``EngineConfig.from_options``) and ``run`` /
``bench`` as flags generated from the fields (``cli/engine_args.py``). Plain Python: building the
command line imports no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from compiled_llm.errors import InvalidOptionError
from compiled_llm.serve.core.spec_decode.config import SpeculativeConfig

# how the engine's other ranks run (vLLM's names): processes of this host (serve/executor/
# multiproc.py), or Ray actors on a Ray cluster, each pipeline stage's on one node (serve/executor/
# ray_executor.py); with the server's data-parallel replicas, their engine cores too
# (serve/engine_process/ray_replicas.py)
EXECUTOR_BACKENDS = ("mp", "ray")


def _option(default, help: str):
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's options (see the module docstring)."""

    block_size: int = _option(16, "tokens per KV-cache block")
    max_num_seqs: int = _option(256, "most sequences batched in one step")
    max_num_batched_tokens: int = _option(4096, "token budget of one step; longer prompts are prefilled in chunks")
    max_model_len: int | None = _option(None, "longest prompt + output served; unset: the engine's build limit")
    gpu_memory_utilization: float = _option(
        0.9, "fraction of GPU memory the engine may use: weights, activations and KV cache")
    num_blocks: int | None = _option(None, "fixed number of KV-cache blocks; unset: sized from memory")
    kv_cache_gib: float | None = _option(None, "KV-cache size on a CPU, in GiB; unset: 0.5")
    enable_prefix_caching: bool = _option(True, "reuse the KV blocks of prompt prefixes seen before")
    enable_chunked_prefill: bool = _option(
        True, "split prompts longer than the token budget over several steps")
    enforce_eager: bool = _option(False, "run every step eagerly, without CUDA graphs (the engine is still compiled)")
    max_graph_batch_size: int = _option(256, "largest decode batch replayed as a CUDA graph")
    # Queue the next decode step before reading this one's tokens, so the host's bookkeeping
    # runs while the device computes (see LLMEngine.step).
    async_scheduling: bool = _option(True, "queue the next decode step before this one's tokens are read")
    prefill_graph_max_tokens: int = _option(
        4096, "one-sequence prefills of up to this many tokens replay CUDA graphs (0: none)")
    disable_custom_all_reduce: bool = _option(
        False, "tensor parallelism on GPUs: every all-reduce through NCCL, none through the custom kernel over NVLink")
    # vLLM's name. Each replica is a whole engine (and TP group) in an engine process of its own;
    # one LLMEngine knows nothing of the others: the front end (the server's, or LLM's) routes
    data_parallel_size: int = _option(
        1, "run N engine replicas, each in a process of its own on its own GPU or tensor-parallel group (replica i "
           "on GPUs i*TP..(i+1)*TP-1; on a CPU each with its share of the cores; serve: Ray actors with the ray "
           "backend), each request sent to the replica likely to hold its prefix in cache, else the least loaded: "
           "behind serve's one endpoint, and for LLM, run and bench's latency, throughput and prefill workloads")
    distributed_executor_backend: str = dataclasses.field(default="mp", metadata={"choices": EXECUTOR_BACKENDS, "help": (
        "how the engine's other ranks (tensor and pipeline parallel) and serve's data-parallel replicas run, as "
        "vLLM's flag: mp (processes of this host) or ray (actors on the Ray cluster this process joins, each "
        "pipeline stage's ranks on one node; pip install compiled_llm[ray])")})
    speculative_config: str | None = _option(
        None, 'speculative decoding, as a JSON object (vLLM\'s): {"method": "ngram", "num_speculative_tokens": K, '
              '"prompt_lookup_max": N[, "prompt_lookup_min": M][, "disable_by_batch_size": B]}; unset: off')

    def __post_init__(self):
        # a JSON string (the flag) or a mapping (LLM's keyword), kept as given; ``speculative``
        # is its parsed form, checked here like every other option
        object.__setattr__(self, "speculative", SpeculativeConfig.parse(self.speculative_config))
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), type(f.default) if f.default is not None else None
            if value is None and f.default is None or f.name in ("speculative_config", "distributed_executor_backend"):
                continue
            if kind is bool:
                if not isinstance(value, bool):
                    raise InvalidOptionError(f"{f.name} must be True or False, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidOptionError(f"{f.name} must be a number, got {value!r}")
        whole = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_graph_batch_size", "num_blocks",
                 "max_model_len", "prefill_graph_max_tokens", "data_parallel_size")
        for name in whole:
            value = getattr(self, name)
            low = 0 if name == "prefill_graph_max_tokens" else 1
            if value is not None and (not isinstance(value, int) or value < low):
                raise InvalidOptionError(f"{name} must be an integer >= {low}, got {value!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidOptionError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise InvalidOptionError(f"unknown distributed_executor_backend {self.distributed_executor_backend!r}; "
                                     f"choose one of: {', '.join(EXECUTOR_BACKENDS)}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise InvalidOptionError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "EngineConfig":
        """The config of keyword options, refusing a name that is not an option."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in options if k not in names]
        if unknown:
            raise InvalidOptionError(f"unknown engine option {unknown[0]!r}; the options are: {', '.join(names)}")
        return cls(**options)
