"""The batched sampler that runs on the logits' device (the requests' SamplingParams are
``serve/sampling_params.py``).

The sampler takes per-row parameters as tensors, so one call serves a batch of requests with
different temperatures, penalties, top-k, top-p, min-p and seeds. It never syncs with the host;
the caller fetches the sampled ids (and their log-probabilities, when asked, in the same copy). Greedy rows (temperature 0) take the argmax. Batches without top-k/top-p and
seeds run the ``cllm::greedy_sample`` / ``cllm::temperature_sample`` kernel the registry picks
for the logits' device and dtype, like every other kernel; the rest run the torch race of
``ops.exponential_race``.
"""


from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from compiled_llm.graph import ops
from compiled_llm.kernels import registry
from compiled_llm.serve.sampling_params import SAMPLING_COLUMNS, SamplingParams

@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row parameters of one batch, on the logits' device, and what the host knows about
    them (which stages the batch needs at all)."""

    temperature: Tensor  # [S] float32; 0 = greedy
    top_k: Tensor  # [S] int64; vocab size = disabled
    top_p: Tensor  # [S] float32; 1 = disabled
    min_p: Tensor  # [S] float32; 0 = disabled
    presence_penalty: Tensor  # [S] float32; 0 = none
    frequency_penalty: Tensor  # [S] float32; 0 = none
    repetition_penalty: Tensor  # [S] float32; 1 = none
    needs_truncation: bool  # host-known: any sampled row with top-k, top-p or min-p
    all_greedy: bool
    has_penalties: bool

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], vocab_size: int, device) -> "SamplingTensors":
        return cls.from_table(parameter_table(params), vocab_size, device)

    @classmethod
    def from_table(cls, table: np.ndarray, vocab_size: int, device) -> "SamplingTensors":
        """From the rows' parameter table [S, len(SAMPLING_COLUMNS)] float32: one host tensor
        and one copy for all of it (top_k rides as float32: exact below 2**24). Each per-row
        tensor is contiguous."""
        sampled = table[:, 0] > 0
        top_k = table[:, 1]
        truncates = ((top_k > 0) & (top_k < vocab_size)) | (table[:, 2] < 1.0) | (table[:, 3] > 0.0)
        # [7, S]: each parameter's row contiguous, as the kernels index them
        host = torch.from_numpy(np.ascontiguousarray(table[:, :7].T))
        if torch.device(device).type == "cuda":
            host = host.pin_memory()
        dev = host.to(device, non_blocking=True)
        k = dev[1].long()
        return cls(
            temperature=dev[0],
            top_k=torch.where(k > 0, k, vocab_size),
            top_p=dev[2],
            min_p=dev[3],
            presence_penalty=dev[4],
            frequency_penalty=dev[5],
            repetition_penalty=dev[6],
            needs_truncation=bool((truncates & sampled).any()),
            all_greedy=not sampled.any(),
            has_penalties=bool(penalised_rows(table).any()),
        )


def parameter_table(params: Sequence[SamplingParams]) -> np.ndarray:
    """The rows' sampling parameters as a float32 array [S, len(SAMPLING_COLUMNS)]."""
    return np.array([p.sampling_row for p in params], dtype=np.float32).reshape(len(params), len(SAMPLING_COLUMNS))


def penalised_rows(table: np.ndarray) -> np.ndarray:
    return (table[:, 4] != 0.0) | (table[:, 5] != 0.0) | (table[:, 6] != 1.0)


def apply_penalties(
    logits: Tensor,
    output_counts: Tensor,
    prompt_mask: Tensor,
    presence_penalty: Tensor,
    frequency_penalty: Tensor,
    repetition_penalty: Tensor,
) -> Tensor:
    """Penalised float32 logits [S, V]. ``output_counts`` [S, V] counts each token in the
    row's output so far; ``prompt_mask`` [S, V] marks its prompt's tokens. Repetition (every
    seen token: positive logits divided by the penalty, negative ones multiplied), then
    frequency (times the count) and presence (once, if the count is above 0), subtracted."""
    logits = logits.float()
    counts = output_counts.float()
    in_output = output_counts > 0
    seen = prompt_mask | in_output
    rep = repetition_penalty[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency_penalty[:, None] * counts - presence_penalty[:, None] * in_output.float()


def truncate_logits(logits: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor | None = None) -> Tensor:
    """Set to -inf every logit whose probability is below min_p times the most likely token's,
    then every one outside each row's top-k, then every one outside the smallest set of
    highest-probability tokens whose mass reaches top_p. logits are already temperature-scaled."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if min_p is not None:
        # p_i / p_max = exp(l_i - l_max): no softmax needed for the threshold
        ratio = (sorted_logits - sorted_logits[:, :1]).exp()
        sorted_logits = sorted_logits.masked_fill(ratio < min_p[:, None], float("-inf"))
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    drop = ranks[None, :] >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly better tokens
    drop = mass_before >= top_p[:, None]
    drop[:, 0] = False  # the best token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def suppress_tokens(logits: Tensor, rows: Tensor, token_ids: Tensor) -> Tensor:
    """A copy of ``logits`` with logits[rows[i], token_ids[i]] = -inf (the raw logits stay for
    the log-probabilities, which are the model's)."""
    out = logits.clone()
    out.index_put_((rows, token_ids), torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
    return out


def greedy_ids(logits: Tensor) -> Tensor:
    """logits.argmax(-1) (ties to the lowest index) through the kernel registry's
    ``greedy_sample``: on CUDA the one-pass Triton kernel (split over the vocabulary; ~2 µs at one
    row against ~8 µs for torch.argmax on an H200), the torch reference elsewhere."""
    return registry.kernel_for("greedy_sample", logits.device.type, logits.dtype)(logits)


def sample(
    logits: Tensor,
    st: SamplingTensors,
    generators: Sequence[torch.Generator | None] | None = None,
    seen: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Sampled token ids [S] (int64, on the logits' device). ``seen`` = (output counts, prompt
    mask) of the rows, needed when ``st.has_penalties``."""
    if st.has_penalties:
        logits = apply_penalties(logits, *seen, st.presence_penalty, st.frequency_penalty, st.repetition_penalty)
    if st.all_greedy:
        return greedy_ids(logits)
    seeded = generators is not None and any(g is not None for g in generators)
    if not seeded and not st.needs_truncation:
        # the registry's temperature_sample: on CUDA one pass over the logits instead of ~8 over
        # an fp32 copy (see triton_sampling), the torch reference elsewhere
        fn = registry.kernel_for("temperature_sample", logits.device.type, logits.dtype)
        return fn(logits, st.temperature)
    truncate = None
    if st.needs_truncation:
        truncate = lambda scaled: truncate_logits(scaled, st.top_k, st.top_p, st.min_p)  # noqa: E731
    return ops.exponential_race(logits, st.temperature, truncate, seeded_noise(logits, generators) if seeded else None)


def race_candidates(logits: Tensor, temperature: Tensor, k: int, noise: Tensor | None = None) -> Tensor:
    """Each row's k first tokens [S, k] of the race ``ops.exponential_race`` runs with the same
    noise, in the order it ranks them (greedy rows: the k largest logits). The first is the
    race's token; the first of them a grammar allows is the token the race picks when every
    token the grammar refuses is masked, so a row whose sampled token is refused needs no mask
    unless all k are refused."""
    logits = logits.float()
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    if noise is None:
        noise = torch.empty_like(logits).exponential_()
    # log(p / E) up to each row's constant: ranks as the race does, without p's underflow (an
    # allowed token far below a refused favourite would score 0, tied with all the others)
    score = torch.where((temperature > 0)[:, None], logits / temp[:, None] - noise.log(), logits)
    return top_ids(score, min(k, logits.shape[-1]))


# Columns a top_ids pass ranks at once: torch.topk over a whole vocabulary row runs on few
# thread blocks, many times an argmax's time (benchmarks/NOTES.md)
TOP_IDS_CHUNK = 1024


def top_ids(score: Tensor, k: int) -> Tensor:
    """Each row's k highest-scoring ids [S, k], highest first: the k best of each chunk of
    TOP_IDS_CHUNK columns, then the k best of those (every row's best k are among them)."""
    rows, n = score.shape
    if n <= 2 * TOP_IDS_CHUNK or k > TOP_IDS_CHUNK:
        return score.topk(k, dim=-1).indices
    chunks = -(-n // TOP_IDS_CHUNK)
    padded = torch.nn.functional.pad(score, (0, chunks * TOP_IDS_CHUNK - n), value=float("-inf"))
    values, ids = padded.view(rows, chunks, TOP_IDS_CHUNK).topk(k, dim=-1)
    ids = ids + torch.arange(chunks, device=score.device)[None, :, None] * TOP_IDS_CHUNK
    best = values.reshape(rows, -1).topk(k, dim=-1).indices
    return ids.reshape(rows, -1).gather(1, best)


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of one step's sampled tokens under the raw logits, on the device."""

    sampled: Tensor  # [S] float32: each row's sampled token
    rank: Tensor  # [S] int64: 1 + how many tokens are strictly more likely
    top_values: Tensor  # [S, k] float32, descending
    top_ids: Tensor  # [S, k] int64


def token_logprobs(logits: Tensor, ids: Tensor, k: int) -> TokenLogprobs:
    """log_softmax of the raw logits at the sampled ``ids`` [S], their ranks, and each row's k
    most likely tokens (k may be 0)."""
    logprobs = logits.float().log_softmax(dim=-1)
    sampled = logprobs.gather(1, ids[:, None])
    rank = (logprobs > sampled).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], ids[:, None][:, :0])
    return TokenLogprobs(sampled[:, 0], rank, top_values, top_ids)


def seeded_noise(logits: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
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
