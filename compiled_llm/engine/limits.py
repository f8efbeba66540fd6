"""How large each file of an engine may be, checked by its size before a byte of it is read.

A tampered engine can hold a file of any size with a matching checksum (whoever writes an engine
writes its manifest). Parsing a 2 GB JSON file costs several times its size in memory and
minutes, so every file the loader reads is refused by ``stat`` first when it is larger than an
engine of any model this compiled_llm can run would hold. The caps are far above what a build
writes (a manifest of an 8B CUDA engine is about 1 MB, its program under 1 MB, Llama-3's
tokenizer.json 9 MB).
"""

from __future__ import annotations

import os
from pathlib import Path

from compiled_llm.errors import EngineError

MiB = 1 << 20
MAX_MANIFEST_BYTES = 16 * MiB
MAX_PROGRAM_BYTES = 64 * MiB
MAX_TOKENIZER_FILE_BYTES = 128 * MiB
MAX_IR_FILE_BYTES = 64 * MiB
MAX_KERNEL_FILE_BYTES = 256 * MiB
# safetensors' own parser allows 100 MB; a header takes ~150 bytes a tensor (an 8B model: 50 kB)
MAX_SAFETENSORS_HEADER_BYTES = 16 * MiB


def file_cap(rel: str) -> int | None:
    """The most bytes the engine file ``rel`` may have; None for the weights, whose size their
    header and the model config decide (weights_header.py)."""
    if rel.endswith(".safetensors"):
        return None
    if rel.startswith("tokenizer/"):
        return MAX_TOKENIZER_FILE_BYTES
    if rel.startswith("ir/"):
        return MAX_IR_FILE_BYTES
    if rel.startswith("kernels/"):
        return MAX_KERNEL_FILE_BYTES
    return MAX_PROGRAM_BYTES  # program.json and anything else a build may add


def check_size(path: Path, rel: str, cap: int) -> int:
    """The size of ``path``, or a one-line EngineError when it is above ``cap``."""
    size = os.stat(path).st_size
    if size > cap:
        raise EngineError(f"engine file {rel} is {_mib(size)}, above the {_mib(cap)} an engine's {rel} may have; "
                          "refusing to read it")
    return size


def read_capped(path: Path, rel: str, cap: int) -> bytes:
    """The bytes of ``path``, refused by its size before reading (and never more than ``cap``
    read, should it grow meanwhile)."""
    check_size(path, rel, cap)
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise EngineError(f"engine file {rel} grew above {_mib(cap)} while it was read; refusing to read it")
    return data


def _mib(n: int) -> str:
    return f"{n} bytes" if n < MiB else f"{n / MiB:.1f} MiB"
