"""Split a flat program at the ops that write the KV cache, so Inductor compiles only pure code.

Inductor handles a mutation of a view of a graph input (each layer's slice of the KV cache)
by functionalising it: clone the slice, run the op, copy it back. That is a full copy of every
layer's cache per step, and on torch 2.11 CUDA one such copy kernel faulted with dynamic block
counts. The fix is the one vLLM uses: cut the graph at every cache-writing op; the pieces between
cuts (norms, matmuls, fused MLPs, logits) are pure and compile cleanly, the cut ops run as they
are, in place, through their chosen providers.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.fx.passes.split_module import split_module

# Partition labels: the pieces between cuts get even numbers, cut ops odd ones.


def _writes_kv_cache(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and "paged_attention" in str(node.target)


def split_at_cache_writes(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, set[str]]:
    """The split module and the names of its submodules that hold a cache-writing op."""
    part: dict[torch.fx.Node, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if _writes_kv_cache(node):
            part[node] = current + 1
            # the layer's cache view travels with the op that writes it, so no piece outputs a view
            for arg in node.all_input_nodes:
                if arg.op == "call_function" and all(u is node for u in arg.users) and not _writes_kv_cache(arg):
                    if all(a.op == "placeholder" for a in arg.all_input_nodes):
                        part[arg] = current + 1
            current += 2
        elif node not in part:
            part[node] = current
    split = split_module(gm, None, lambda n: part[n], keep_original_order=True)
    cut = {f"submod_{p}" for n, p in part.items() if _writes_kv_cache(n)}
    return split, cut


def compile_pieces(gm: torch.fx.GraphModule, compile_fn: Callable[[torch.nn.Module], torch.nn.Module]) -> torch.fx.GraphModule:
    """Split ``gm`` and replace every pure piece by ``compile_fn(piece)``."""
    split, cut = split_at_cache_writes(gm)
    for name, child in list(split.named_children()):
        if name not in cut:
            setattr(split, name, compile_fn(child))
    return split
