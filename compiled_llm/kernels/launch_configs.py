"""Launch configurations of the Triton kernels, keyed by (kernel, number-of-tokens bucket).

One config per dynamic-shape bucket, not one for all shapes: a block size that streams weights
well at T=1 wastes a GPU at T=512 (a known pitfall of reusing one autotune result across dynamic
shapes). The table is plain JSON-able data so a build can store the table it used in the engine
artifact and a runtime can install it again with ``use_configs``; nothing here autotunes at run
time, so the first call inside a CUDA-graph capture never benchmarks.

Buckets are upper bounds on the number of tokens T: the config under key "16" serves
4 < T <= 16 when the keys are "1", "4", "16", "inf".
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any, Mapping

from compiled_llm.errors import CompiledLLMError

# Every kernel's knobs. Values were chosen for H100/H200-class GPUs (132 SMs) and head_dim 64/128.
DEFAULT_CONFIGS: dict[str, dict[str, dict[str, int]]] = {
    # split-K decode attention: BLOCK_N keys per inner step; at most MAX_SPLITS splits per
    # sequence, fewer when the batch alone fills the GPU (see triton_paged_attention).
    "paged_attention_decode": {
        "16": {"BLOCK_N": 32, "MAX_SPLITS": 16, "num_warps": 4, "num_stages": 2},
        "inf": {"BLOCK_N": 64, "MAX_SPLITS": 8, "num_warps": 4, "num_stages": 2},
    },
    "paged_attention_reduce": {
        "inf": {"num_warps": 2},
    },
    # varlen causal prefill over the paged cache
    "paged_attention_prefill": {
        "inf": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    },
    # fused norm + MLP, weight-streaming decode form (grid over chunks of the intermediate dim)
    "norm_mlp_decode": {
        "1": {"BLOCK_T": 16, "BLOCK_I": 16, "BLOCK_H": 256, "num_warps": 4, "num_stages": 3},
        "16": {"BLOCK_T": 16, "BLOCK_I": 32, "BLOCK_H": 128, "num_warps": 4, "num_stages": 3},
        "inf": {"BLOCK_T": 32, "BLOCK_I": 64, "BLOCK_H": 64, "num_warps": 4, "num_stages": 3},
    },
    # above this many tokens the provider uses the prefill form (Triton norm + cuBLAS + Triton
    # activation) instead of the weight-streaming kernel
    "norm_mlp_dispatch": {
        "inf": {"MAX_DECODE_TOKENS": 16},
    },
    # elementwise/row kernels: one program per row; warps scale with the row length in the
    # wrappers, these are caps
    "norm": {"inf": {"MAX_WARPS": 16}},
    "act": {"inf": {"BLOCK": 1024, "num_warps": 4}},
    "qkv_epilogue": {"inf": {"num_warps": 1}},
    "kv_store": {"inf": {"num_warps": 1}},
}

_active: dict[str, dict[str, dict[str, int]]] = copy.deepcopy(DEFAULT_CONFIGS)


def _bucket_bound(key: str) -> float:
    return math.inf if key == "inf" else float(int(key))


def validate(configs: Mapping[str, Any]) -> None:
    """Raise CompiledLLMError if ``configs`` is not a table of the shape of DEFAULT_CONFIGS."""
    if not isinstance(configs, Mapping):
        raise CompiledLLMError("launch configs must be a JSON object")
    for kernel, buckets in configs.items():
        if kernel not in DEFAULT_CONFIGS:
            raise CompiledLLMError(f"launch configs name unknown kernel {kernel!r}")
        if not isinstance(buckets, Mapping) or "inf" not in buckets:
            raise CompiledLLMError(f"launch configs of {kernel!r} need an 'inf' bucket")
        for key, cfg in buckets.items():
            if key != "inf" and not (isinstance(key, str) and key.isdigit()):
                raise CompiledLLMError(f"launch config bucket {key!r} of {kernel!r} is not a token count")
            if not isinstance(cfg, Mapping) or not all(isinstance(v, int) and v > 0 for v in cfg.values()):
                raise CompiledLLMError(f"launch config {kernel!r}[{key!r}] must map names to positive ints")


def get(kernel: str, num_tokens: int) -> dict[str, int]:
    """The config of ``kernel`` for a call with ``num_tokens`` tokens (smallest bucket that
    holds it)."""
    buckets = _active[kernel]
    key = min((k for k in buckets if num_tokens <= _bucket_bound(k)), key=_bucket_bound)
    return dict(buckets[key])


def current() -> dict[str, dict[str, dict[str, int]]]:
    """The active table (a deep copy, JSON-able) for a build to store in its artifact."""
    return copy.deepcopy(_active)


def use_configs(configs: Mapping[str, Any] | None) -> None:
    """Install a stored table (kernels it does not name keep their defaults); None resets."""
    global _active
    table = copy.deepcopy(DEFAULT_CONFIGS)
    if configs is not None:
        validate(configs)
        for kernel, buckets in configs.items():
            table[kernel] = {k: dict(v) for k, v in buckets.items()}
    _active = table


def to_json(configs: Mapping[str, Any] | None = None) -> str:
    return json.dumps(current() if configs is None else configs, indent=1, sort_keys=True)
