"""select_kernels: lower every semantic cllm:: op (attention included) to the provider chosen
for the target device and dtype (``ctx.kernel_choice``, from kernels.registry). A provider op has
the semantic op's schema, so the rewrite only swaps the call target. Matches count the lowered
calls; the chosen provider per op is recorded in the manifest."""

from __future__ import annotations

from torch.fx import GraphModule

from compiled_llm.kernels import registry
from compiled_llm.passes.base import Pass, PassContext, finish


def run(gm: GraphModule, ctx: PassContext) -> int:
    count = 0
    for node in gm.graph.nodes:
        op = registry.semantic_op_name(node.target) if node.op == "call_function" else None
        if op is None:
            continue
        choice = ctx.kernel_choice.get(op, registry.REFERENCE)
        node.target = registry.get_provider(op, choice).overload
        count += 1
    finish(gm)
    return count


PASS = Pass("select_kernels", run, "lower each cllm:: op to the provider chosen for the target device/dtype")
