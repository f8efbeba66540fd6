"""Semantic ops of the spec, in the ``cllm::`` namespace.

Each op is a ``torch.library.custom_op`` with a fake (meta) implementation and a reference
implementation in plain torch that runs on any device. They are opaque to torch.export and FX:
the exported graph names them, fusion passes match them, and kernel providers replace them.

Numerics follow Hugging Face: norms and softmax accumulate in float32 and cast back.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# ---------------------------------------------------------------------------------------------
# Pure reference functions (also used by fused ops' references and by kernel tests)
# ---------------------------------------------------------------------------------------------


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def layer_norm_ref(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    y = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
    return y.to(x.dtype)


def rotary_ref(x: Tensor, positions: Tensor, cos_sin: Tensor) -> Tensor:
    """Neox-style rotation (rotate halves) of x[T, H, D] at positions[T]; cos_sin[P, D] holds
    cos in its first half and sin in its second."""
    half = x.shape[-1] // 2
    cs = cos_sin.index_select(0, positions).unsqueeze(1)  # [T, 1, D]
    cos, sin = cs[..., :half], cs[..., half:]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def kv_store_ref(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write k, v [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at the flat
    slots; rows with slot -1 (padding) write nowhere."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat[0].index_copy_(0, slots, k[keep].to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v[keep].to(kv_cache.dtype))


def paged_attention_read_ref(
    q: Tensor,
    kv_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
) -> Tensor:
    """Causal attention of packed queries q[T, Hq, D] over each sequence's paged context.

    Sequence s owns rows query_start_loc[s]:query_start_loc[s+1] of q; they are the last
    tokens of its context of seq_lens[s] tokens, whose keys/values sit in the blocks listed in
    block_tables[s]. Rows past query_start_loc[-1] (padding) are left zero.
    """
    out = torch.zeros_like(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size = kv_cache.shape[2]
    kv_heads = kv_cache.shape[3]
    group = num_heads // kv_heads
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, ctx_len in enumerate(lens):
        start, end = qsl[s], qsl[s + 1]
        n_q = end - start
        if n_q == 0 or ctx_len == 0:
            continue
        n_blocks = (ctx_len + block_size - 1) // block_size
        blocks = block_tables[s, :n_blocks].long()
        k = kv_cache[0].index_select(0, blocks).reshape(-1, kv_heads, head_dim)[:ctx_len]
        v = kv_cache[1].index_select(0, blocks).reshape(-1, kv_heads, head_dim)[:ctx_len]
        k = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.float().repeat_interleave(group, dim=1)
        qs = q[start:end].float()  # [n, Hq, D]
        scores = torch.einsum("nhd,lhd->hnl", qs, k) * scale
        q_pos = torch.arange(ctx_len - n_q, ctx_len, device=q.device)
        k_pos = torch.arange(ctx_len, device=q.device)
        mask = k_pos[None, :] > q_pos[:, None]
        scores = scores.masked_fill(mask[None], float("-inf"))
        probs = scores.softmax(-1)
        out[start:end] = torch.einsum("hnl,lhd->nhd", probs, v).to(q.dtype)
    return out


def rope_cos_sin(head_dim: int, max_positions: int, theta: float, scaling=None) -> Tensor:
    """cos/sin table [max_positions, head_dim] in float32 (llama3 frequency scaling when
    ``scaling`` is given)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None:
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    inv_freq = inv_freq.float()
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


# ---------------------------------------------------------------------------------------------
# The cllm:: ops
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("cllm::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return rms_norm_ref(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("cllm::layer_norm", mutates_args=())
def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    return layer_norm_ref(x, weight, bias, eps)


@layer_norm.register_fake
def _(x, weight, bias, eps):
    return torch.empty_like(x)


@torch.library.custom_op("cllm::rotary_embedding", mutates_args=())
def rotary_embedding(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor]:
    return rotary_ref(q, positions, cos_sin), rotary_ref(k, positions, cos_sin)


@rotary_embedding.register_fake
def _(q, k, positions, cos_sin):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("cllm::paged_attention", mutates_args=("kv_cache",))
def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
) -> Tensor:
    """Write this step's k/v into the layer's cache, then attend (see paged_attention_read_ref)."""
    kv_store_ref(k, v, kv_cache, slot_mapping)
    return paged_attention_read_ref(q, kv_cache, query_start_loc, seq_lens, block_tables, scale)


@paged_attention.register_fake
def _(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_tables, scale):
    return torch.empty_like(q)


SEMANTIC_OPS = {
    "rms_norm": rms_norm,
    "layer_norm": layer_norm,
    "rotary_embedding": rotary_embedding,
    "paged_attention": paged_attention,
}
