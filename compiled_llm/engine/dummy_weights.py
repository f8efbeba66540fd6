"""``--load-format dummy``: an engine that stores no weight matrices. Its build runs the passes on
uninitialised matrices (their values never matter) and stores the small tensors only (norms,
biases, the RoPE tables, a rank's vocabulary start); a load makes each matrix the program reads,
at the shape the model config and build options imply, normally distributed with std 0.02 (as
transformers initialises linears) from a fixed seed, on the device. It measures speed at real
shapes, a 93 GB mixture included, without writing, reading or holding a checkpoint."""

from __future__ import annotations

import json
import zlib

import torch
from torch import Tensor

from compiled_llm.errors import EngineError
from compiled_llm.model.spec import is_derived

SEED = 0
STD = 0.02
METADATA_KEY = "dummy_weights"  # in the weights file's safetensors metadata


def is_dummy(name: str, shape: tuple[int, ...] | torch.Size) -> bool:
    """Whether a dummy engine makes weight ``name`` at load instead of storing it: every matrix
    but a derived table (RoPE's cos/sin, computed from the config)."""
    return len(shape) >= 2 and not is_derived(name)


def stored(params: dict[str, Tensor]) -> dict[str, Tensor]:
    """What a dummy engine's weights file holds of ``params``."""
    return {n: t for n, t in params.items() if not is_dummy(n, t.shape)}


def file_metadata(params: dict[str, Tensor]) -> dict[str, str]:
    """The weights file's metadata entry naming the matrices a load makes, with the dtype and
    shape the build gave each: a load checks them against what the manifest's config implies,
    so an edited config cannot make a different model."""
    made = {n: [str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in params.items() if is_dummy(n, t.shape)}
    return {METADATA_KEY: json.dumps(made, separators=(",", ":"))}


def check_file(metadata: dict[str, str] | None, held: set[str], made: dict[str, tuple[str, tuple[int, ...]]],
               rel: str) -> None:
    """A dummy engine's weights file (its metadata and the names it holds) against the matrices
    the load is about to make; a one-line EngineError for a file built otherwise."""
    stored_held = sorted(held & set(made))
    if stored_held:
        raise EngineError(f"engine file {rel} holds the matrix {stored_held[0]!r} that a dummy engine makes at load: "
                          "its build options say load_format dummy, its weights say otherwise; rebuild the engine")
    try:
        recorded = json.loads((metadata or {})[METADATA_KEY])
    except (KeyError, ValueError, RecursionError):
        raise EngineError(f"engine file {rel} does not record the matrices a dummy engine makes; rebuild the engine") from None
    want = {n: [dtype, list(shape)] for n, (dtype, shape) in made.items()}
    if not isinstance(recorded, dict):
        raise EngineError(f"engine file {rel}'s record of the matrices a dummy engine makes is not a map; rebuild the engine")
    for name in sorted(set(want) | set(recorded)):
        if recorded.get(name) != want.get(name):
            raise EngineError(f"engine file {rel} records the matrix {name[:80]!r} as {str(recorded.get(name))[:60]}, "
                              f"the model config implies {want.get(name)}; rebuild the engine")


def make(names: list[str], expected: dict[str, tuple[str, tuple[int, ...]]], device: torch.device) -> dict[str, Tensor]:
    """The matrices ``names`` at their ``expected`` (dtype, shape), random on ``device``. Each is
    seeded by its name, not by the matrices made before it: a layer's weights are the same
    whichever pipeline stage makes them, so a pipelined dummy engine is the unsplit one's model."""
    gen = torch.Generator(device=device)
    out = {}
    for name in names:
        dtype, shape = expected[name]
        gen.manual_seed(SEED * 2**32 + zlib.crc32(name.encode()))
        out[name] = torch.empty(shape, dtype=getattr(torch, dtype), device=device).normal_(0.0, STD, generator=gen)
    return out
