"""cleanup_noop: drop ops that return their input unchanged (a view/reshape/expand to the same
shape, an alias, a full slice, a dtype conversion to the same dtype), so later passes see the
semantic ops next to each other; and the tensor-metadata asserts export leaves beside a dtype
conversion, which check at trace time what the graph's own metadata already says."""

from __future__ import annotations

import sys

import torch
from torch.fx import GraphModule, Node

from compiled_llm.passes.base import Pass, PassContext, aten, finish, shape_str

_SHAPE_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default)
_ALIAS_OPS = (aten.alias.default, aten.detach.default)


def _is_noop(node: Node) -> bool:
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
        return False
    src = node.args[0]
    if node.target in _ALIAS_OPS:
        return True
    same_shape = shape_str(src) is not None and shape_str(src) == shape_str(node)
    if node.target in _SHAPE_OPS:
        return same_shape
    if node.target == aten.slice.Tensor:
        start = node.args[2] if len(node.args) > 2 else 0
        end = node.args[3] if len(node.args) > 3 else sys.maxsize
        step = node.args[4] if len(node.args) > 4 else 1
        return start in (0, None) and (end is None or (isinstance(end, int) and end >= sys.maxsize)) and step == 1
    if node.target in (aten._to_copy.default, aten.to.dtype):
        val, src_val = node.meta.get("val"), src.meta.get("val")
        return (
            isinstance(val, torch.Tensor) and isinstance(src_val, torch.Tensor)
            and val.dtype == src_val.dtype and val.device == src_val.device and same_shape
            and not node.kwargs.get("memory_format")
        )
    return False


def remove_noops(gm: GraphModule) -> int:
    count = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == aten._assert_tensor_metadata.default and not node.users:
            gm.graph.erase_node(node)
            count += 1
        elif _is_noop(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            count += 1
    return count


def run(gm: GraphModule, ctx: PassContext) -> int:
    count = remove_noops(gm)
    finish(gm)
    return count


PASS = Pass("cleanup_noop", run, "drop views, aliases, slices and casts that return their input unchanged")
