"""A weights file's safetensors header, read alone and checked against the model config.

A safetensors file is an 8-byte little-endian header length, a JSON header naming every tensor's
dtype, shape and byte range, then the data. Only the header is read here (its length capped
before reading it), and every tensor in it must be one the model config implies, with the shape
and dtype the config and build options imply: a header whose dtypes were all changed F32 -> I32,
or whose ``embed.weight`` is transposed, is one EngineError naming the file and the tensor, not
a failure inside the first step. The byte ranges must tile the data exactly, so the file holds
nothing but those tensors.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import Any

from compiled_llm.engine import limits
from compiled_llm.engine.build_config import BuildConfig
from compiled_llm.errors import EngineError
from compiled_llm.graph.quantized_ops import int4_group_size
from compiled_llm.model.spec import is_derived, param_shapes
from compiled_llm.model import sharding
from compiled_llm.model.config import ModelConfig

# safetensors dtype -> (torch dtype name, bytes per element)
DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}
MAX_DIMS = 4
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_QUANT_PARTS = ("qweight", "scale", "zero")


def read_header(path: Path, rel: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (torch dtype name, shape)} from the header of ``path``; a one-line
    EngineError when the header is too long, not JSON, or does not describe exactly the data
    that follows it."""
    size = os.stat(path).st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _bad(rel, "it is shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > limits.MAX_SAFETENSORS_HEADER_BYTES or 8 + length > size:
            raise _bad(rel, f"its header length {length} is above {limits.MAX_SAFETENSORS_HEADER_BYTES} bytes "
                            "or past the end of the file")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise _bad(rel, f"its header is not JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise _bad(rel, "its header is not a JSON object")
    tensors, ranges = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise _bad(rel, "its __metadata__ is not a map of strings")
            continue
        dtype, shape, begin, end = _entry(rel, name, entry)
        tensors[name] = (dtype, shape)
        ranges.append((begin, end, name))
    _check_tiling(rel, ranges, size - 8 - length)
    return tensors


def _entry(rel: str, name: str, entry: Any) -> tuple[str, tuple[int, ...], int, int]:
    shown = name[:80]
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise _bad(rel, f"tensor {shown!r} is not described by dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise _bad(rel, f"tensor {shown!r} has the dtype {str(dtype)[:20]!r}, which an engine does not store")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(type(d) is int and 0 <= d < (1 << 40) for d in shape)):
        raise _bad(rel, f"tensor {shown!r} has a malformed shape")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int and 0 <= o < (1 << 62) for o in offsets) or offsets[0] > offsets[1]):
        raise _bad(rel, f"tensor {shown!r} has malformed data_offsets")
    numel = 1
    for d in shape:
        numel *= d
    torch_dtype, itemsize = DTYPES[dtype]
    if offsets[1] - offsets[0] != numel * itemsize:
        raise _bad(rel, f"tensor {shown!r} has {offsets[1] - offsets[0]} bytes of data for its shape {shape} of {dtype}")
    return torch_dtype, tuple(shape), offsets[0], offsets[1]


def _check_tiling(rel: str, ranges: list[tuple[int, int, str]], data_bytes: int) -> None:
    at = 0
    for begin, end, name in sorted(ranges):
        if begin != at:
            raise _bad(rel, f"tensor {name[:80]!r} does not start where the previous one ends")
        at = end
    if at != data_bytes:
        raise _bad(rel, f"its tensors hold {at} bytes but the file has {data_bytes} bytes of data")


# ---------------------------------------------------------------------------------------------
# What the config implies
# ---------------------------------------------------------------------------------------------


def expected_tensors(config: ModelConfig, build: BuildConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, shape)} of every tensor an engine of ``config`` built with ``build`` may
    hold (one rank's, under tensor parallelism): the spec's weights, the
    passes' merged qkv and gate_up, and each linear's quantized form."""
    size = build.tensor_parallel_size
    local = sharding.local_config(config, size)
    dtype, scheme = build.dtype, build.quantization
    shapes = dict(param_shapes(local))
    if size > 1:
        rows = sharding.plan(config, size).vocab_per_rank
        for name in ("embed.weight", "lm_head.weight"):
            if name in shapes:
                shapes[name] = (rows, *shapes[name][1:])
    h, i, qkv = local.hidden_size, local.intermediate_size, local.q_size + 2 * local.kv_size
    for n in range(local.num_layers):
        shapes[f"layers.{n}.qkv.weight"] = (qkv, h)
        shapes[f"layers.{n}.qkv.bias"] = (qkv,)
        shapes[f"layers.{n}.gate_up.weight"] = (2 * i, h)
    out = {name: ("float32" if is_derived(name) else dtype, shape) for name, shape in shapes.items()}
    if size > 1:
        out[sharding.VOCAB_START] = ("int64", (1,))
    if scheme is not None:
        for name, (_, shape) in list(out.items()):
            if len(shape) == 2 and name.endswith(".weight") and "norm" not in name and name != "pos_embed.weight":
                out.update(_quantized(name.removesuffix(".weight"), shape, scheme))
    return out


def _quantized(base: str, shape: tuple[int, ...], scheme: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    n, k = shape
    if scheme == "int8":
        return {f"{base}.weight.qweight": ("int8", (n, k)), f"{base}.weight.scale": ("float32", (n,))}
    if k % 2:
        return {}
    groups = k // int4_group_size(k)
    return {f"{base}.weight.qweight": ("uint8", (n, k // 2)), f"{base}.weight.scale": ("float32", (n, groups)),
            f"{base}.weight.zero": ("float32", (n, groups))}


def check_header(path: Path, rel: str, config: ModelConfig, build: BuildConfig, param_names: list[str],
                 layers: range | None = None) -> None:
    """The header of the weights file ``rel`` holds exactly the weights the program reads, each
    with the dtype and shape the config implies, and every layer of the config (``layers``: a
    pipeline stage's)."""
    tensors = read_header(path, rel)
    expected = expected_tensors(config, build)
    for name in param_names:
        if name not in tensors:
            raise _bad(rel, f"it lacks {name[:80]!r}, which the program reads")
    for name, (dtype, shape) in tensors.items():
        if name not in expected:
            raise _bad(rel, f"it holds {name[:80]!r}, which is no weight of a {config.architecture} engine")
        want_dtype, want_shape = expected[name]
        if shape != want_shape:
            raise _bad(rel, f"tensor {name!r} has the shape {list(shape)}; the model config implies {list(want_shape)}")
        if dtype != want_dtype:
            raise _bad(rel, f"tensor {name!r} is {dtype}; the engine's build stores it as {want_dtype}")
    want = set(layers if layers is not None else range(config.num_layers))
    layers = {int(m.group(1)) for m in map(_LAYER.fullmatch, param_names) if m}
    if layers != want:
        missing = min(want - layers, default=None)
        raise _bad(rel, f"it holds no weights of layer {missing} (model_config num_layers is {config.num_layers})"
                   if missing is not None else "it holds layers the model config does not have")


def _bad(rel: str, why: str) -> EngineError:
    return EngineError(f"engine file {rel} is not a valid weights file: {why}; rebuild the engine")
