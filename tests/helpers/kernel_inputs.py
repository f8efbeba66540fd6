"""Random inputs for the kernel tests (CPU interpreter and GPU alike).

Each builder returns fresh random tensors on the given device and dtype; references are
computed by the tests from graph/ops.py and graph/fused_ops.py. Paged-attention batches hand out
cache blocks in a shuffled order and fill every slot outside the batch's contexts with NaN, so a
kernel that reads past a context or writes outside its slots shows up as NaN or as a changed
slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.graph.ops import rope_cos_sin


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (inf when out has NaN/inf)."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poison_allocator(device: torch.device | str, *sizes: int) -> None:
    """Best effort: leave NaN-filled freed blocks of these element counts (fp32) in the caching
    allocator, so outputs the op allocates next start as NaN and unwritten elements show."""
    if torch.device(device).type != "cuda":
        return
    blocks = [torch.full((n,), float("nan"), device=device) for n in sizes for _ in range(2)]
    del blocks


@dataclass
class AttnCase:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor  # one layer: [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    scale: float
    sliding_window: int = 0
    softcap: float = 0.0

    def args(self, kv_cache=None):
        return (self.q, self.k, self.v, self.kv_cache if kv_cache is None else kv_cache, self.slot_mapping,
                self.query_start_loc, self.seq_lens, self.block_tables, self.scale, self.sliding_window,
                self.softcap)

    def drop_blocks_outside_window(self) -> None:
        """Point every block table entry wholly before its sequence's first window (blocks a
        cache with a window may have given back) at a block of NaN, and fill those blocks with
        NaN too: a kernel that reads one shows it. Needs an extra block nobody writes."""
        block_size = self.kv_cache.shape[2]
        used = {int(b) for s, n in enumerate(self.seq_lens.tolist())
                for b in self.block_tables[s, :-(-n // block_size)]}
        nan_block = next(b for b in range(self.kv_cache.shape[1]) if b not in used)
        self.kv_cache[:, nan_block] = float("nan")
        for s in range(self.seq_lens.shape[0]):
            n_q = int(self.query_start_loc[s + 1] - self.query_start_loc[s])
            first_key = int(self.seq_lens[s]) - n_q - self.sliding_window + 1
            for j in range(max(first_key, 0) // block_size):
                self.kv_cache[:, int(self.block_tables[s, j])] = float("nan")
                self.block_tables[s, j] = nan_block


def attention_case(
    specs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
    pad_rows: int = 0,
    extra_blocks: int = 3,
    max_blocks: int | None = None,
) -> AttnCase:
    """A packed batch of sequences given as (num_cached, num_new) pairs, plus ``pad_rows``
    decode-style padding rows (one token, seq_len 0, slot -1) as a CUDA-graph bucket has."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in specs]
    num_blocks = sum(need) + extra_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    seqs, at = [], 0
    for (cached, new), nb in zip(specs, need):
        seqs.append(ScheduledSeq([0] * new, cached, order[at:at + nb]))
        at += nb
    width = max_blocks or max(max(need), 1)
    b = pack_batch(seqs, block_size, "cpu", max_blocks=width)
    qsl, seq_lens, slots, tables = b.query_start_loc, b.seq_lens, b.slot_mapping, b.block_tables
    if pad_rows:
        last = int(qsl[-1])
        qsl = torch.cat([qsl, torch.arange(last + 1, last + pad_rows + 1, dtype=torch.int32)])
        seq_lens = torch.cat([seq_lens, torch.zeros(pad_rows, dtype=torch.int32)])
        slots = torch.cat([slots, torch.full((pad_rows,), -1, dtype=torch.int64)])
        tables = torch.cat([tables, torch.zeros((pad_rows, width), dtype=torch.int32)])
    T = int(qsl[-1])
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    cached_slots = [  # earlier context gets real values
        seqs[s].block_table[pos // block_size] * block_size + pos % block_size
        for s, (cached, _) in enumerate(specs) for pos in range(cached)
    ]
    if cached_slots:
        flat[:, torch.tensor(cached_slots)] = torch.randn((2, len(cached_slots), num_kv_heads, head_dim), generator=gen)

    def rnd(*shape):
        return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)

    return AttnCase(
        q=rnd(T, num_heads, head_dim),
        k=rnd(T, num_kv_heads, head_dim),
        v=rnd(T, num_kv_heads, head_dim),
        kv_cache=cache.to(device=device, dtype=dtype),
        slot_mapping=slots.to(device),
        query_start_loc=qsl.to(device),
        seq_lens=seq_lens.to(device),
        block_tables=tables.to(device),
        scale=head_dim ** -0.5,
    )


def mlp_glu_inputs(T: int, H: int, I: int, dtype, device, seed: int):
    """(x, norm_weight, eps, gate_up_weight, down_weight) with weights scaled like a trained
    model's (unit-variance activations), so fp16 does not overflow at real sizes."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(shape, generator=gen) * scale + shift).to(device=device, dtype=dtype)

    return (rnd(T, H), rnd(H, scale=0.1, shift=1.0), 1e-6, rnd(2 * I, H, scale=H ** -0.5), rnd(H, I, scale=I ** -0.5))


def mlp_gelu_inputs(T: int, H: int, I: int, dtype, device, seed: int):
    """(x, norm_weight, norm_bias, eps, fc_weight, fc_bias, proj_weight, proj_bias)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(shape, generator=gen) * scale + shift).to(device=device, dtype=dtype)

    return (rnd(T, H, shift=0.5), rnd(H, scale=0.1, shift=1.0), rnd(H, scale=0.1), 1e-5,
            rnd(I, H, scale=H ** -0.5), rnd(I, scale=0.1), rnd(H, I, scale=I ** -0.5), rnd(H, scale=0.1))


def qkv_inputs(T: int, H: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, device, seed: int,
               bias: bool, qk_norm: bool, rope: bool, max_pos: int = 4096):
    """Arguments of cllm::fused_qkv_rope."""
    gen = torch.Generator().manual_seed(seed)
    rows = (num_heads + 2 * num_kv_heads) * head_dim

    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(shape, generator=gen) * scale + shift).to(device=device, dtype=dtype)

    return (
        rnd(T, H),
        rnd(rows, H, scale=H ** -0.5),
        rnd(rows, scale=0.5) if bias else None,
        rnd(head_dim, scale=0.1, shift=1.0) if qk_norm else None,
        rnd(head_dim, scale=0.1, shift=1.0) if qk_norm else None,
        torch.randint(0, max_pos, (T,), generator=gen).to(device),
        rope_cos_sin(head_dim, max_pos, 10000.0).to(device) if rope else None,
        num_heads, num_kv_heads, head_dim, 1e-6,
    )
