"""What every pass shares: the Pass record, the context it reads and writes, and small FX
helpers for matching semantic ops and swapping weights.

A pass is ``run(gm, ctx) -> matches``: it rewrites the flat graph module in place and may add or
drop weights in ``ctx.params`` (a merged q/k/v weight is added here and the originals dropped by
``cleanup`` once nothing reads them). It must not change what the graph computes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

from compiled_llm.model.config import ModelConfig
from compiled_llm.graph import (  # noqa: F401  (registers cllm:: ops)
    collective_ops as _collective_ops, fused_ops as _fused_ops, ops as _ops, quantized_ops as _quantized_ops,
)
from compiled_llm.graph.export import INPUT_NAMES, PARAM_META

aten = torch.ops.aten
cllm = torch.ops.cllm


@dataclasses.dataclass
class PassContext:
    config: ModelConfig
    params: dict[str, Tensor]  # mutable: passes add merged weights; cleanup drops unused ones
    device_type: str = "cpu"
    dtype: torch.dtype = torch.float32
    kernel_choice: dict[str, str] = dataclasses.field(default_factory=dict)  # op -> provider
    quantization: str | None = None  # weight-only scheme (quantize_weights), None: keep the dtype
    tp_rank: int = 0  # the tensor-parallel rank whose program and weights this build makes (shard)
    tp_size: int = 1


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[GraphModule, PassContext], int]
    description: str = ""


# ---------------------------------------------------------------------------------------------
# FX helpers
# ---------------------------------------------------------------------------------------------


def is_call(node: Any, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def param_name(node: Any) -> str | None:
    """The weight name a node reads if it is a weight placeholder, else None."""
    if isinstance(node, Node) and node.op == "placeholder":
        return node.meta.get(PARAM_META)
    return None


def input_node(gm: GraphModule, name: str) -> Node:
    """The placeholder of one of the batch/cache inputs (token_ids, positions, ...)."""
    assert name in INPUT_NAMES
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder" and PARAM_META not in n.meta]
    return placeholders[INPUT_NAMES.index(name)]


def add_param(gm: GraphModule, ctx: PassContext, name: str, tensor: Tensor) -> Node:
    """A new weight placeholder (inserted after the existing weights) holding ``tensor``."""
    ctx.params[name] = tensor
    first_input = input_node(gm, INPUT_NAMES[0])
    with gm.graph.inserting_before(first_input):
        node = gm.graph.placeholder(name.replace(".", "_"))
    node.meta[PARAM_META] = name
    node.meta["val"] = tensor
    return node


def users(node: Node) -> list[Node]:
    return list(node.users)


def single_user(node: Any) -> bool:
    return isinstance(node, Node) and len(node.users) == 1


def erase_dead(gm: GraphModule, nodes: Iterable[Node]) -> list[Node]:
    """Erase the given nodes that nothing uses any more (latest first); returns them."""
    erased = []
    for node in sorted(set(nodes), key=_topo_index(gm), reverse=True):
        if node.op == "call_function" and not node.users:
            gm.graph.erase_node(node)
            erased.append(node)
    return erased


def _topo_index(gm: GraphModule):
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return lambda n: order[n]


def fold_input_norm(gm: GraphModule, fused: Node) -> None:
    """x = rms_norm(h, w, eps) read only by ``fused`` (its first argument) -> ``fused`` normalises
    h itself: ``(h, ..., w, eps)``, the op's ``norm_weight`` and ``norm_eps`` right after the
    arguments it has (fused_qkv_rope's and fused_moe's schemas put them there)."""
    norm = fused.args[0]
    if not (is_call(norm, cllm.rms_norm.default) and len(norm.args) == 3 and not norm.kwargs):
        return
    if set(norm.users) != {fused}:
        return
    h, weight, eps = norm.args
    fused.args = (h, *fused.args[1:], weight, eps)
    gm.graph.erase_node(norm)


def shape_str(node: Any) -> str | None:
    """The node's output shape as text (symbolic dims included), from export's metadata."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    if isinstance(val, torch.Tensor):
        return str(tuple(val.shape))
    return None


def linear_parts(node: Node) -> tuple[Any, Any, Any]:
    """(input, weight, bias or None) of an aten.linear node (bias positional or keyword)."""
    x, w = node.args[0], node.args[1]
    b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return x, w, b


def same_tensor_type(*nodes: Any) -> bool:
    """Whether all nodes are known (export's metadata) to be tensors of one shape and dtype: an
    elementwise op between them does not broadcast or promote."""
    vals = [n.meta.get("val") if isinstance(n, Node) else None for n in nodes]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return False
    return len({shape_str(n) for n in nodes}) == 1 and len({v.dtype for v in vals}) == 1


def finish(gm: GraphModule) -> None:
    gm.graph.lint()
    gm.recompile()
