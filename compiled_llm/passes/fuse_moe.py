"""fuse_moe: a mixture of experts, as the spec writes it, into one ``cllm::fused_moe`` op.

  probs = softmax(to_float(linear(x, W_router)))          weights, ids = topk(probs, k)
  [weights /= sum(weights)]                                 dense = scatter(zeros_like(probs), 1, ids, weights)
  g, u = chunk(matmul(x, GU^T), 2)                         y = matmul(silu(g) * u, D^T)     [E, T, H]
  out = sum(y * dense.t().unsqueeze(-1), 0)  (float32)
      => fused_moe(x, W_router, GU, D, k, renormalize)

When x is an ``rms_norm(h, Wn, eps)`` that nothing else reads (the layer's post-attention norm),
it is folded in too: ``fused_moe(h, ..., renormalize, Wn, eps)``, so the decode form normalises
while it routes instead of in a launch of its own (fuse_residual later gives the op the residual
add after it as well).

The spec holds the experts stacked (``layers.N.experts.gate_up.weight`` [E, 2I, H], each expert's
gate rows then its up rows; ``layers.N.experts.down.weight`` [E, H, I]) and runs every expert on
every token; the op's kernels run only the chosen ones. Anything that does not match this shape
whole (another activation, an expert output read elsewhere) is left as it is, so the graph still
computes what it did.

It runs before ``shard``, which splits the stacked weights along each expert's intermediate
columns and all-reduces the op's output.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from compiled_llm.passes.base import (
    Pass, PassContext, aten, cllm, erase_dead, finish, fold_input_norm, is_call, linear_parts, param_name, single_user,
)

_CASTS = (aten.to.dtype, aten._to_copy.default)


def _only_user(node: Node) -> Node | None:
    return next(iter(node.users)) if single_user(node) else None


def _cast_dtype(node: Node):
    """The dtype a cast node converts to."""
    if node.target == aten.to.dtype:
        return node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    return node.kwargs.get("dtype")


def _is_float_cast(node) -> bool:
    return is_call(node, *_CASTS) and _cast_dtype(node) == torch.float32


def _same_dtype(a: Node, b: Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype


def _is_last_dim(dim, node: Node) -> bool:
    """Whether ``dim`` is the last dim of the 2-D tensor ``node`` computes."""
    val = node.meta.get("val")
    rank = val.dim() if isinstance(val, torch.Tensor) else 2
    return rank == 2 and dim in (-1, 1)


def _router(softmax: Node):
    """(x, router weight node, matched nodes) of ``softmax(to_float(linear(x, W)))`` over the
    last dim, or None."""
    if not is_call(softmax, aten.softmax.int) or not _is_last_dim(softmax.args[1], softmax) or len(softmax.args) > 2:
        return None
    matched = [softmax]
    logits = softmax.args[0]
    while _is_float_cast(logits):
        matched.append(logits)
        logits = logits.args[0]
    val = softmax.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dtype != torch.float32:  # the spec's softmax is float32
        return None
    if not is_call(logits, aten.linear.default):
        return None
    x, w, b = linear_parts(logits)
    return (x, w, [*matched, logits]) if b is None and param_name(w) else None


def _routing(topk: Node):
    """(x, router weight, k, renormalize, dense [T, E] weights node, matched nodes) of the routing
    that ends in ``topk``, or None."""
    router = _router(topk.args[0])
    # topk(probs, k[, dim=-1, largest=True, sorted=True]): the largest k along the experts
    if router is None or len(topk.args) < 2 or topk.kwargs or tuple(topk.args[2:]) not in (
            (), (-1,), (-1, True), (-1, True, True), (1,), (1, True), (1, True, True)):
        return None
    parts = {u.args[1]: u for u in topk.users if u.op == "call_function" and u.target is operator.getitem}
    if set(parts) != {0, 1}:
        return None
    values, ids = parts[0], parts[1]
    weights, renormalize, matched = values, False, [topk, values, ids, *router[2]]
    div = next((u for u in values.users if is_call(u, aten.div.Tensor)), None)
    if div is not None:
        total = div.args[1]
        if not (div.args[0] is values and is_call(total, aten.sum.dim_IntList) and total.args[0] is values
                and tuple(total.args[1]) in ((-1,), (1,)) and tuple(total.args[2:]) == (True,)
                and not total.kwargs):
            return None
        weights, renormalize, matched = div, True, [*matched, div, total]
    scatter = _only_user(weights)
    if not (is_call(scatter, aten.scatter.src) and scatter.args[1] in (1, -1) and scatter.args[2] is ids
            and scatter.args[3] is weights and is_call(scatter.args[0], aten.zeros_like.default)):
        return None
    dense, matched = scatter, [*matched, scatter, scatter.args[0]]
    while single_user(dense) and is_call(_only_user(dense), *_CASTS):
        dense = _only_user(dense)
        matched.append(dense)
    return router[0], router[1], topk.args[1], renormalize, dense, matched


def _only_user_through_casts(node: Node) -> tuple[Node | None, list[Node]]:
    """The single user of ``node`` past any dtype casts, and the casts."""
    casts = []
    user = _only_user(node)
    while is_call(user, *_CASTS):
        casts.append(user)
        user = _only_user(user)
    return user, casts


def _transposed_param(node) -> Node | None:
    """W of ``transpose(W, 1, 2)``, W a weight."""
    if is_call(node, aten.transpose.int) and tuple(node.args[1:]) in ((1, 2), (2, 1), (-2, -1), (-1, -2)):
        return node.args[0] if param_name(node.args[0]) else None
    return None


def _chunk_halves(a: Node, b: Node) -> Node | None:
    """The chunk node when ``a``, ``b`` are items 0 and 1 of ``chunk(t, 2, -1)``."""
    if not (a.op == b.op == "call_function" and a.target is b.target is operator.getitem):
        return None
    chunk = a.args[0]
    if b.args[0] is not chunk or (a.args[1], b.args[1]) != (0, 1) or not is_call(chunk, aten.chunk.default):
        return None
    return chunk if tuple(chunk.args[1:]) in ((2, -1), (2, 2)) and len(chunk.users) == 2 else None


def _experts(out: Node, x: Node):
    """(gate_up weight, down weight, matched nodes) of the experts run densely over the stacked
    weights: ``matmul(silu(g) * u, transpose(D)), g, u = chunk(matmul(x, transpose(GU)), 2)``."""
    if not (is_call(out, aten.matmul.default) and single_user(out)):
        return None
    mul, down_t = out.args
    down = _transposed_param(down_t)
    if down is None or not (is_call(mul, aten.mul.Tensor) and single_user(mul)):
        return None
    act, up = mul.args
    if not (is_call(act, aten.silu.default) and single_user(act)):
        return None
    chunk = _chunk_halves(act.args[0], up)
    if chunk is None:
        return None
    gate_up = chunk.args[0]
    if not (is_call(gate_up, aten.matmul.default) and single_user(gate_up) and gate_up.args[0] is x):
        return None
    gu = _transposed_param(gate_up.args[1])
    if gu is None:
        return None
    return gu, down, [out, mul, act, act.args[0], up, chunk, gate_up, gate_up.args[1], down_t]


def _weighted_sum(dense: Node, x: Node):
    """(gate_up weight, down weight, the sum's last node, matched nodes) of
    ``sum(experts * dense.t().unsqueeze(-1), 0)`` (in float32, cast back), or None."""
    t = _only_user(dense)
    if not is_call(t, aten.t.default):
        return None
    unsqueeze = _only_user(t)
    if not (is_call(unsqueeze, aten.unsqueeze.default) and unsqueeze.args[1] in (-1, 2)):
        return None
    scaled = _only_user(unsqueeze)
    if not is_call(scaled, aten.mul.Tensor) or unsqueeze not in scaled.args:
        return None
    experts = _experts(scaled.args[0] if scaled.args[1] is unsqueeze else scaled.args[1], x)
    if experts is None:
        return None
    total, casts = _only_user_through_casts(scaled)
    if not (is_call(total, aten.sum.dim_IntList) and list(total.args[1]) == [0] and len(total.args) == 2
            and not total.kwargs and all(_is_float_cast(c) for c in casts)):
        return None
    last, back = total, []
    while single_user(last) and is_call(_only_user(last), *_CASTS):
        last = _only_user(last)
        back.append(last)
    if not (_same_dtype(last, x) and _same_dtype(dense, x)):  # the op's weights and output are x's dtype
        return None
    return experts[0], experts[1], last, [t, unsqueeze, scaled, *casts, total, *back, *experts[2]]


def _fuse(gm: GraphModule, ctx: PassContext, topk: Node) -> bool:
    routing = _routing(topk)
    if routing is None:
        return False
    x, router_w, k, renormalize, dense, routing_nodes = routing
    mixture = _weighted_sum(dense, x)
    if mixture is None:
        return False
    gate_up, down, last, expert_nodes = mixture
    with gm.graph.inserting_before(last):
        fused = gm.graph.call_function(cllm.fused_moe.default, (x, router_w, gate_up, down, k, renormalize))
    fused.meta.update({key: v for key, v in last.meta.items() if key == "val"})
    last.replace_all_uses_with(fused)
    erase_dead(gm, [last, *expert_nodes, *routing_nodes])
    fold_input_norm(gm, fused)
    return True


def run(gm: GraphModule, ctx: PassContext) -> int:
    count = sum(_fuse(gm, ctx, node) for node in list(gm.graph.nodes) if is_call(node, aten.topk.default))
    finish(gm)
    return count


PASS = Pass("fuse_moe", run, "a mixture's router, top-k and experts into one fused op")
