"""Compiled GPU kernels inside an engine, so that loading one JIT-compiles nothing.

Triton compiles a kernel the first time each specialisation of it is launched (dtypes, constant
block sizes, argument alignments), which cost a fresh process some 20 s before its first token.
A CUDA build therefore runs the runtime over the engine it just wrote, with Triton's
compile cache pointed at the engine's ``kernels/triton/`` (``triton_cache_at``): the KV-cache
sizing step, every decode and prefill graph bucket and both sampler variants, which is what the
runtime launches, split over several processes so that the compiles run in parallel. That
warm-up belongs to the runtime's layer (``serve/kernel_warmup.py``), which hands it to
``build_engine``; this module keeps what an engine's kernel files are before and after it. The
cache files are listed and checksummed in the manifest like every other file.

At load (``use_engine_kernels``) those files are copied, once per distinct set, into a cache
directory of this user (``<compiled_llm cache>/triton/<digest>``) and Triton is pointed there:
not at the engine itself, which may be read-only and should not change when it runs, and not
at Triton's shared cache, which an engine must not be able to fill with entries for other
programs. A kernel the build did not meet (another GPU, other engine options) compiles on first
use into that same directory, so it too is compiled once.

What an engine ships is GPU code (cubins) and its metadata, nothing else: Triton also caches the
host-side launcher it compiles for each kernel signature (a shared library), and those stay on
the machine that built them (``split_host_binaries``): a load refuses an engine whose kernel
directory holds anything but the GPU artifacts (``GPU_ARTIFACTS``), so opening an engine never
loads a host binary from it. On a machine that did not build the engine, Triton compiles the
launchers on first use (seconds, once). Cubins are still code for the GPU: load only engines you
built or trust.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from compiled_llm.cache_dir import cache_root
from compiled_llm.errors import EngineError

log = logging.getLogger(__name__)

KERNELS_DIR = "kernels/triton"  # inside an engine directory

# What Triton's cache holds for a compiled kernel (the group index is JSON); host-side
# launchers and driver helpers are shared libraries, which engines never carry.
GPU_ARTIFACTS = (".cubin", ".json", ".ptx", ".ttir", ".ttgir", ".llir", ".source", ".amdgcn", ".hsaco")


@contextlib.contextmanager
def triton_cache_at(path: Path) -> Iterator[None]:
    """Triton's compile cache is ``path`` for the duration (restored afterwards)."""
    import triton  # optional: CPU installs may not have it; only CUDA builds come here

    knobs = triton.knobs.cache
    previous = knobs.dir
    knobs.dir = str(path)
    try:
        yield
    finally:
        knobs.dir = previous


def remove_partial_entries(engine_dir: Path) -> None:
    """Remove the half-written cache entries a warm-up process killed mid-write left behind
    (Triton writes each entry through a ``tmp.pid_*`` file or directory, then renames it)."""
    for tmp in list((Path(engine_dir) / KERNELS_DIR).rglob("tmp.pid_*")):
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)


def split_host_binaries(engine_dir: Path) -> Path | None:
    """Move Triton cache entries that hold host binaries out of the engine's kernel directory
    into a temporary directory (returned, or None if there were none): see the module docstring."""
    cache = Path(engine_dir) / KERNELS_DIR
    entries = {p.parent for p in cache.rglob("*") if p.is_file() and not p.name.endswith(GPU_ARTIFACTS)}
    if not entries:
        return None
    host = Path(tempfile.mkdtemp(prefix=".host-kernels-", dir=Path(engine_dir).parent))
    for entry in entries:
        shutil.move(str(entry), host / entry.relative_to(cache))
    return host


def install_local(engine_dir: Path, manifest: dict, host: Path | None) -> None:
    """The directory ``use_engine_kernels`` will point Triton at, made now on the building
    machine: the engine's kernels plus the host launchers the build compiled (``host``, moved)."""
    files = engine_kernel_files(manifest)
    if not files:
        return
    target = local_dir(files)
    if not target.is_dir():
        _copy_kernels(Path(engine_dir), manifest["kernel_cache"], files, target, host)
    if host is not None and host.exists():
        shutil.rmtree(host, ignore_errors=True)


def local_dir(files: dict[str, str]) -> Path:
    """This user's Triton cache directory for one set of engine kernel files."""
    digest = hashlib.sha256("\n".join(f"{rel} {files[rel]}" for rel in sorted(files)).encode()).hexdigest()
    return cache_root() / "triton" / digest[:16]


def engine_kernel_files(manifest: dict) -> dict[str, str]:
    """{relative path: sha256} of the kernel cache files an engine lists."""
    root = manifest.get("kernel_cache")
    if not root:
        return {}
    prefix = root.rstrip("/") + "/"
    return {rel: digest for rel, digest in manifest["files"].items() if rel.startswith(prefix)}


def use_engine_kernels(engine_dir: Path, manifest: dict, device: torch.device) -> Path | None:
    """Point Triton at this engine's kernels (see the module docstring); the directory, or
    None for a CPU engine or one that ships none. The files were checksummed by the loader."""
    files = engine_kernel_files(manifest)
    host = [rel for rel in files if not rel.endswith(GPU_ARTIFACTS)]
    if host:
        raise EngineError(f"engine file {host[0]} is not a GPU kernel artifact; engines may not carry host code")
    if torch.device(device).type != "cuda" or not files:
        return None
    target = local_dir(files)
    try:
        if not target.is_dir():
            _copy_kernels(Path(engine_dir), manifest["kernel_cache"], files, target)
    except OSError as e:  # a read-only or full cache directory: run, compiling kernels as needed
        log.warning("cannot unpack the engine's kernels into %s (%s); Triton will compile them", target, e)
        return None
    import triton  # optional: CPU installs may not have it; only CUDA engines come here

    triton.knobs.cache.dir = str(target)
    return target


def _copy_kernels(engine_dir: Path, root: str, files: dict[str, str], target: Path, host: Path | None = None) -> None:
    """Copy the listed files (and the ``host`` entries) to ``target`` through a temporary
    sibling, so a concurrent load never sees half a directory."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        for rel in files:
            dest = tmp / os.path.relpath(rel, root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(engine_dir / rel, dest)
        if host is not None:
            shutil.copytree(host, tmp, dirs_exist_ok=True)
        for group in tmp.rglob("__grp__*.json"):
            _rehome_group(group, tmp, target)
        try:
            tmp.rename(target)
        except OSError:  # another process got there first: its copy is the same files
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("engine kernels copied to %s", target)


def _rehome_group(group: Path, tmp: Path, target: Path) -> None:
    """Triton's group index names its files by absolute path, which pointed into the build's
    directory: point each at the file of that name in the group's own entry under ``target``.
    A child that is not such a file (a path anywhere else on the machine) is refused."""
    try:
        data = json.loads(group.read_text())
        children = data["child_paths"]
        assert isinstance(children, dict)
    except (ValueError, KeyError, AssertionError):
        raise EngineError(f"kernel index {group.name} is malformed; rebuild the engine") from None
    entry = group.parent
    for name, path in children.items():
        base = os.path.basename(str(path))
        if not isinstance(path, str) or not (entry / base).is_file() or (entry / base).is_symlink():
            raise EngineError(f"kernel index {group.name} names {path!r}, outside its entry; refusing to load")
        children[name] = str(target / entry.relative_to(tmp) / base)
    group.write_text(json.dumps({**data, "child_paths": children}))
