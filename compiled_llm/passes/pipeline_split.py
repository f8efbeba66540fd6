"""pipeline_split: a post-pass program cut at decoder-layer boundaries into N pipeline stages.

Stage k holds layers ``layer_ranges(L, N)[k]``: stage 0 also the embedding, the last stage also
the final norm and the lm_head (and with them the selection of each sequence's last row). Each
node goes to the stage of the weights it reads and of the values it is computed from, the
latest of them; a weight of layer i belongs to layer i's stage, ``embed``/``pos_embed`` to the
first and ``final_norm``/``lm_head`` to the last (a tied lm_head that reads ``embed.weight``
lands in the last stage all the same: it reads the last layer's output). Nodes that read only
the batch (positions' arithmetic, ``query_start_loc`` slices, the KV cache's per-layer views)
belong to no stage and are copied into every stage that needs them.

A stage's program is a flat program of its own weights, the seven batch inputs (its
``kv_cache`` holds only its layers: ``kv_cache[i]`` becomes ``kv_cache[i - first]``) and then
the activations that cross into it: every value computed before the stage and used in or after
it (the residual stream(s) the boundary carries). It returns those that cross out of it, or the
logits for the last stage. Each of them is [num_tokens, ...].

This is not one of the PassManager's passes: it turns one graph into N, after every rewrite ran
on the whole program (so fusions see across layers as they do without pipelining). The build
runs it per tensor-parallel rank; it is pure (the input graph is left as it is).
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch.fx import Graph, GraphModule, Node

from compiled_llm.errors import CompiledLLMError
from compiled_llm.graph.export import PARAM_META

aten = torch.ops.aten
_LAYER = re.compile(r"layers\.(\d+)\.")
_FIRST = ("embed.", "pos_embed.")
_LAST = ("final_norm.", "lm_head.")
ACTIVATION_PREFIX = "stage_input_"


@dataclasses.dataclass(frozen=True)
class StageProgram:
    """One stage: its graph and the weights it takes, in order."""

    gm: GraphModule
    param_names: tuple[str, ...]
    first_layer: int
    num_layers: int
    num_inputs: int  # activations it takes after kv_cache
    num_outputs: int  # activations it returns (the last stage: 1, the logits)


def layer_ranges(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """[first, end) of each stage's layers: as even as can be, the earlier stages one layer more
    when they do not divide (stage 0 also runs the embedding, the last the lm_head, so neither
    end is favoured)."""
    check_size(num_layers, stages)
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for k in range(stages):
        n = base + (k < extra)
        out.append((start, start + n))
        start += n
    return out


def check_size(num_layers: int, stages: int) -> None:
    if type(stages) is not int or stages < 1:
        raise CompiledLLMError(f"pipeline_parallel_size must be an integer >= 1, got {stages!r}")
    if stages > num_layers:
        raise CompiledLLMError(f"--pipeline-parallel-size {stages} is more than the model's {num_layers} layers "
                               f"(each stage holds at least one)")


def _refuse(stages: int, why: str) -> CompiledLLMError:
    return CompiledLLMError(f"cannot split this program into {stages} pipeline stages: {why}")


def _weight_stage(name: str, stage_of_layer: list[int], last: int) -> int | None:
    m = _LAYER.match(name)
    if m:
        layer = int(m.group(1))
        if layer >= len(stage_of_layer):
            raise CompiledLLMError(f"weight {name} names layer {layer} of a {len(stage_of_layer)}-layer model")
        return stage_of_layer[layer]
    if name.startswith(_FIRST):
        return 0
    if name.startswith(_LAST):
        return last
    return None  # shared by every stage that reads it (RoPE tables, a rank's vocabulary start)


def _kv_layer(node: Node, kv: Node) -> int | None:
    """The layer of ``kv_cache[i]`` (``select(kv_cache, 0, i)``); None for any other node."""
    if node.op == "call_function" and node.target is aten.select.int and node.args[0] is kv:
        if node.args[1] != 0 or not isinstance(node.args[2], int):
            raise CompiledLLMError("the program reads the KV cache other than one layer at a time")
        return node.args[2]
    return None


def split(gm: GraphModule, num_layers: int, stages: int) -> list[StageProgram]:
    """``gm`` (a flat program: weights, the seven batch inputs, logits out) as ``stages``
    programs; running them in order, each on its layers' slice of the KV cache and the previous
    one's outputs, computes what ``gm`` computes. A one-line CompiledLLMError when the program
    does not cut at layer boundaries."""
    ranges = layer_ranges(num_layers, stages)
    stage_of_layer = [k for k, (a, b) in enumerate(ranges) for _ in range(a, b)]
    last = stages - 1
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    weights = [n for n in placeholders if PARAM_META in n.meta]
    batch = [n for n in placeholders if PARAM_META not in n.meta]
    if len(batch) != 7 or batch[-1].target != "kv_cache":
        raise _refuse(stages, "it does not take the seven batch inputs, kv_cache last")
    kv = batch[-1]
    (output,) = [n for n in nodes if n.op == "output"]

    # each node's stage (None: it reads only the batch and shared weights)
    stage: dict[Node, int | None] = {}
    for n in weights:
        stage[n] = _weight_stage(n.meta[PARAM_META], stage_of_layer, last)
    for n in batch:
        stage[n] = None
    for n in nodes:
        if n.op != "call_function":
            continue
        found = [stage[i] for i in n.all_input_nodes if stage[i] is not None]
        stage[n] = max(found) if found else None
        layer = _kv_layer(n, kv)
        if layer is not None and layer >= num_layers:
            raise _refuse(stages, f"it reads the KV cache of layer {layer} of {num_layers}")
    for n in nodes:  # the cache is sliced per stage: only one layer's view of it may be read
        if n.op == "call_function" and any(i is kv for i in n.all_input_nodes) and _kv_layer(n, kv) is None:
            raise _refuse(stages, f"node {n.name} reads the whole KV cache")

    def consumer_stage(user: Node) -> int | None:
        return last if user.op == "output" else stage[user]

    # the latest stage that reads each staged value (weights are copied, not carried)
    needed_until: dict[Node, int] = {}
    for n in nodes:
        if n.op != "call_function" or stage[n] is None:
            continue
        users = [consumer_stage(u) for u in n.users]
        needed_until[n] = max([s for s in users if s is not None], default=stage[n])
    (result,) = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    if stage.get(result) != last:
        raise _refuse(stages, "the logits are not computed from the last layer")

    def crossing(k: int) -> list[Node]:
        """Values computed in a stage before k and read in k or after, in graph order."""
        return [n for n in nodes if n in needed_until and stage[n] < k <= needed_until[n]]

    out = []
    for k, (first, end) in enumerate(ranges):
        inputs = crossing(k) if k > 0 else []
        outputs = crossing(k + 1) if k < last else [result]
        out.append(_stage_program(gm, k, stages, first, end, stage, weights, batch, kv, inputs, outputs,
                                  k == last))
    return out


def _stage_program(gm: GraphModule, k: int, stages: int, first: int, end: int, stage: dict, weights: list[Node],
                   batch: list[Node], kv: Node, inputs: list[Node], outputs: list[Node], is_last: bool) -> StageProgram:
    # what stage k computes: its own nodes, and the unstaged ones they (or its outputs) read
    carried = set(inputs)
    keep: set[Node] = set()
    todo = [n for n in gm.graph.nodes if n.op == "call_function" and stage[n] == k]
    todo += [n for n in outputs if n not in carried]
    while todo:
        n = todo.pop()
        if n in keep or n in carried or n.op == "placeholder":
            continue
        if stage[n] is not None and stage[n] != k:
            raise _refuse(stages, f"stage {k} needs {n.name} of stage {stage[n]}, which does not reach it")
        keep.add(n)
        todo.extend(n.all_input_nodes)
    read = {i for n in keep for i in n.all_input_nodes}
    graph = Graph()
    env: dict[Node, Node] = {}
    names = []
    for w in weights:
        if w in read:
            env[w] = graph.placeholder(w.name)
            env[w].meta[PARAM_META] = w.meta[PARAM_META]
            names.append(w.meta[PARAM_META])
    for b in batch:
        env[b] = graph.placeholder(b.name)
    for i, n in enumerate(inputs):
        env[n] = graph.placeholder(f"{ACTIVATION_PREFIX}{i}")
        if "val" in n.meta:
            env[n].meta["val"] = n.meta["val"]
    for n in gm.graph.nodes:
        if n not in keep:
            continue
        copy = graph.node_copy(n, lambda a: env[a])
        layer = _kv_layer(n, kv)
        if layer is not None:
            if not first <= layer < end:
                raise _refuse(stages, f"stage {k} (layers {first}..{end - 1}) reads layer {layer}'s KV cache")
            copy.args = (copy.args[0], 0, layer - first)
        env[n] = copy
    mapped = [env[n] for n in outputs]
    graph.output(tuple(mapped) if not is_last else (mapped[0],))
    graph.lint()
    return StageProgram(GraphModule(gm, graph), tuple(names), first, end - first, len(inputs), len(outputs))
