"""fuse_residual: a residual add into the op that produces one of its operands, so the add runs
as that op's epilogue instead of as a launch of its own.

  h = r + linear(x, W, b)                     => h = fused_linear_residual(x, W, b, r)
  h = r + fused_rms_norm_glu_mlp(x, ...)      => h = fused_rms_norm_glu_mlp(x, ..., residual=r)
  h = r + fused_layer_norm_gelu_mlp(x, ...)   => h = fused_layer_norm_gelu_mlp(x, ..., residual=r)
  h = r + fused_moe(x, ...)                   => h = fused_moe(x, ..., residual=r)
                                                (the arguments before it left at their defaults
                                                where the op does not give them)
  h = r + all_reduce(p)                       => h = all_reduce(p, r)     (a sharded program's
                                                 row-parallel outputs: the add rides the reduction)
  h = r + all_reduce(linear(x, W, b))         => h = all_reduce(cllm::linear(x, W, b), r)
                                                (the linear then runs the engine's GEMV at decode
                                                sizes, as fused_linear_residual does unsharded)
  h = r + rms_norm(x, w, eps)                 => h = fused_rms_norm_residual(x, w, eps, r)
  rms_norm([all_reduce(]linear(x, W, b)[)])  => rms_norm([all_reduce(]cllm::linear(x, W, b)[)])
                                                (Gemma's sandwich: a sublayer's output is normed
                                                before the residual add, which the norm takes;
                                                the o projection has no add to take, but runs
                                                the engine's GEMV all the same)

Either operand order matches (float addition commutes bit for bit). The producer must have no
other user (its output before the add is needed nowhere else), and the add must neither
broadcast nor promote: both operands and the sum have one shape and dtype.

It runs after fuse_norm_mlp (whose MLPs are producers here) and before fuse_add_norm: once the
residual adds are epilogues, the norms read the fused ops' outputs and fuse_add_norm finds no
add left to take on Llama/Qwen/GPT-2 graphs.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch.fx import GraphModule, Node

from compiled_llm.graph.ops import OPS
from compiled_llm.passes.base import (
    Pass, PassContext, aten, cllm, finish, is_call, linear_parts, same_tensor_type, single_user,
)

# fused MLP or mixture -> how many arguments precede its optional ``residual`` (from its schema)
_MLP_ARITY = {
    OPS[name].overload: OPS[name].params.index("residual")
    for name in ("fused_rms_norm_glu_mlp", "fused_layer_norm_gelu_mlp", "fused_moe")
}


def _plain_add(node: Node) -> bool:
    """aten.add.Tensor of two tensors with alpha 1."""
    return (
        is_call(node, aten.add.Tensor) and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1
        and all(isinstance(a, Node) for a in node.args)
    )


def _mlp_without_residual(node: Node) -> bool:
    """A fused MLP or mixture called positionally (as fuse_norm_mlp and fuse_moe emit them) that
    adds no residual yet; arguments after the residual (the GLU MLP's activation) may follow its
    None."""
    if not is_call(node, *_MLP_ARITY) or node.kwargs:
        return False
    n = _MLP_ARITY[node.target]
    return len(node.args) <= n or node.args[n] is None


def _defaults_up_to(target, args: tuple, n: int) -> tuple:
    """``args`` with the op's defaults appended up to its n-th parameter."""
    if len(args) >= n:
        return args[:n]
    op = OPS[target.name().removeprefix("cllm::")]
    defaults = inspect.signature(op.reference).parameters
    return (*args, *(defaults[name].default for name in op.params[len(args):n]))


def _with_residual(producer: Node, residual: Node) -> tuple[Any, tuple] | None:
    """(target, args) of the op computing ``residual + producer``, or None if there is none."""
    if is_call(producer, aten.linear.default):
        x, w, b = linear_parts(producer)
        return cllm.fused_linear_residual.default, (x, w, b, residual)
    if is_call(producer, cllm.all_reduce.default) and len(producer.args) == 1 and not producer.kwargs:
        return producer.target, (producer.args[0], residual)
    if is_call(producer, cllm.rms_norm.default) and len(producer.args) == 3 and not producer.kwargs:
        return cllm.fused_rms_norm_residual.default, (*producer.args, residual)
    if _mlp_without_residual(producer):
        n = _MLP_ARITY[producer.target]
        return producer.target, (*_defaults_up_to(producer.target, producer.args, n), residual, *producer.args[n + 1:])
    return None


def _to_engine_linear(partial: Node) -> None:
    """A row-parallel aten.linear whose only user is the all-reduce becomes cllm::linear."""
    if is_call(partial, aten.linear.default) and single_user(partial):
        partial.target = cllm.linear.default
        partial.args, partial.kwargs = linear_parts(partial), {}


def _fuse(gm: GraphModule, add: Node) -> bool:
    a, b = add.args
    for producer, residual in ((a, b), (b, a)):
        if producer is residual or not single_user(producer) or not same_tensor_type(producer, residual, add):
            continue
        call = _with_residual(producer, residual)
        if call is None:
            continue
        with gm.graph.inserting_before(add):
            fused = gm.graph.call_function(*call)
        fused.meta["val"] = add.meta["val"]
        add.replace_all_uses_with(fused)
        gm.graph.erase_node(add)
        gm.graph.erase_node(producer)
        if is_call(fused, cllm.all_reduce.default):
            _to_engine_linear(fused.args[0])
        return True
    return False


def _feeds_a_post_norm(node: Node) -> bool:
    """An aten.linear whose only reader is an RMSNorm (a post-norm, before the residual add),
    directly or through its all-reduce (a sharded program's row-parallel o projection)."""
    if not (is_call(node, aten.linear.default) and single_user(node)):
        return False
    reader = next(iter(node.users))
    if is_call(reader, cllm.all_reduce.default) and single_user(reader):
        reader = next(iter(reader.users))
    return is_call(reader, cllm.rms_norm.default)


def run(gm: GraphModule, ctx: PassContext) -> int:
    count = 0
    for node in list(gm.graph.nodes):
        if _plain_add(node) and _fuse(gm, node):
            count += 1
        elif _feeds_a_post_norm(node):
            _to_engine_linear(node)
    finish(gm)
    return count


PASS = Pass("fuse_residual", run, "residual add into the linear, fused MLP or all-reduce producing one operand")
