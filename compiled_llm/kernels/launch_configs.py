"""Launch configurations of the Triton kernels, keyed by (kernel, number-of-tokens bucket).

One config per dynamic-shape bucket, not one for all shapes: a block size that streams weights
well at T=1 wastes a GPU at T=512 (a known pitfall of reusing one autotune result across dynamic
shapes). The table is plain JSON-able data: ``to_json`` writes it and ``use_configs`` installs one
(the tuning tools of benchmarks/kernel_bench.py install their candidates this way); nothing here
autotunes at run time, so the first call inside a CUDA-graph capture never benchmarks.

Buckets are upper bounds on the number of tokens T: the config under key "16" serves
4 < T <= 16 when the keys are "1", "4", "16", "inf".

A weight-streaming kernel's table may also hold, under "shapes", buckets for one weight shape
("NxK": rows x columns as the kernel sees them, so one rank's share under tensor parallelism),
where tuning at that shape beat the general choice. A call of that shape takes the shape's
smallest bucket that holds its T, and the general buckets otherwise.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any, Mapping

from compiled_llm.errors import CompiledLLMError

# Every kernel's knobs. Values were chosen for H100/H200-class GPUs (132 SMs) and head_dim 64/128,
# by the tools of benchmarks/kernel_bench.py (`sweep`, `tune`, `attention`); what they measured is in
# benchmarks/NOTES.md.
DEFAULT_CONFIGS: dict[str, dict[str, dict[str, int]]] = {
    # split-K decode attention, one launch (KV store, attention and split reduce in one kernel):
    # BLOCK_N keys per inner step; at most MAX_SPLITS splits per sequence, fewer when the batch
    # alone gives PROGRAMS_PER_SM programs per SM (see triton_paged_attention; splits past a
    # short context exit at once). COMBINE_SPLITS: splits the fused reduce combines per step
    # (registers: group x COMBINE_SPLITS x head_dim fp32). PREFETCH (optional, 1): each program
    # issues the next tile's loads before this tile's math, two tiles in flight in registers.
    # Batch 1 (contexts ~128-4096) gets up to 32 splits of >= 64 keys: at 4096 that is 64
    # programs on 2 kv heads, at 384 six live splits of one tile each.
    # Past 16 sequences, one stage (the paged loads are not pipelined across tiles, and a second
    # stage's shared memory costs resident programs), 4 programs per SM and the prefetch: at
    # Llama-3.1-8B's shapes, 128-256 sequences of 100-1600 tokens, 7-17% faster at TP=1 and TP=2
    # for stages and programs per SM, and 5-8% more for the prefetch (NOTES.md).
    "paged_attention_decode": {
        "1": {"BLOCK_N": 32, "MAX_SPLITS": 32, "PROGRAMS_PER_SM": 2, "COMBINE_SPLITS": 16,
              "num_warps": 4, "num_stages": 2},
        "16": {"BLOCK_N": 32, "MAX_SPLITS": 16, "PROGRAMS_PER_SM": 2, "COMBINE_SPLITS": 16,
               "num_warps": 4, "num_stages": 2},
        "inf": {"BLOCK_N": 64, "MAX_SPLITS": 8, "PROGRAMS_PER_SM": 4, "COMBINE_SPLITS": 8,
                "num_warps": 4, "num_stages": 1, "PREFETCH": 1},
    },
    # varlen causal prefill over the paged cache. BLOCK_M: rows of the q tile, which stacks the
    # GQA group's heads (BLOCK_M // group query tokens per program; each K/V tile is loaded once
    # per program, so L2 -> SM traffic scales with 1 / BLOCK_M, while a smaller tile has more
    # programs to spread over the SMs at one prompt's length).
    "paged_attention_prefill": {
        "inf": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    },
    # Weight-streaming GEMV kernels (triton_gemv), one table per call site because the shapes
    # differ (o projection K = H; down K = I; gate/up and q/k/v fused with a norm). BLOCK_T rows of
    # x share each weight tile (more rows than BLOCK_T: one more pass over W per BLOCK_T rows);
    # BLOCK_N/BLOCK_I/BLOCK_P weight rows per program; BLOCK_K/BLOCK_H columns per step, which with
    # the problem's N sets the bytes in flight. num_warps is a cap: the wrappers lay warps along K
    # only (warps_along_k). num_stages does not change the generated code of these loops today
    # (no tl.dot to pipeline for); it stays a knob for Triton versions that pipeline plain loads.
    # T > 1 buckets and the dispatch limits below (the token counts up to which the GEMV forms
    # beat cuBLAS) come from `kernel_bench.py sweep` over the Qwen2.5-0.5B and Llama-3.2-1B shapes.
    # The T = 1 buckets of gemv, norm_mlp_down, norm_mlp_decode and qkv_decode serve the one-row
    # forms (one fp32 accumulator per weight row and thread; see triton_gemv) and come from
    # `kernel_bench.py tune`, on the whole batch-1 decode graph: a kernel timed alone misses what
    # programmatic dependent launch overlaps with its neighbours. Weight-only int8 weights use the
    # same tables, the K block widened so that a step streams as many bytes (x's itemsize over a
    # weight's: 2x under bf16; triton_gemv.per_weight_bytes); int4 weights run the general
    # kernels' INT4 forms at every T, with the *_int4 tables below.
    "gemv": {
        "1": {"BLOCK_T": 1, "BLOCK_N": 1, "BLOCK_K": 1024, "num_warps": 1, "num_stages": 1},
        "2": {"BLOCK_T": 2, "BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1},
        "4": {"BLOCK_T": 4, "BLOCK_N": 2, "BLOCK_K": 512, "num_warps": 2, "num_stages": 1},
        "8": {"BLOCK_T": 8, "BLOCK_N": 2, "BLOCK_K": 512, "num_warps": 2, "num_stages": 1},
        "inf": {"BLOCK_T": 8, "BLOCK_N": 2, "BLOCK_K": 512, "num_warps": 2, "num_stages": 1},
    },
    # weight-only int8/int4 GEMM past the decode forms (triton_gemm_wq): [BLOCK_M, BLOCK_N] output
    # tiles (capped at the problem), BLOCK_K columns a step (int4: at most a group), GROUP_M row
    # tiles ordered together. `kernel_bench.py gemm-wq` (benchmarks/NOTES.md).
    "gemm_wq": {
        "16": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4},
        "inf": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
    },
    # rows of x up to which weight-only quantized matmuls run the GEMM above; more rows dequantize
    # the weight into a scratch and run cuBLAS (triton_gemv.matmul_wq). Summed over Llama-3.1-8B's
    # and Llama-3.2-1B's shapes the two tie at 128 rows; the GEMM wins below, the scratch above.
    "gemm_wq_dispatch": {
        "inf": {"MAX_TOKENS": 128},
    },
    # rows of x up to which fused_linear_residual streams W with the GEMV (cuBLAS above)
    "gemv_dispatch": {
        "inf": {"MAX_TOKENS": 4},
    },
    # fused norm + MLP decode form, first kernel: norm + gate/up (or fc) + activation, a program
    # per BLOCK_I intermediate rows (gate rows and the matching up rows)
    # Shapes: Llama-3.1-8B at tensor-parallel size 2 (one rank's gate + up rows, 2 x 7168, over
    # H 4096), tuned on that engine's batch-1 decode (`kernel_bench.py tune`).
    "norm_mlp_decode": {
        "1": {"BLOCK_T": 1, "BLOCK_I": 2, "BLOCK_H": 512, "num_warps": 1, "num_stages": 1},
        "2": {"BLOCK_T": 2, "BLOCK_I": 1, "BLOCK_H": 512, "num_warps": 2, "num_stages": 1},
        "4": {"BLOCK_T": 4, "BLOCK_I": 2, "BLOCK_H": 512, "num_warps": 2, "num_stages": 1},
        "8": {"BLOCK_T": 8, "BLOCK_I": 1, "BLOCK_H": 512, "num_warps": 2, "num_stages": 1},
        "inf": {"BLOCK_T": 8, "BLOCK_I": 1, "BLOCK_H": 512, "num_warps": 2, "num_stages": 1},
        "shapes": {
            "14336x4096": {"1": {"BLOCK_T": 1, "BLOCK_I": 1, "BLOCK_H": 2048, "num_warps": 4, "num_stages": 1}},
        },
    },
    # ... and its second kernel: the down (or proj) GEMV with the residual epilogue (tall K);
    # shapes: Llama-3.1-8B's down at tensor-parallel size 2, as above
    "norm_mlp_down": {
        "1": {"BLOCK_T": 1, "BLOCK_N": 1, "BLOCK_K": 2048, "num_warps": 8, "num_stages": 1},
        "2": {"BLOCK_T": 2, "BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1},
        "4": {"BLOCK_T": 4, "BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1},
        "8": {"BLOCK_T": 8, "BLOCK_N": 1, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1},
        "inf": {"BLOCK_T": 8, "BLOCK_N": 1, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1},
        "shapes": {
            "4096x7168": {"1": {"BLOCK_T": 1, "BLOCK_N": 1, "BLOCK_K": 1024, "num_warps": 8, "num_stages": 1}},
        },
    },
    # above this many tokens the MLP uses the prefill form (Triton norm + cuBLAS + Triton
    # activation + cuBLAS) instead of the two GEMV kernels
    "norm_mlp_dispatch": {
        "inf": {"MAX_DECODE_TOKENS": 1},
    },
    # fused (input RMSNorm +) q/k/v projection + RoPE, decode form: a program per BLOCK_P rotation
    # pairs (rows i and i + D/2) of one head (q/k norms run after it, in the epilogue kernel). Shapes: Llama-3.1-8B at tensor-parallel size 2
    # (one rank's 16 q + 4 k + 4 v heads of 128 over H 4096), where the grid is half TP=1's and
    # fewer, wider K steps keep the weight stream going (`kernel_bench.py tune`).
    "qkv_decode": {
        "1": {"BLOCK_T": 1, "BLOCK_P": 4, "BLOCK_K": 1024, "num_warps": 2, "num_stages": 1},
        "2": {"BLOCK_T": 2, "BLOCK_P": 2, "BLOCK_K": 512, "num_warps": 2, "num_stages": 1},
        "4": {"BLOCK_T": 4, "BLOCK_P": 2, "BLOCK_K": 512, "num_warps": 2, "num_stages": 1},
        "8": {"BLOCK_T": 8, "BLOCK_P": 1, "BLOCK_K": 512, "num_warps": 2, "num_stages": 1},
        "inf": {"BLOCK_T": 8, "BLOCK_P": 1, "BLOCK_K": 512, "num_warps": 2, "num_stages": 1},
        "shapes": {
            "3072x4096": {"1": {"BLOCK_T": 1, "BLOCK_P": 4, "BLOCK_K": 2048, "num_warps": 4, "num_stages": 1}},
        },
    },
    # The INT4 forms' own tables (int4 weights: triton_gemv.weight_config), K blocks in columns.
    # A step decodes its codes into fp32 registers, so the forms are bound by instruction issue
    # as much as by bytes, and their best blocks differ from the bf16 kernels'; int4_constants
    # still caps a K block by the registers its codes take. T = 1 buckets: `kernel_bench.py tune
    # --source INT4_ENGINE --tables gemv_int4 ...` on the batch-1 decode graphs of int4
    # Llama-3.2-1B (the general buckets) and Qwen2.5-0.5B (its shapes) engines (NOTES.md).
    "gemv_int4": {
        "1": {"BLOCK_T": 1, "BLOCK_N": 2, "BLOCK_K": 2048, "num_warps": 1, "num_stages": 1},
        "2": {"BLOCK_T": 2, "BLOCK_N": 2, "BLOCK_K": 4096, "num_warps": 4, "num_stages": 1},
        "4": {"BLOCK_T": 4, "BLOCK_N": 2, "BLOCK_K": 2048, "num_warps": 2, "num_stages": 1},
        "inf": {"BLOCK_T": 8, "BLOCK_N": 2, "BLOCK_K": 2048, "num_warps": 2, "num_stages": 1},
        "shapes": {  # Qwen2.5-0.5B's o projection and lm_head
            "896x896": {"1": {"BLOCK_T": 1, "BLOCK_N": 4, "BLOCK_K": 4096, "num_warps": 1, "num_stages": 1}},
            "151936x896": {"1": {"BLOCK_T": 1, "BLOCK_N": 4, "BLOCK_K": 4096, "num_warps": 1, "num_stages": 1}},
        },
    },
    "norm_mlp_decode_int4": {
        "1": {"BLOCK_T": 1, "BLOCK_I": 2, "BLOCK_H": 2048, "num_warps": 2, "num_stages": 1},
        "2": {"BLOCK_T": 2, "BLOCK_I": 1, "BLOCK_H": 2048, "num_warps": 2, "num_stages": 1},
        "4": {"BLOCK_T": 4, "BLOCK_I": 2, "BLOCK_H": 2048, "num_warps": 2, "num_stages": 1},
        "inf": {"BLOCK_T": 8, "BLOCK_I": 1, "BLOCK_H": 2048, "num_warps": 2, "num_stages": 1},
        "shapes": {  # Llama-3.1-8B's gate + up (tuned on its int4 engine)
            "28672x4096": {"1": {"BLOCK_T": 1, "BLOCK_I": 4, "BLOCK_H": 2048, "num_warps": 2, "num_stages": 1}},
        },
    },
    "norm_mlp_down_int4": {
        "1": {"BLOCK_T": 1, "BLOCK_N": 2, "BLOCK_K": 8192, "num_warps": 8, "num_stages": 1},
        "4": {"BLOCK_T": 4, "BLOCK_N": 2, "BLOCK_K": 4096, "num_warps": 4, "num_stages": 1},
        "inf": {"BLOCK_T": 8, "BLOCK_N": 1, "BLOCK_K": 4096, "num_warps": 4, "num_stages": 1},
    },
    "qkv_decode_int4": {
        "1": {"BLOCK_T": 1, "BLOCK_P": 1, "BLOCK_K": 4096, "num_warps": 2, "num_stages": 1},
        "4": {"BLOCK_T": 4, "BLOCK_P": 2, "BLOCK_K": 2048, "num_warps": 2, "num_stages": 1},
        "inf": {"BLOCK_T": 8, "BLOCK_P": 1, "BLOCK_K": 2048, "num_warps": 2, "num_stages": 1},
        "shapes": {  # Llama-3.1-8B's q/k/v (as above)
            "6144x4096": {"1": {"BLOCK_T": 1, "BLOCK_P": 1, "BLOCK_K": 4096, "num_warps": 1, "num_stages": 1}},
        },
    },
    # rows up to which fused_qkv_rope uses the decode kernel (cuBLAS + epilogue above)
    "qkv_dispatch": {
        "inf": {"MAX_TOKENS": 2},
    },
    # elementwise/row kernels: one program per row; warps scale with the row length in the
    # wrappers, these are caps
    "norm": {"inf": {"MAX_WARPS": 16}},
    "act": {"inf": {"BLOCK": 1024, "num_warps": 4}},
    # q/k/v epilogue after the cuBLAS projection: BLOCK_T tokens of one head per program
    "qkv_epilogue": {"4": {"BLOCK_T": 1, "num_warps": 1}, "inf": {"BLOCK_T": 16, "num_warps": 4}},
    "kv_store": {"inf": {"num_warps": 1}},
    # Mixture of experts (triton_fused_moe). Decode form: "fused_moe_decode" streams a pair's
    # expert's gate and up rows (BLOCK_I intermediate rows a program, BLOCK_H columns a step),
    # "fused_moe_down" its down rows (BLOCK_N output rows a program, BLOCK_K columns a step), one
    # row of x a program (the one-row layout); num_warps is a cap, as for the GEMV tables. Untuned
    # defaults for H100 at Qwen3-MoE / Mixtral shapes (H 2048-4096, I 768-14336).
    # The T = 1 buckets come from `kernel_bench.py moe --sweep` (H200, one layer timed alone):
    # Qwen3-30B-A3B 42.4 -> 31.8 us, Mixtral-8x7B 213.5 -> 167.6 us.
    # "fused_moe_route": the decode form's routing, BLOCK_R router rows a program, BLOCK_H
    # columns a step (the router is [E, H]: 128 x 2048 for Qwen3-30B-A3B, 8 x 4096 for Mixtral);
    # its T = 1 bucket from `kernel_bench.py moe --sweep` (H200, Qwen3-30B-A3B).
    "fused_moe_route": {
        "1": {"BLOCK_R": 2, "BLOCK_H": 2048, "num_warps": 4, "num_stages": 1},
        "inf": {"BLOCK_R": 2, "BLOCK_H": 1024, "num_warps": 4, "num_stages": 1},
    },
    "fused_moe_decode": {
        "1": {"BLOCK_I": 1, "BLOCK_H": 1024, "num_warps": 4, "num_stages": 1},
        "inf": {"BLOCK_I": 4, "BLOCK_H": 1024, "num_warps": 4, "num_stages": 1},
    },
    "fused_moe_down": {
        "1": {"BLOCK_N": 1, "BLOCK_K": 2048, "num_warps": 4, "num_stages": 1},
        "inf": {"BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 4, "num_stages": 1},
        "shapes": {"2048x768": {"1": {"BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1}}},
    },
    # ... prefill form: both grouped GEMMs. BLOCK_M rows of one expert a block (each expert's rows
    # are padded to whole blocks: small blocks while experts get few rows each), [BLOCK_M, BLOCK_N]
    # output tiles (the gate/up GEMM holds two), BLOCK_K a step, GROUP_M blocks share each weight
    # tile in L2. Untuned.
    "fused_moe_gemm": {
        "128": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 3},
        "inf": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
    },
    # (token, expert) pairs (T * top_k) up to which the mixture runs the decode form
    "fused_moe_dispatch": {
        "inf": {"MAX_DECODE_PAIRS": 16},
    },
}

SHAPES = "shapes"  # a kernel table's key for its per-weight-shape buckets

_active: dict[str, dict[str, Any]] = copy.deepcopy(DEFAULT_CONFIGS)


def _bucket_bound(key: str) -> float:
    return math.inf if key == "inf" else float(int(key))


def _validate_buckets(where: str, buckets: Any) -> None:
    if not isinstance(buckets, Mapping):
        raise CompiledLLMError(f"launch configs of {where} must be an object of buckets")
    for key, cfg in buckets.items():
        if key != "inf" and not (isinstance(key, str) and key.isdigit()):
            raise CompiledLLMError(f"launch config bucket {key!r} of {where} is not a token count")
        if not isinstance(cfg, Mapping) or not all(isinstance(v, int) and v > 0 for v in cfg.values()):
            raise CompiledLLMError(f"launch config {where}[{key!r}] must map names to positive ints")


def validate(configs: Mapping[str, Any]) -> None:
    """Raise CompiledLLMError if ``configs`` is not a table of the shape of DEFAULT_CONFIGS."""
    if not isinstance(configs, Mapping):
        raise CompiledLLMError("launch configs must be a JSON object")
    for kernel, buckets in configs.items():
        if kernel not in DEFAULT_CONFIGS:
            raise CompiledLLMError(f"launch configs name unknown kernel {kernel!r}")
        if not isinstance(buckets, Mapping) or "inf" not in buckets:
            raise CompiledLLMError(f"launch configs of {kernel!r} need an 'inf' bucket")
        _validate_buckets(repr(kernel), {k: v for k, v in buckets.items() if k != SHAPES})
        shapes = buckets.get(SHAPES, {})
        if not isinstance(shapes, Mapping):
            raise CompiledLLMError(f"launch configs of {kernel!r}: {SHAPES!r} must map 'NxK' to buckets")
        for shape, shape_buckets in shapes.items():
            n, _, k = str(shape).partition("x")
            if not (n.isdigit() and k.isdigit()):
                raise CompiledLLMError(f"launch configs of {kernel!r}: shape {shape!r} is not 'NxK' (weight rows x columns)")
            _validate_buckets(f"{kernel!r} at {shape}", shape_buckets)


def _smallest_holding(buckets: Mapping[str, Any], num_tokens: int) -> str | None:
    keys = [k for k in buckets if k != SHAPES and num_tokens <= _bucket_bound(k)]
    return min(keys, key=_bucket_bound) if keys else None


def get(kernel: str, num_tokens: int, shape: tuple[int, int] | None = None) -> dict[str, int]:
    """The config of ``kernel`` for a call with ``num_tokens`` tokens (smallest bucket that
    holds it), over a weight of ``shape`` (rows, columns) where the kernel streams one: that
    shape's own buckets first, if the table has them."""
    buckets = _active[kernel]
    if shape is not None:
        own = buckets.get(SHAPES, {}).get(f"{shape[0]}x{shape[1]}", {})
        key = _smallest_holding(own, num_tokens)
        if key is not None:
            return dict(own[key])
    return dict(buckets[_smallest_holding(buckets, num_tokens)])


def current() -> dict[str, dict[str, Any]]:
    """The active table (a deep copy, JSON-able) for a build to store in its artifact."""
    return copy.deepcopy(_active)


def use_configs(configs: Mapping[str, Any] | None) -> None:
    """Install a stored table (kernels it does not name keep their defaults, and a kernel it
    names keeps nothing else, its shapes' buckets included); None resets."""
    global _active
    table = copy.deepcopy(DEFAULT_CONFIGS)
    if configs is not None:
        validate(configs)
        for kernel, buckets in configs.items():
            table[kernel] = copy.deepcopy(dict(buckets))
    _active = table


def to_json(configs: Mapping[str, Any] | None = None) -> str:
    return json.dumps(current() if configs is None else configs, indent=1, sort_keys=True)
