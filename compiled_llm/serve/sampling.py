"""SamplingParams (vLLM conventions) and the batched sampler that runs on the logits' device.

The sampler takes per-row parameters as tensors, so one call serves a batch of requests with
different temperatures, top-k, top-p and seeds. It never syncs with the host; the caller fetches
the sampled ids. Greedy rows (temperature 0) take the argmax. Batches without top-k/top-p and
seeds run the ``cllm::greedy_sample`` / ``cllm::temperature_sample`` kernel the registry picks
for the logits' device and dtype, like every other kernel; the rest run the torch race of
``ops.exponential_race``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Sequence

import torch
from torch import Tensor

from compiled_llm.errors import InvalidRequestError
from compiled_llm.graph import ops
from compiled_llm.kernels import registry


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. temperature 0 means greedy; top_k -1 (or 0) and top_p 1.0
    mean no truncation; seed makes a sampled request reproducible on its own."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    # False skips incremental detokenization (token ids only; stop strings need it on).
    detokenize: bool = True

    def __post_init__(self):
        for name in ("max_tokens", "top_k", "seed"):  # numpy integers and the like, as plain ints
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                object.__setattr__(self, name, int(value))
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_real("temperature", self.temperature, low=0.0)
        _check_int("top_k", self.top_k)
        if self.top_k < 1 and self.top_k not in (-1, 0):
            raise InvalidRequestError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        _check_real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not -(2**63) <= self.seed < 2**64:  # what torch.Generator.manual_seed takes
                raise InvalidRequestError(f"seed must fit in 64 bits (-2**63 .. 2**64 - 1), got {self.seed}")
        for name in ("ignore_eos", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be True or False, got {getattr(self, name)!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is not None and not isinstance(stop, (list, tuple)):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
        if any(not isinstance(s, str) or s == "" for s in stop or ()):
            raise InvalidRequestError("stop strings must be non-empty strings")
        object.__setattr__(self, "stop", tuple(stop or ()))
        ids = self.stop_token_ids
        if ids is not None and not isinstance(ids, (list, tuple)):
            raise InvalidRequestError(f"stop_token_ids must be a list of integers, got {type(ids).__name__}")
        for t in ids or ():
            _check_int("stop_token_ids entry", t, low=0)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids or ()))
        if self.stop and not self.detokenize:
            raise InvalidRequestError("stop strings need detokenize=True")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_int(name: str, value, low: int | None = None) -> None:
    # bool is an int subclass, but True as a token count or a seed is a mistake
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise InvalidRequestError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_real(name: str, value, low: float | None = None) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}")
    if low is not None and value < low:
        raise InvalidRequestError(f"{name} must be >= {low}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row parameters of one batch, on the logits' device."""

    temperature: Tensor  # [S] float32; 0 = greedy
    top_k: Tensor  # [S] int64; vocab size = disabled
    top_p: Tensor  # [S] float32; 1 = disabled
    needs_truncation: bool  # host-known: any row with top-k or top-p
    all_greedy: bool

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], vocab_size: int, device) -> "SamplingTensors":
        sampled = [p for p in params if not p.greedy]
        needs_truncation = any((0 < p.top_k < vocab_size) or p.top_p < 1.0 for p in sampled)
        # One host tensor and one copy for all three rows of numbers (top_k rides as float32:
        # exact for any vocabulary below 2**24).
        host = torch.tensor(
            [
                [p.temperature for p in params],
                [float(p.top_k if p.top_k > 0 else vocab_size) for p in params],
                [p.top_p for p in params],
            ],
            dtype=torch.float32,
        )
        if torch.device(device).type == "cuda":
            host = host.pin_memory()
        dev = host.to(device, non_blocking=True)
        return cls(
            temperature=dev[0],
            top_k=dev[1].long(),
            top_p=dev[2],
            needs_truncation=needs_truncation,
            all_greedy=not sampled,
        )


def truncate_logits(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Set to -inf every logit outside each row's top-k and outside the smallest set of
    highest-probability tokens whose mass reaches top_p. logits are already temperature-scaled."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    drop = ranks[None, :] >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly better tokens
    drop = mass_before >= top_p[:, None]
    drop[:, 0] = False  # the best token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def greedy_ids(logits: Tensor) -> Tensor:
    """logits.argmax(-1) (ties to the lowest index) through the kernel registry's
    ``greedy_sample``: on CUDA the one-pass Triton kernel (split over the vocabulary; ~2 µs at one
    row against ~8 µs for torch.argmax on an H200), the torch reference elsewhere."""
    return registry.kernel_for("greedy_sample", logits.device.type, logits.dtype)(logits)


def sample(
    logits: Tensor,
    st: SamplingTensors,
    generators: Sequence[torch.Generator | None] | None = None,
) -> Tensor:
    """Sampled token ids [S] (int64, on the logits' device)."""
    if st.all_greedy:
        return greedy_ids(logits)
    seeded = generators is not None and any(g is not None for g in generators)
    if not seeded and not st.needs_truncation:
        # the registry's temperature_sample: on CUDA one pass over the logits instead of ~8 over
        # an fp32 copy (see triton_sampling), the torch reference elsewhere
        fn = registry.kernel_for("temperature_sample", logits.device.type, logits.dtype)
        return fn(logits, st.temperature)
    truncate = (lambda scaled: truncate_logits(scaled, st.top_k, st.top_p)) if st.needs_truncation else None
    return ops.exponential_race(logits, st.temperature, truncate, _seeded_noise(logits, generators) if seeded else None)


def _seeded_noise(logits: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """The race's Exp(1) noise, seeded rows drawn from their own generator so that their stream
    does not depend on their neighbours."""
    noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    if any(g is None for g in generators):
        noise.exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return noise


def make_generator(seed: int | None, device) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
