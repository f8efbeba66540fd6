"""shard: the captured graph as rank ``ctx.tp_rank`` of ``ctx.tp_size`` computes it (Megatron
tensor parallelism; the split itself is ``model/sharding.py``). With one rank it matches nothing.

  view(linear(x, Wq), [T, H, D])            => view(linear(x, Wq_r), [T, H/N, D])     (k, v: KV heads)
  view(paged_attention(...), [T, H*D])      => view(paged_attention(...), [T, H/N*D])
  linear(x, Wo_r, b)                        => all_reduce(linear(x, Wo_r, b_r))     (o, down, proj;
                                                                                    b_r = b on rank 0, else 0)
  embedding(E, ids)                         => all_reduce(vocab_shard_embedding(E_r, ids, start_r))
  linear(h, E or W_lm)                      => all_gather_columns(linear(h, E_r or W_lm_r), V)
  fused_moe(x, W_router, GU, D, k, ...)     => all_reduce(fused_moe(x, W_router, GU_r, D_r, k, ...))
                                               (each expert's intermediate columns; fuse_moe runs first,
                                               and every rank normalises and routes every token alike)

Every rank's graph is the same; only its weights differ (``start_r`` is a one-element weight),
so one program serves all ranks. The passes after this one see the rank's shapes: head counts
come from the rewritten views, and ``ctx.config`` becomes the rank's config.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from compiled_llm.errors import CompiledLLMError
from compiled_llm.model import sharding
from compiled_llm.passes.base import Pass, PassContext, add_param, aten, cllm, finish, is_call, linear_parts, param_name


def _insert_after(gm: GraphModule, node: Node, target, args: tuple) -> Node:
    """``target(node, *args)`` right after ``node``, taking over every use of it."""
    with gm.graph.inserting_after(node):
        new = gm.graph.call_function(target, (node, *args))
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    if "val" in node.meta:
        new.meta["val"] = node.meta["val"]
    return new


def _local_view(node: Node, p: sharding.ShardPlan) -> bool:
    """Rewrite a head-splitting view's head count (or its flattened width) to the rank's."""
    if not is_call(node, aten.view.default, aten.reshape.default):
        return False
    src, shape = node.args[0], list(node.args[1])
    c = p.config
    if is_call(src, aten.linear.default):
        proj = sharding.column_projection(param_name(linear_parts(src)[1]) or "")
        whole, local = {"q": (c.num_heads, p.heads), "k": (c.num_kv_heads, p.kv_heads),
                        "v": (c.num_kv_heads, p.kv_heads)}.get(proj, (None, None))
        if whole is None or len(shape) != 3 or shape[1] != whole:
            return False
        shape[1] = local
    elif is_call(src, cllm.paged_attention.default):
        if len(shape) != 2 or shape[1] != c.q_size:
            return False
        shape[1] = p.heads * c.head_dim
    else:
        return False
    node.args = (src, shape, *node.args[2:])
    return True


def run(gm: GraphModule, ctx: PassContext) -> int:
    if ctx.tp_size == 1:
        return 0
    p = sharding.plan(ctx.config, ctx.tp_size)
    mixtures = sum(is_call(n, cllm.fused_moe.default) for n in gm.graph.nodes)
    if mixtures != len(ctx.config.moe_layers):  # unfused experts would be split with no all-reduce after them
        raise CompiledLLMError(f"--tensor-parallel-size {ctx.tp_size} needs this mixture of experts fused "
                               f"(fuse_moe matched {mixtures} of its {len(ctx.config.moe_layers)} layers)")
    rank = ctx.tp_rank
    count = 0
    start = None
    for node in list(gm.graph.nodes):
        if _local_view(node, p):
            count += 1
        elif is_call(node, aten.embedding.default) and sharding.is_vocab_sharded(param_name(node.args[0]) or ""):
            if start is None:
                device = ctx.params["embed.weight"].device
                start = add_param(gm, ctx, sharding.VOCAB_START, sharding.vocab_start_param(p, rank, device))
            with gm.graph.inserting_before(node):
                local = gm.graph.call_function(cllm.vocab_shard_embedding.default, (node.args[0], node.args[1], start))
            local.meta.update({k: v for k, v in node.meta.items() if k == "val"})
            node.replace_all_uses_with(local)
            gm.graph.erase_node(node)
            _insert_after(gm, local, cllm.all_reduce.default, ())
            count += 1
        elif is_call(node, cllm.fused_moe.default):
            _insert_after(gm, node, cllm.all_reduce.default, ())
            count += 1
        elif is_call(node, aten.linear.default):
            weight = param_name(linear_parts(node)[1]) or ""
            if sharding.is_row_parallel(weight):
                _insert_after(gm, node, cllm.all_reduce.default, ())
                count += 1
            elif sharding.is_vocab_sharded(weight):
                _insert_after(gm, node, cllm.all_gather_columns.default, (ctx.config.vocab_size,))
                count += 1
    for name, tensor in list(ctx.params.items()):
        if name != sharding.VOCAB_START:
            ctx.params[name] = sharding.shard_param(p, rank, name, tensor)
    ctx.config = sharding.local_config(ctx.config, ctx.tp_size)
    finish(gm)
    return count


PASS = Pass("shard", run, "tensor parallelism: rank-local heads and columns, all-reduce after o/down, vocab-parallel embedding and lm_head")
