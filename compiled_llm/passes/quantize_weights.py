"""quantize_weights: weight-only int8 or int4 (``build --quantization``). Each fused linear op and
the lm_head take their weights quantized (schemes in graph/quantized_ops.py), W becoming
(W.qweight, W.scale, W.zero):

  fused_qkv_rope(x, W, b, ...)                => fused_qkv_rope_wq(x, Wq, Ws, Wz, b, ...)
  fused_rms_norm_glu_mlp(x, n, e, W1, W2, r)  => fused_rms_norm_glu_mlp_wq(x, n, e, W1q, W1s, W1z, W2q, W2s, W2z, r)
  fused_layer_norm_gelu_mlp(x, .., W1, b1, W2, b2, r)
                                              => fused_layer_norm_gelu_mlp_wq(x, .., W1q, W1s, W1z, b1, W2q, W2s, W2z, b2, r)
  fused_linear_residual(x, W, b, r)           => fused_linear_residual_wq(x, Wq, Ws, Wz, b, r)
  linear(x, W, b)  (the lm_head)              => linear_wq(x, Wq, Ws, Wz, b)
  cllm::linear(x, W, b)  (row-parallel)       => linear_wq(x, Wq, Ws, Wz, b)

It runs after the fusion passes and before select_kernels. A weight another op still reads (a
tied lm_head's embedding table) stays as it is for that op; ``cleanup`` drops the originals
nothing reads. With no quantization asked for (``ctx.quantization`` None) it matches nothing.
"""

from __future__ import annotations

from torch import Tensor
from torch.fx import GraphModule, Node

from compiled_llm.errors import CompiledLLMError
from compiled_llm.graph import quantized_ops
from compiled_llm.graph.ops import OPS
from compiled_llm.passes.base import Pass, PassContext, add_param, aten, cllm, finish, is_call, linear_parts, param_name

# unquantized op -> (its quantized variant, the names of its weight parameters)
_VARIANTS = {
    cllm.fused_qkv_rope.default: ("fused_qkv_rope_wq", ("qkv_weight",)),
    cllm.fused_rms_norm_glu_mlp.default: ("fused_rms_norm_glu_mlp_wq", ("gate_up_weight", "down_weight")),
    cllm.fused_layer_norm_gelu_mlp.default: ("fused_layer_norm_gelu_mlp_wq", ("fc_weight", "proj_weight")),
    cllm.fused_linear_residual.default: ("fused_linear_residual_wq", ("weight",)),
    cllm.linear.default: ("linear_wq", ("weight",)),
}


def _quantized(gm: GraphModule, ctx: PassContext, weight: Node, done: dict[str, tuple]) -> tuple:
    """The (qweight, scale, zero) nodes of a weight placeholder, made once per weight."""
    name = param_name(weight)
    if name not in done:
        w: Tensor = ctx.params[name]
        try:
            q, scale, zero = quantized_ops.quantize(w, ctx.quantization)
        except ValueError as e:
            raise CompiledLLMError(f"cannot quantize {name} {tuple(w.shape)} to {ctx.quantization}: {e}") from None
        done[name] = (
            add_param(gm, ctx, f"{name}.qweight", q),
            add_param(gm, ctx, f"{name}.scale", scale),
            add_param(gm, ctx, f"{name}.zero", zero) if zero is not None else None,
        )
    return done[name]


def _rewrite(gm: GraphModule, ctx: PassContext, node: Node, done: dict[str, tuple]) -> bool:
    if is_call(node, aten.linear.default):
        x, w, b = linear_parts(node)
        if param_name(w) is None:
            return False
        target, args = cllm.linear_wq.default, (x, *_quantized(gm, ctx, w, done), b)
    elif node.op == "call_function" and node.target in _VARIANTS and not node.kwargs:
        variant, weights = _VARIANTS[node.target]
        names = OPS[node.target.name().split("::")[1].split(".")[0]].params
        args = []
        for arg_name, arg in zip(names, node.args):
            if arg_name in weights:
                if param_name(arg) is None:
                    return False
                args.extend(_quantized(gm, ctx, arg, done))
            else:
                args.append(arg)
        target, args = getattr(cllm, variant).default, tuple(args)
    else:
        return False
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(target, args)
    new.meta["val"] = node.meta.get("val")
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return True


def run(gm: GraphModule, ctx: PassContext) -> int:
    if ctx.quantization is None:
        return 0
    if ctx.quantization not in quantized_ops.SCHEMES:
        raise CompiledLLMError(
            f"unknown quantization {ctx.quantization!r}; the choices are: {', '.join(quantized_ops.SCHEMES)}")
    done: dict[str, tuple] = {}
    count = sum(_rewrite(gm, ctx, node, done) for node in list(gm.graph.nodes))
    finish(gm)
    return count


PASS = Pass("quantize_weights", run, "weight-only int8/int4: fused linear ops and the lm_head read quantized weights")
