"""The ``cllm::`` ops a tensor-parallel program communicates with (the ``shard`` pass inserts
them), and the rank-local embedding lookup they follow.

Each runs over torch.distributed's default group (a pipelined engine's: its stage's group, ``set_group``), which the runtime starts with one process per
rank (NCCL on CUDA, gloo on CPU; ``serve/executor``); with no group, or a group of one, the
collectives are the identity, so an unsharded program is their reference. They are ops, not
calls hidden in a kernel, so ``inspect`` shows where a program communicates and ``compare``'s
bisection can stop before or after them.

  all_reduce(x, residual=None)     the sum of every rank's x (plus ``residual``, which every
                                   rank holds whole: the residual add fused after a row-parallel
                                   linear)
  all_gather_columns(x, columns)   the ranks' x side by side along the last dimension, cut to
                                   ``columns`` (the vocabulary, padded to a multiple of N)
  vocab_shard_embedding(w, ids, start)
                                   rows of a rank's slice of the embedding table: token t reads
                                   w[t - start] when this rank holds it, zeros otherwise; the
                                   all-reduce that follows assembles every row
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from compiled_llm.graph.ops import cllm_op


# the tensor-parallel group of this rank's pipeline stage; None: the default group (no pipeline)
_group = None


def set_group(group) -> None:
    """Collectives from now on run over ``group`` (a pipeline stage's tensor-parallel ranks,
    ``serve/executor``), or the default group again with None."""
    global _group
    _group = group


def group_size() -> int:
    """Ranks of the tensor-parallel group (1 without one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(_group)


def all_reduce_ref(x: Tensor, residual: Optional[Tensor] = None) -> Tensor:
    out = x.contiguous().clone()
    if group_size() > 1:
        dist.all_reduce(out, group=_group)
    return out if residual is None else out + residual


def all_gather_columns_ref(x: Tensor, columns: int) -> Tensor:
    n = group_size()
    if n == 1:
        return x[..., :columns].contiguous()
    x = x.contiguous()
    parts = x.new_empty((n, *x.shape))
    if x.is_cuda:
        dist.all_gather_into_tensor(parts, x, group=_group)
    else:
        dist.all_gather(list(parts.unbind(0)), x, group=_group)
    # [N, ..., C] -> [..., N, C] -> [..., N * C]: rank r's columns come r-th
    return parts.movedim(0, -2).reshape(*x.shape[:-1], n * x.shape[-1])[..., :columns].contiguous()


def vocab_shard_embedding_ref(weight: Tensor, token_ids: Tensor, vocab_start: Tensor) -> Tensor:
    local = token_ids - vocab_start
    held = (local >= 0) & (local < weight.shape[0])
    rows = torch.nn.functional.embedding(torch.where(held, local, torch.zeros_like(local)), weight)
    return rows * held.unsqueeze(-1).to(rows.dtype)


def _gathered_like(x: Tensor, columns: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], columns))


def _embedding_like(weight: Tensor, token_ids: Tensor, vocab_start: Tensor) -> Tensor:
    return weight.new_empty((token_ids.shape[0], weight.shape[1]))


all_reduce = cllm_op("all_reduce", all_reduce_ref, fake=lambda x, residual=None: torch.empty_like(x))
all_gather_columns = cllm_op("all_gather_columns", all_gather_columns_ref, fake=_gathered_like)
vocab_shard_embedding = cllm_op("vocab_shard_embedding", vocab_shard_embedding_ref, fake=_embedding_like)
