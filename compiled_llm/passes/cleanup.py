"""cleanup: remove dead code and no-op views left by the rewrites, and drop the weights that no
node reads any more (the originals of merged q/k/v and gate/up), so they are not stored."""

from __future__ import annotations

from torch.fx import GraphModule

from compiled_llm.passes.base import Pass, PassContext, finish, param_name
from compiled_llm.passes.cleanup_noop import remove_noops


def run(gm: GraphModule, ctx: PassContext) -> int:
    count = remove_noops(gm)
    before = len(gm.graph.nodes)
    # Mutating ops (paged_attention writes the cache) are impure, so they survive this.
    gm.graph.eliminate_dead_code()
    count += before - len(gm.graph.nodes)
    for node in list(gm.graph.nodes):
        name = param_name(node)
        if name is not None and not node.users:
            gm.graph.erase_node(node)
            ctx.params.pop(name, None)
            count += 1
    finish(gm)
    return count


PASS = Pass("cleanup", run, "dead code, no-op views and unused weights removed")
