"""fuse_add_norm: a residual add and the norm that reads it, into one op returning both the
normalised and the summed tensor (the sum still feeds the next residual).

  n = rms_norm(a + b, w, eps)        => (n, s) = fused_add_rms_norm(b, a, w, eps)
  n = layer_norm(a + b, w, bias, eps) => (n, s) = fused_add_layer_norm(b, a, w, bias, eps)
"""

from __future__ import annotations

import operator

from torch.fx import GraphModule, Node

from compiled_llm.passes.base import Pass, PassContext, aten, cllm, finish, is_call, shape_str

_FUSED = {
    cllm.rms_norm.default: cllm.fused_add_rms_norm.default,
    cllm.layer_norm.default: cllm.fused_add_layer_norm.default,
}


def _fuse(gm: GraphModule, norm: Node) -> list[Node]:
    """The nodes the rewrite erased (none if it did not match)."""
    add = norm.args[0]
    if not is_call(add, aten.add.Tensor) or add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
        return []
    residual, x = add.args
    if not (isinstance(residual, Node) and isinstance(x, Node)):
        return []
    # no broadcasting: both operands and the sum have one shape
    shapes = {shape_str(residual), shape_str(x), shape_str(add)}
    if len(shapes) != 1 or None in shapes:
        return []
    with gm.graph.inserting_before(norm):
        fused = gm.graph.call_function(_FUSED[norm.target], (x, residual, *norm.args[1:]))
        normed = gm.graph.call_function(operator.getitem, (fused, 0))
        summed = gm.graph.call_function(operator.getitem, (fused, 1))
    normed.meta["val"] = norm.meta.get("val")
    summed.meta["val"] = add.meta.get("val")
    norm.replace_all_uses_with(normed)
    add.replace_all_uses_with(summed)
    gm.graph.erase_node(norm)
    gm.graph.erase_node(add)
    return [norm, add]


def run(gm: GraphModule, ctx: PassContext) -> int:
    count = 0
    erased: set[Node] = set()
    for node in list(gm.graph.nodes):
        if node in erased or not is_call(node, *_FUSED):
            continue
        gone = _fuse(gm, node)
        erased.update(gone)
        count += bool(gone)
    finish(gm)
    return count


PASS = Pass("fuse_add_norm", run, "residual add + the norm that reads it into one op")
