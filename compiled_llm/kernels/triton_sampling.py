"""Greedy and temperature sampling in one pass over the logits (Gumbel-max), for batches without
top-k/top-p and without per-request seeds.

argmax(logits / T + G) with G ~ Gumbel(0, 1) i.i.d. is a draw from softmax(logits / T), the
same race the torch reference (``ops.exponential_race``) runs with exponential noise
(argmax p / E = argmax log p - log E, and -log E is Gumbel). These kernels are the Triton
providers of ``cllm::temperature_sample`` and ``cllm::greedy_sample`` (providers.py), which the
sampler picks through the kernel registry. The reference makes ~8 passes over a [S, V] fp32
copy of the logits (upcast, scale, softmax, noise, divide, two argmaxes); at 256 rows x 151,936
that is ~2 GB of traffic per decode step. Here the bf16 logits are streamed once: noise comes from Triton's
counter-based Philox (tl.rand) with a per-step seed that lives on the device (drawn from torch's
CUDA generator, so no host sync), and each program keeps a running argmax. Rows with temperature
0 take the plain argmax; an all-greedy batch skips the noise altogether (``greedy_argmax``, which
the decode loop uses instead of torch.argmax: one launch of ~2 µs against ~8 µs at one row).

Split vocabulary. One program per row is latency-bound at small batches (a 151,936-entry row is
~300 KB for one SM: ~100 µs at 16 rows), so each row is cut into SPLITS chunks, one program each,
enough programs to cover the GPU. Each writes its chunk's best (score, index); the last program of
a row to finish (a ticket from an atomic counter, as in the decode attention's split reduce) picks
the row's winner and resets the counter. The winner is the max score with the lowest index among
ties, which does not depend on the order programs finish in: results are deterministic and ties
go to the lowest index, as torch.argmax's do. The noise of element (row, v) is drawn from counter
row * V + v whatever the split, so the split count changes no sample.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compiled_llm.kernels.triton_common import next_pow2, sm_count

BLOCK_V = 1024
MAX_SPLITS = 256  # at one row, 149 chunks of one block each: no chunk loops over loads
PROGRAMS_PER_SM = 4
_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


# The split count and chunk length follow the batch size, which changes from step to step: left
# unspecialised (and BLOCK_S fixed at MAX_SPLITS), so serving never compiles a new variant in the
# middle of a run; only GREEDY picks one of two compiled kernels.
@triton.jit(do_not_specialize=["CHUNK", "SPLITS"])
def _sample_kernel(logits_ptr, temp_ptr, seed_ptr, part_val_ptr, part_idx_ptr, counter_ptr, out_ptr,
                   V, stride_l, CHUNK, SPLITS,
                   GREEDY: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_l
    if GREEDY:
        inv_t = 1.0
        greedy = True
        seed = 0
    else:
        temp = tl.load(temp_ptr + row).to(tl.float32)
        seed = tl.load(seed_ptr)
        greedy = temp <= 0.0
        inv_t = 1.0 / tl.where(greedy, 1.0, temp)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], V, tl.int32)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, V)
    for v0 in range(start, end, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        mask = offs < end
        x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        if GREEDY:
            score = x
        else:
            u = tl.rand(seed, row * V + offs)  # uniform [0, 1), a distinct counter per element
            gumbel = -tl.log(-tl.log(tl.maximum(u, 1e-20)))
            score = tl.where(greedy, x, x * inv_t + gumbel)
        score = tl.where(mask, score, float("-inf"))
        better = score > best  # strict: a later equal score keeps the earlier (lower) index
        best = tl.where(better, score, best)
        best_idx = tl.where(better, offs, best_idx)
    top = tl.max(best, 0)
    idx = tl.min(tl.where(best == top, best_idx, V), 0)
    if SPLITS == 1:
        tl.store(out_ptr + row, idx.to(tl.int64))
    else:
        tl.store(part_val_ptr + row * SPLITS + split, top)
        tl.store(part_idx_ptr + row * SPLITS + split, idx)
        tl.debug_barrier()  # the partial stores precede the release below
        ticket = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLITS - 1:  # the row's last program: every partial is in
            tl.debug_barrier()
            offs_s = tl.arange(0, BLOCK_S)
            mask_s = offs_s < SPLITS
            vals = tl.load(part_val_ptr + row * SPLITS + offs_s, mask=mask_s, other=float("-inf"))
            idxs = tl.load(part_idx_ptr + row * SPLITS + offs_s, mask=mask_s, other=V)
            row_top = tl.max(vals, 0)
            tl.store(out_ptr + row, tl.min(tl.where(vals == row_top, idxs, V), 0).to(tl.int64))
            tl.store(counter_ptr + row, 0)  # zero for the next launch (kernel boundaries order it)


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Per-device ticket counters (zero between launches: each row's last program resets its own)."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024, 2 * (0 if buf is None else buf.numel())), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def num_splits(rows: int, vocab: int, device: torch.device) -> int:
    """Chunks per row: enough programs for PROGRAMS_PER_SM per SM, at most MAX_SPLITS, and no
    chunk under one block."""
    want = triton.cdiv(PROGRAMS_PER_SM * sm_count(device), max(rows, 1))
    return max(1, min(next_pow2(want), MAX_SPLITS, triton.cdiv(vocab, BLOCK_V)))


def _launch(logits: torch.Tensor, temperature: torch.Tensor | None, generator: torch.Generator | None,
            splits: int | None) -> torch.Tensor:
    S, V = logits.shape
    out = torch.empty(S, dtype=torch.int64, device=logits.device)
    if S == 0:
        return out
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    greedy = temperature is None
    temperature = None if greedy else temperature.contiguous()  # the kernel reads row r at temp_ptr + r
    splits = min(splits or num_splits(S, V, logits.device), MAX_SPLITS)
    chunk = triton.cdiv(triton.cdiv(V, splits), BLOCK_V) * BLOCK_V
    splits = triton.cdiv(V, chunk)  # no empty chunk
    seed = out if greedy else torch.randint(0, 2**31 - 1, (1,), dtype=torch.int32, device=logits.device,
                                            generator=generator)
    part_val = torch.empty(S * splits, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(S * splits, dtype=torch.int32, device=logits.device)
    counters = _counters(logits.device, S) if splits > 1 else part_idx
    _sample_kernel[(S, splits)](
        logits, temperature if not greedy else out, seed, part_val, part_idx, counters, out,
        V, logits.stride(0), chunk,
        splits, GREEDY=greedy, BLOCK=BLOCK_V, BLOCK_S=MAX_SPLITS, num_warps=4,
    )
    return out


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, generator: torch.Generator | None = None,
                  splits: int | None = None) -> torch.Tensor:
    """Token ids [S] (int64) drawn from softmax(logits / temperature) per row (argmax where the
    temperature is 0). logits [S, V] in any float dtype, temperature [S] on the same device;
    ``splits`` overrides the chunks per row (tests)."""
    return _launch(logits, temperature, generator, splits)


def greedy_argmax(logits: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """logits.argmax(-1) [S] (int64; ties to the lowest index) of logits [S, V]."""
    return _launch(logits, None, None, splits)
