"""``--load-format dummy``: an engine that stores no weight matrices. Its build runs the passes on
uninitialised matrices (their values never matter) and stores the small tensors only (norms,
biases, the RoPE tables, a rank's vocabulary start); a load makes each matrix the program reads,
at the shape the model config and build options imply, normally distributed with std 0.02 (as
transformers initialises linears) from a fixed seed, on the device. It measures speed at real
shapes, a 93 GB mixture included, without writing, reading or holding a checkpoint."""

from __future__ import annotations

import torch
from torch import Tensor

from compiled_llm.model.spec import is_derived

SEED = 0
STD = 0.02


def is_dummy(name: str, shape: tuple[int, ...] | torch.Size) -> bool:
    """Whether a dummy engine makes weight ``name`` at load instead of storing it: every matrix
    but a derived table (RoPE's cos/sin, computed from the config)."""
    return len(shape) >= 2 and not is_derived(name)


def stored(params: dict[str, Tensor]) -> dict[str, Tensor]:
    """What a dummy engine's weights file holds of ``params``."""
    return {n: t for n, t in params.items() if not is_dummy(n, t.shape)}


def uninitialised(params: dict[str, Tensor]) -> dict[str, Tensor]:
    """``params`` with each matrix a dummy engine makes at load replaced by uninitialised memory
    on its device (the build's passes read only shapes from them; nothing random is drawn)."""
    return {n: torch.empty_like(t) if is_dummy(n, t.shape) else t for n, t in params.items()}


def make(names: list[str], expected: dict[str, tuple[str, tuple[int, ...]]], device: torch.device) -> dict[str, Tensor]:
    """The matrices ``names`` at their ``expected`` (dtype, shape), random on ``device``."""
    gen = torch.Generator(device=device).manual_seed(SEED)
    out = {}
    for name in names:
        dtype, shape = expected[name]
        out[name] = torch.empty(shape, dtype=getattr(torch, dtype), device=device).normal_(0.0, STD, generator=gen)
    return out
