"""fuse_qkv_rope: the q/k/v projections of an attention into one matmul (weights and biases
concatenated), with Qwen3's per-head q/k RMSNorm and the neox RoPE fused on its output.

Anchored on each paged_attention call, walking back from its q, k, v arguments:

  v = view(linear(x, Wv, bv), [T, Hkv, D])
  k = [getitem(rotary_embedding(..., 1)] <- [rms_norm(., Wkn)] <- view(linear(x, Wk, bk), [T, Hkv, D])
  q = likewise with index 0, Wq, Wqn, [T, Hq, D]

  => q, k, v = fused_qkv_rope(x, Wqkv, bqkv, Wqn, Wkn, positions, cos_sin, Hq, Hkv, D, eps)

When x is an ``rms_norm(h, Wn, eps_n)`` that nothing else reads (the layer's input norm), it is
folded in too: ``fused_qkv_rope(h, ..., eps, norm_weight=Wn, norm_eps=eps_n)``, so the norm is the
projection's prologue rather than its own launch. A LayerNorm (GPT-2) is not folded: the op has
no LayerNorm prologue.

Head counts come from the views in the graph, not from the config.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from compiled_llm.passes.base import (
    Pass, PassContext, add_param, aten, cllm, erase_dead, finish, fold_input_norm, input_node, is_call, param_name,
    single_user,
)


class _NoMatch(Exception):
    pass


def _need(cond: bool) -> None:
    if not cond:
        raise _NoMatch


def _projection(node: Node, chain: list[Node]):
    """view(linear(x, W, b), [T, H, D]) -> (x, W, b, H, D)."""
    _need(is_call(node, aten.view.default, aten.reshape.default) and single_user(node))
    lin = node.args[0]
    _need(is_call(lin, aten.linear.default) and single_user(lin))
    shape = node.args[1]
    _need(len(shape) == 3 and isinstance(shape[1], int) and isinstance(shape[2], int))
    b = lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")
    chain += [node, lin]
    return lin.args[0], lin.args[1], b, shape[1], shape[2]


def _strip_norm(node: Node, chain: list[Node]):
    """rms_norm(y, w, eps) -> (y, w, eps); anything else -> (node, None, None)."""
    if is_call(node, cllm.rms_norm.default):
        _need(single_user(node))
        chain.append(node)
        return node.args
    return node, None, None


def _match(attn: Node):
    q, k, v = attn.args[:3]
    chain: list[Node] = []
    rope = None
    if is_call(q, operator.getitem) and is_call(k, operator.getitem):
        rope = q.args[0]
        _need(rope is k.args[0] and is_call(rope, cllm.rotary_embedding.default))
        _need(q.args[1] == 0 and k.args[1] == 1 and len(rope.users) == 2)
        _need(single_user(q) and single_user(k))
        chain += [q, k, rope]
        q, k, positions, cos_sin = rope.args
    else:
        positions = cos_sin = None
    q, q_norm, q_eps = _strip_norm(q, chain)
    k, k_norm, k_eps = _strip_norm(k, chain)
    _need((q_norm is None) == (k_norm is None) and q_eps == k_eps)
    xq, wq, bq, hq, dq = _projection(q, chain)
    xk, wk, bk, hk, dk = _projection(k, chain)
    xv, wv, bv, hv, dv = _projection(v, chain)
    _need(xq is xk is xv and dq == dk == dv and hk == hv)
    names = [param_name(w) for w in (wq, wk, wv)]
    _need(None not in names)
    biases = [b for b in (bq, bk, bv) if b is not None]
    _need(len(biases) in (0, 3))
    bias_names = [param_name(b) for b in biases]
    _need(None not in bias_names)
    return dict(
        x=xq, weights=names, biases=bias_names, q_norm=q_norm, k_norm=k_norm, eps=q_eps,
        positions=positions, cos_sin=cos_sin, heads=(hq, hk, dq), chain=chain,
    )


def _merged(name: str, part: str) -> str:
    prefix, _, leaf = name.rpartition(f"{part}.")
    return f"{prefix}qkv.{leaf}"


def _fuse(gm: GraphModule, ctx: PassContext, attn: Node) -> bool:
    try:
        m = _match(attn)
    except _NoMatch:
        return False
    p = ctx.params
    w = add_param(gm, ctx, _merged(m["weights"][0], "q"), torch.cat([p[n] for n in m["weights"]], dim=0))
    b = None
    if m["biases"]:
        b = add_param(gm, ctx, _merged(m["biases"][0], "q"), torch.cat([p[n] for n in m["biases"]], dim=0))
    positions = m["positions"] if m["positions"] is not None else input_node(gm, "positions")
    hq, hkv, d = m["heads"]
    eps = m["eps"] if m["eps"] is not None else ctx.config.norm_eps
    with gm.graph.inserting_before(attn):
        fused = gm.graph.call_function(
            cllm.fused_qkv_rope.default,
            (m["x"], w, b, m["q_norm"], m["k_norm"], positions, m["cos_sin"], hq, hkv, d, eps),
        )
        outs = [gm.graph.call_function(operator.getitem, (fused, i)) for i in range(3)]
    for out, old in zip(outs, attn.args[:3]):
        out.meta["val"] = old.meta.get("val")
    attn.args = (*outs, *attn.args[3:])
    erase_dead(gm, m["chain"])  # the q/k/v linears go: the norm's only reader is now the fused op
    fold_input_norm(gm, fused)
    return True


def run(gm: GraphModule, ctx: PassContext) -> int:
    count = 0
    for node in list(gm.graph.nodes):
        if is_call(node, cllm.paged_attention.default) and _fuse(gm, ctx, node):
            count += 1
    finish(gm)
    return count


PASS = Pass("fuse_qkv_rope", run, "q/k/v projections merged into one matmul, with q/k norm and RoPE fused on its output")
