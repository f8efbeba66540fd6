"""How a model splits over N tensor-parallel ranks (Megatron-style): which shapes divide, what
each rank's slice of every weight is, and the per-rank model config the runtime runs.

  q/k/v, gate/up, fc     column-parallel: rank r holds its heads' (its intermediate columns') rows
  o, down, proj          row-parallel: rank r holds the matching input columns; the partial sums
                         are all-reduced, and the bias lives on rank 0 (zeros elsewhere) so the
                         sum adds it once
  experts (stacked)      each expert split like an MLP: rank r holds its gate and up rows and the
                         matching down columns of every expert, and the mixture's output (the
                         fused_moe op's) is all-reduced; every rank routes every token alike
  embedding, lm_head     vocabulary-parallel: rank r holds rows [r*V/N, (r+1)*V/N) of the table,
                         the vocabulary padded with zero rows to a multiple of N
  norms, positions       replicated

Experts are split inside, not dealt out whole (expert parallelism): a decode step's chosen
experts then cost each rank the same bytes whatever the router picked, no token moves between
ranks, and the one all-reduce is the one a dense MLP already has.

KV heads split like the q heads when N divides them; with fewer KV heads than ranks each KV head
is replicated on the N / kv_heads ranks whose q heads read it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from compiled_llm.errors import CompiledLLMError
from compiled_llm.model.config import ModelConfig

VOCAB_START = "tp.vocab_start"  # per-rank param: the first vocabulary id of the rank's rows

_COLUMN = ("q", "k", "v", "gate", "up", "fc")
_ROW = ("o", "down", "proj")
_VOCAB = ("embed.weight", "lm_head.weight")
_EXPERTS_GATE_UP = ".experts.gate_up.weight"  # [E, 2I, H], the spec's stacked experts
_EXPERTS_DOWN = ".experts.down.weight"  # [E, H, I]


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    config: ModelConfig  # the whole model's
    size: int  # ranks

    @property
    def heads(self) -> int:
        return self.config.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        return max(self.config.num_kv_heads // self.size, 1)

    @property
    def intermediate(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def moe_intermediate(self) -> int:
        return self.config.moe_intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.config.vocab_size // self.size)

    def kv_head_start(self, rank: int) -> int:
        """The first KV head rank ``rank`` holds."""
        c = self.config
        if c.num_kv_heads >= self.size:
            return rank * self.kv_heads
        return rank // (self.size // c.num_kv_heads)

    def vocab_start(self, rank: int) -> int:
        return rank * self.vocab_per_rank


def plan(config: ModelConfig, size: int) -> ShardPlan:
    """The plan for ``size`` ranks, or a one-line CompiledLLMError naming the shape that does not
    split."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise CompiledLLMError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    c = config
    if c.num_heads % size:
        raise CompiledLLMError(f"cannot split {c.num_heads} attention heads over {size} ranks")
    if c.num_kv_heads % size and size % c.num_kv_heads:
        raise CompiledLLMError(
            f"cannot split {c.num_kv_heads} KV heads over {size} ranks (neither divides the other)"
        )
    if c.intermediate_size % size:
        raise CompiledLLMError(f"cannot split the MLP's {c.intermediate_size} columns over {size} ranks")
    if c.num_experts and c.moe_intermediate_size % size:
        raise CompiledLLMError(f"cannot split the experts' {c.moe_intermediate_size} columns over {size} ranks")
    return ShardPlan(c, size)


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """What one rank computes: its heads and MLP columns; hidden size and vocabulary stay whole
    (the lm_head's logits are gathered before sampling)."""
    if size == 1:
        return config
    p = plan(config, size)
    return dataclasses.replace(
        config, num_heads=p.heads, num_kv_heads=p.kv_heads, intermediate_size=p.intermediate,
        moe_intermediate_size=p.moe_intermediate,
    )


def _role(name: str) -> tuple[str, str] | None:
    """(kind, projection) of a layer weight or bias, e.g. ("column", "q"); None otherwise."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "layers" and parts[3] in ("weight", "bias"):
        proj = parts[2]
        if proj in _COLUMN:
            return "column", proj
        if proj in _ROW:
            return "row", proj
    return None


def shard_param(p: ShardPlan, rank: int, name: str, tensor: Tensor) -> Tensor:
    """Rank ``rank``'s slice of the whole model's weight ``name`` (contiguous)."""
    c = p.config
    if name in _VOCAB:
        rows = p.vocab_per_rank * p.size
        if rows != tensor.shape[0]:
            tensor = torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])
        return tensor.narrow(0, p.vocab_start(rank), p.vocab_per_rank).contiguous()
    if name.endswith(_EXPERTS_GATE_UP):  # each expert's gate rows, then its up rows
        experts, rows, hidden = tensor.shape
        halves = tensor.view(experts, 2, rows // 2, hidden)
        local = halves.narrow(2, rank * p.moe_intermediate, p.moe_intermediate)
        return local.reshape(experts, 2 * p.moe_intermediate, hidden).contiguous()
    if name.endswith(_EXPERTS_DOWN):
        return tensor.narrow(2, rank * p.moe_intermediate, p.moe_intermediate).contiguous()
    role = _role(name)
    if role is None:
        return tensor
    kind, proj = role
    bias = name.endswith(".bias")
    if kind == "column":
        if proj == "q":
            start, length = rank * p.heads * c.head_dim, p.heads * c.head_dim
        elif proj in ("k", "v"):
            start, length = p.kv_head_start(rank) * c.head_dim, p.kv_heads * c.head_dim
        else:
            start, length = rank * p.intermediate, p.intermediate
        return tensor.narrow(0, start, length).contiguous()
    if bias:  # row-parallel bias: added once, by rank 0
        return tensor.clone() if rank == 0 else torch.zeros_like(tensor)
    if proj == "o":
        start, length = rank * p.heads * c.head_dim, p.heads * c.head_dim
    else:
        start, length = rank * p.intermediate, p.intermediate
    return tensor.narrow(1, start, length).contiguous()


def vocab_start_param(p: ShardPlan, rank: int, device) -> Tensor:
    return torch.tensor([p.vocab_start(rank)], dtype=torch.int64, device=device)


def is_vocab_sharded(name: str) -> bool:
    return name in _VOCAB


def is_row_parallel(name: str) -> bool:
    role = _role(name)
    return role is not None and role[0] == "row" and name.endswith(".weight")


def column_projection(name: str) -> str | None:
    """"q", "k", "v", "gate", ... for a column-parallel weight, else None."""
    role = _role(name)
    return role[1] if role is not None and role[0] == "column" and name.endswith(".weight") else None
