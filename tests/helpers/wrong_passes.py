"""Passes that rewrite the graph wrongly on purpose: what `compare`'s bisection must name."""

from __future__ import annotations

from compiled_llm.passes.base import aten, finish, is_call, param_name


def drop_q_bias(gm, ctx) -> int:
    """A wrong rewrite: the q projection loses its bias."""
    count = 0
    for node in gm.graph.nodes:
        if is_call(node, aten.linear.default) and len(node.args) == 3 and (param_name(node.args[1]) or "").endswith("q.weight"):
            node.args = node.args[:2]
            count += 1
    finish(gm)
    return count
