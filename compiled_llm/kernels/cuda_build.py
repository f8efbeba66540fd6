"""Building the CUDA C++ providers (csrc/*.cu) just in time, once per machine.

Each source is compiled with ``torch.utils.cpp_extension.load_inline`` on the machine that runs it,
into ``<cache>/<name>/<hash of the source, torch and CUDA versions, GPU>``, where ``<cache>`` is
the engine cache's directory (``$COMPILED_LLM_CACHE_DIR``, see ``compiled_llm/cache_dir.py``), so
a second process, or a runtime after a build on the same machine, only loads the cached library.
Building needs nvcc; when it is missing or the compile fails, ``build`` returns no module, once,
with the reason, and the provider runs its Triton kernels.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

from compiled_llm.cache_dir import cache_root

CSRC = Path(__file__).parent / "csrc"


@dataclass(frozen=True)
class CudaSource:
    """One extension: ``csrc/<file>``, the C++ declarations of what it exports, and their names."""

    name: str  # cache folder and module name prefix
    file: str
    declarations: str
    functions: tuple[str, ...]

    def extension(self) -> Optional[ModuleType]:
        """The compiled module, or None if it cannot be built here (reason in ``build_error``)."""
        return build(self).module

    def build_error(self) -> Optional[str]:
        return build(self).error

    def cuda_extension_ok(self) -> bool:
        """Build (or load from the cache) the extension; False when it cannot be compiled here."""
        return build(self).module is not None


@dataclass(frozen=True)
class Built:
    module: Optional[ModuleType]
    error: Optional[str]  # why there is no module


def toolchain_available() -> bool:
    """Cheap check (no compile): a CUDA torch and an nvcc to build with."""
    if torch.version.cuda is None:
        return False
    # cpp_extension is only needed (and its import only paid) where an extension may be built
    from torch.utils.cpp_extension import CUDA_HOME

    return shutil.which("nvcc") is not None or (CUDA_HOME is not None and (Path(CUDA_HOME) / "bin" / "nvcc").exists())


def _build_key(source: str) -> str:
    h = hashlib.sha256()
    for part in (source, torch.__version__, str(torch.version.cuda)):
        h.update(part.encode())
    if torch.cuda.is_available():
        h.update(str(torch.cuda.get_device_capability()).encode())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def build(src: CudaSource) -> Built:
    """The compiled extension of ``src`` (from the cache when it was built before), or why not."""
    if not toolchain_available():
        return Built(None, "no CUDA toolchain (nvcc) or a CPU-only torch")
    try:
        from torch.utils.cpp_extension import load_inline

        source = (CSRC / src.file).read_text()
        key = _build_key(source)
        build_dir = cache_root() / src.name / key
        build_dir.mkdir(parents=True, exist_ok=True)
        module = load_inline(
            name=f"cllm_{src.name}_{key}",
            cpp_sources=src.declarations,
            cuda_sources=source,
            functions=list(src.functions),
            build_directory=str(build_dir),
            extra_cuda_cflags=["-O3"],
            verbose=False,
        )
        return Built(module, None)
    except Exception as e:  # compile/link failure: the provider falls back to Triton
        lines = str(e).strip().splitlines()
        error = f"{type(e).__name__}: {lines[-1] if lines else ''}"
        warnings.warn(f"CUDA extension {src.name} could not be built, using Triton instead: {error}")
        return Built(None, error)
