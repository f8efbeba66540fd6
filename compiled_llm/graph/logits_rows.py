"""A program that yields the logits of rows it is given, from a program that yields those of
each query segment's last row.

The spec (``spec.forward``) picks the last row of every segment with one ``index_select`` whose
index is ``query_start_loc[1:] - 1``, then applies the final norm and the lm_head (and, in a
tensor-parallel program, the gather of the vocabulary shards) to those rows only. A request's
prompt log-probabilities need the logits of every prompt position of a prefill chunk: the
variant made here takes the rows to select as one more input, after ``kv_cache``, so the
prefill's one forward pass yields them (as vLLM computes them from the prefill's hidden states),
and the logits of rows nobody asked for are never computed. The original program is left as it
is: steps without such a request, and their CUDA graphs, do not change.
"""

from __future__ import annotations

import copy

import torch

from compiled_llm.errors import EngineError

QUERY_START_LOC = "query_start_loc"
LOGITS_ROWS = "logits_rows"


def _derives_from(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    """Whether ``node`` is computed from ``source`` (through its arguments, transitively)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is source:
            return True
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return False


def last_rows_select(graph: torch.fx.Graph) -> torch.fx.Node:
    """The ``index_select`` of each segment's last row: the one whose index derives from
    ``query_start_loc``. Raises EngineError unless there is exactly one."""
    qsl = next((n for n in graph.nodes if n.op == "placeholder" and n.target == QUERY_START_LOC), None)
    found = [] if qsl is None else [
        n for n in graph.nodes
        if n.op == "call_function" and n.target is torch.ops.aten.index_select.default
        and isinstance(n.args[2], torch.fx.Node) and _derives_from(n.args[2], qsl)
    ]
    if len(found) != 1:
        raise EngineError(
            f"the program has {len(found)} selections of each sequence's last row (expected 1); "
            "it cannot yield the logits of chosen rows"
        )
    return found[0]


def yields_chosen_rows(gm: torch.fx.GraphModule) -> bool:
    """Whether ``with_logits_rows`` can make gm's variant (checked at load, so that a request
    for prompt log-probabilities is refused up front rather than failing inside a step)."""
    try:
        last_rows_select(gm.graph)
    except EngineError:
        return False
    return True


def with_logits_rows(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` that takes one more input, ``logits_rows`` (int64 token rows), and
    yields the logits of those rows, in that order, instead of each segment's last row."""
    out = copy.deepcopy(gm)
    graph = out.graph
    select = last_rows_select(graph)
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        rows = graph.placeholder(LOGITS_ROWS)
    old_index = select.args[2]
    select.update_arg(2, rows)
    # the index's own arithmetic (slice, sub) now feeds nothing
    todo = [old_index]
    while todo:
        n = todo.pop()
        if n.op != "call_function" or n.users:
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        todo.extend(inputs)
    graph.lint()
    out.recompile()
    return out
