"""fuse_norm_mlp: the norm that feeds an MLP, and the MLP, into one op.

  Llama/Qwen: rms_norm -> linear(gate), linear(up) -> silu(gate) * up -> linear(down)
              => fused_rms_norm_glu_mlp(x, norm_w, eps, gate_up_w, down_w)
  Gemma:      the same with gelu(gate, approximate="tanh") (GeGLU)
              => fused_rms_norm_glu_mlp(x, norm_w, eps, gate_up_w, down_w, None, "gelu_tanh")
  GPT-2:      layer_norm -> linear(fc, +bias) -> gelu(tanh) -> linear(proj, +bias)
              => fused_layer_norm_gelu_mlp(...)

A SwiGLU call leaves ``activation`` at its default ("silu"), so Llama/Qwen graphs are what they
were before the argument existed.

The gate and up weights are stored once, concatenated (``layers.N.gate_up.weight``); the
originals are dropped by ``cleanup`` when nothing reads them any more.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from compiled_llm.passes.base import (
    Pass, PassContext, add_param, aten, cllm, erase_dead, finish, is_call, linear_parts, param_name, single_user,
)


def _merged_name(weight_name: str, part: str, merged: str) -> str:
    prefix, _, leaf = weight_name.rpartition(f"{part}.")
    return f"{prefix}{merged}.{leaf}"


def _gelu_approximation(node: Node) -> str:
    """aten.gelu's ``approximate`` ("none" or "tanh"), whether the graph passes it by keyword
    (as export writes it) or by position."""
    return node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")


def _glu_activation(node: Node) -> str | None:
    """The name fused_rms_norm_glu_mlp gives the gate activation ``node`` computes (silu, or
    gelu with the tanh approximation), or None if it is neither."""
    if is_call(node, aten.silu.default):
        return "silu"
    if is_call(node, aten.gelu.default) and _gelu_approximation(node) == "tanh":
        return "gelu_tanh"
    return None


def _fuse_glu(gm: GraphModule, ctx: PassContext, down: Node) -> list[Node]:
    """The nodes the rewrite erased (none if it did not match); likewise _fuse_gelu."""
    mul = down.args[0]
    if not (is_call(mul, aten.mul.Tensor) and single_user(mul)) or linear_parts(down)[2] is not None:
        return []
    act, up = mul.args
    if _glu_activation(act) is None:
        act, up = up, act
    activation = _glu_activation(act)
    if activation is None or not (single_user(act) and is_call(up, aten.linear.default) and single_user(up)):
        return []
    gate = act.args[0]
    if not (is_call(gate, aten.linear.default) and single_user(gate)):
        return []
    n, wg, bg = linear_parts(gate)
    n2, wu, bu = linear_parts(up)
    if n is not n2 or bg is not None or bu is not None or not is_call(n, cllm.rms_norm.default):
        return []
    if set(n.users) != {gate, up}:
        return []
    names = [param_name(w) for w in (wg, wu, down.args[1])]
    if None in names:
        return []
    x, norm_w, eps = n.args
    gate_up = torch.cat([ctx.params[names[0]], ctx.params[names[1]]], dim=0)
    gu_node = add_param(gm, ctx, _merged_name(names[0], "gate", "gate_up"), gate_up)
    args = (x, norm_w, eps, gu_node, down.args[1])
    if activation != "silu":  # silu is the op's default: SwiGLU graphs keep their old form
        args += (None, activation)
    return _replace(gm, down, cllm.fused_rms_norm_glu_mlp.default, args, [mul, act, gate, up, n])


def _fuse_gelu(gm: GraphModule, ctx: PassContext, proj: Node) -> list[Node]:
    gelu = proj.args[0]
    if not (is_call(gelu, aten.gelu.default) and single_user(gelu)) or _gelu_approximation(gelu) != "tanh":
        return []
    fc = gelu.args[0]
    if not (is_call(fc, aten.linear.default) and single_user(fc)):
        return []
    n, wf, bf = linear_parts(fc)
    _, wp, bp = linear_parts(proj)
    if bf is None or bp is None or not is_call(n, cllm.layer_norm.default) or set(n.users) != {fc}:
        return []
    x, nw, nb, eps = n.args
    return _replace(gm, proj, cllm.fused_layer_norm_gelu_mlp.default, (x, nw, nb, eps, wf, bf, wp, bp), [gelu, fc, n])


def _replace(gm: GraphModule, anchor: Node, target, args: tuple, matched: list[Node]) -> list[Node]:
    """Put ``target(*args)`` in the anchor's place, then erase the anchor and the matched nodes
    nothing reads any more; returns the erased nodes."""
    with gm.graph.inserting_before(anchor):
        fused = gm.graph.call_function(target, args)
    fused.meta.update({k: v for k, v in anchor.meta.items() if k == "val"})
    anchor.replace_all_uses_with(fused)
    return erase_dead(gm, [anchor, *matched])


def run(gm: GraphModule, ctx: PassContext) -> int:
    count = 0
    erased: set[Node] = set()
    for node in list(gm.graph.nodes):
        if node in erased or not is_call(node, aten.linear.default):
            continue
        gone = _fuse_glu(gm, ctx, node) or _fuse_gelu(gm, ctx, node)
        erased.update(gone)
        count += bool(gone)
    finish(gm)
    return count


PASS = Pass("fuse_norm_mlp", run, "norm + MLP (SwiGLU, GeGLU or GELU) into one fused op; gate/up weights merged")
