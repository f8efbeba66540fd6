"""Triton KV store: write this step's k/v rows into the paged cache at their slots.

One program per token writes all of its kv heads (Hkv * head_dim elements, at most a few
thousand). Rows whose slot is -1 (padding of a CUDA-graph bucket) write nowhere; the check is in
the kernel, so the launch is shape-determined and capturable.

``store_slot`` is the one definition of where a slot's row lives; the decode attention kernel
(triton_paged_attention) calls it too, to store the new token's k/v in the same launch that
attends to it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compiled_llm.kernels import launch_configs
from compiled_llm.kernels.triton_common import next_pow2


@triton.jit
def store_slot(cache_ptr, slot, k, v, offs, mask, stride_c_kv, stride_c_blk, stride_c_off, BLOCK_SIZE: tl.constexpr):
    """Write k and v (any shape, cast to the cache dtype) at flat cache slot ``slot`` (int64,
    >= 0); ``offs`` are the elements' offsets inside the slot (heads * stride_h + d * stride_d)."""
    dst = cache_ptr + (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_off + offs
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kv_store_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_c_kv, stride_c_blk, stride_c_off, stride_c_h, stride_c_d,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, BLOCK_HK)[:, None]
        offs_d = tl.arange(0, BLOCK_D)[None, :]
        mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
        k = tl.load(k_ptr + t * stride_kt + offs_h * stride_kh + offs_d * stride_kd, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs_h * stride_vh + offs_d * stride_vd, mask=mask)
        store_slot(cache_ptr, slot, k, v, offs_h * stride_c_h + offs_d * stride_c_d, mask,
                   stride_c_kv, stride_c_blk, stride_c_off, BLOCK_SIZE)


def kv_store(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at the flat
    slots of slot_mapping[T]; slot -1 writes nothing. Same contract as ops.kv_store_ref."""
    T, num_kv_heads, head_dim = k.shape
    if T == 0:
        return
    cfg = launch_configs.get("kv_store", T)
    _kv_store_kernel[(T,)](
        k, v, kv_cache, slot_mapping,
        *k.stride(), *v.stride(), *kv_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_HK=max(2, next_pow2(num_kv_heads)), BLOCK_D=next_pow2(head_dim),
        num_warps=cfg["num_warps"],
    )
