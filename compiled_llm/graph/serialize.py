"""The post-pass program as JSON: how an engine stores its graph without pickle.

An engine must be safe to load: reading it may not run code that its author planted. Pickle
(and torch.export's .pt2, whose reader unpickles) cannot promise that, so the flat graph is
written as plain data and read back by a loader that can only build calls to a closed set of
targets: ``aten::`` and ``cllm::`` operator overloads (resolved by name through ``torch.ops``,
the same registry the dispatcher uses) and a few ``operator`` functions that symbolic-shape
arithmetic emits. ``aten::`` is not trusted as a whole (``aten::from_file`` maps any file with
write-back): only the pure tensor ops in ``ATEN_OPS`` are, and a build refuses to write a program
calling another, so a spec that needs a new op fails at build, not at load. Anything else is
refused with one line naming the node.

Format (``FORMAT``, version ``VERSION``)::

    {"format": "cllm-fx-graph", "version": 1,
     "nodes": [{"name": "x", "op": "placeholder", "param": "embed.weight" | null},
               {"name": "y", "op": "call_function", "target": "aten::view.default",
                "args": [...], "kwargs": {...}},
               {"name": "output", "op": "output", "args": [...]}]}

Values in args: JSON numbers, strings, booleans and null as themselves; lists as JSON arrays;
``{"node": name}`` for an earlier node, ``{"tuple": [...]}``, ``{"dtype": "bfloat16"}``,
``{"device": "cuda"}``, ``{"layout": "strided"}``, ``{"memory_format": "contiguous_format"}``,
``{"float": "inf" | "-inf" | "nan"}``.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from compiled_llm.errors import EngineError, first_line
from compiled_llm.graph.export import PARAM_META
from compiled_llm.graph.program_check import check_program

FORMAT = "cllm-fx-graph"
VERSION = 1
OP_NAMESPACES = ("aten", "cllm")
# Python functions FX graphs from torch.export call for symbolic sizes (and tuple outputs).
PYTHON_TARGETS = {
    f"operator.{f.__name__}": f
    for f in (operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv,
              operator.truediv, operator.mod, operator.neg, operator.eq, operator.ne, operator.lt,
              operator.le, operator.gt, operator.ge)
}
_PYTHON_NAMES = {f: name for name, f in PYTHON_TARGETS.items()}
# The aten ops the spec's captured graph and every pass's output use (all families, passes on
# or off), plus the shape and arithmetic ops a spec change would most likely add. Pure tensor
# computations only: nothing here touches files, the host or global state.
ATEN_OPS = frozenset(f"aten::{name}" for name in (
    "add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "neg.default", "rsqrt.default",
    "pow.Tensor_Scalar", "exp.default", "tanh.default", "gelu.default", "silu.default",
    "mean.dim", "sum.dim_IntList", "_softmax.default", "embedding.default", "index_select.default",
    "linear.default", "mm.default", "addmm.default", "bmm.default", "matmul.default",
    "select.int", "slice.Tensor", "view.default", "reshape.default", "permute.default",
    "transpose.int", "unsqueeze.default", "squeeze.dim", "expand.default", "clone.default",
    "cat.default", "split.Tensor", "_to_copy.default", "sym_size.int",
    # a mixture of experts as the spec writes it: the router, and the experts over stacked weights
    "to.dtype", "softmax.int", "topk.default", "zeros_like.default", "scatter.src", "chunk.default", "t.default",
))
_ENUMS = {
    "dtype": (torch.dtype, lambda v: str(v).removeprefix("torch.")),
    "layout": (torch.layout, lambda v: str(v).removeprefix("torch.")),
    "memory_format": (torch.memory_format, lambda v: str(v).removeprefix("torch.")),
}


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def graph_to_json(gm: torch.fx.GraphModule) -> dict:
    """The graph of ``gm`` as JSON-ready data (raises ValueError for a node it cannot store)."""
    nodes = []
    for node in gm.graph.nodes:
        entry: dict[str, Any] = {"name": node.name, "op": node.op}
        if node.op == "placeholder":
            entry["param"] = node.meta.get(PARAM_META)
        elif node.op == "call_function":
            entry["target"] = _target_name(node)
            entry["args"] = [_encode(a, node) for a in node.args]
            entry["kwargs"] = {k: _encode(v, node) for k, v in node.kwargs.items()}
        elif node.op == "output":
            entry["args"] = [_encode(a, node) for a in node.args]
        else:
            raise ValueError(f"node {node.name} is a {node.op}; an engine program holds only function calls")
        nodes.append(entry)
    return {"format": FORMAT, "version": VERSION, "nodes": nodes}


def _target_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        name = target.name()  # "ns::op.overload" or "ns::op" for .default
        if "." not in name.partition("::")[2]:
            name += ".default"
        if name.partition("::")[0] not in OP_NAMESPACES or (name.startswith("aten::") and name not in ATEN_OPS):
            raise ValueError(f"node {node.name} calls {name}, which engines may not call (serialize.ATEN_OPS)")
        return name
    if target in _PYTHON_NAMES:
        return _PYTHON_NAMES[target]
    raise ValueError(f"node {node.name} calls {target!r}, which an engine program cannot store")


def _encode(value: Any, node: torch.fx.Node) -> Any:
    if isinstance(value, torch.fx.Node):
        return {"node": value.name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, node) for v in value]}
    if isinstance(value, list):  # immutable_list included
        return [_encode(v, node) for v in value]
    if isinstance(value, torch.device):
        return {"device": value.type}
    for key, (kind, name) in _ENUMS.items():
        if isinstance(value, kind):
            return {key: name(value)}
    raise ValueError(f"node {node.name} has an argument of type {type(value).__name__}, which an engine cannot store")


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def graph_from_json(data: Any, param_names: list[str] | None = None, device: str | None = None,
                    activations: int = 0) -> torch.fx.GraphModule:
    """Rebuild the graph module, once the document passed ``program_check.check_program``
    (``param_names``: the weights it must take, in order; ``device``: the only device it may
    name); every problem is an EngineError of one line."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise EngineError(f"the program is not a {FORMAT} document; rebuild the engine")
    if data.get("version") != VERSION:
        raise EngineError(f"program format version {str(data.get('version'))[:20]!r} is not {VERSION}; rebuild the engine")
    check_program(data, resolve_target, param_names, device, activations)
    nodes_data = data.get("nodes")
    if not isinstance(nodes_data, list):
        raise EngineError("the program has no node list; rebuild the engine")
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for entry in nodes_data:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise EngineError(f"program node {entry!r:.60} is malformed; rebuild the engine")
        name, op = entry["name"], entry.get("op")
        if name in env:
            raise EngineError(f"program node {name} is defined twice; rebuild the engine")
        if op == "placeholder":
            node = graph.placeholder(name)
            if entry.get("param") is not None:
                node.meta[PARAM_META] = str(entry["param"])
        elif op == "call_function":
            target = resolve_target(entry.get("target"), name)
            args, kwargs = entry.get("args", []), entry.get("kwargs", {})
            if not isinstance(args, list) or not isinstance(kwargs, dict) or not all(
                isinstance(k, str) and k.isidentifier() for k in kwargs
            ):
                raise EngineError(f"program node {name} has malformed arguments; rebuild the engine")
            args = _decode(args, env, name)
            kwargs = {k: _decode(v, env, name) for k, v in kwargs.items()}
            node = graph.call_function(target, tuple(args), kwargs)
        elif op == "output":
            args = _decode(entry.get("args", []), env, name)
            node = graph.output(args[0] if isinstance(args, list) and len(args) == 1 else args)
        else:
            raise EngineError(f"program node {name} has op {op!r}, which an engine may not hold")
        node.name = name
        env[name] = node
    try:
        graph.lint()
        # FX writes the graph as Python code and compiles it: whatever the checks above let
        # through that FX cannot write is still one line
        return torch.fx.GraphModule(torch.nn.Module(), graph)
    except Exception as e:
        raise EngineError(f"the program graph is not valid ({first_line(e)}); rebuild the engine") from None


def resolve_target(name: Any, node_name: str = "?"):
    """An ``aten::``/``cllm::`` overload or an allowed ``operator`` function, by name."""
    if not isinstance(name, str):
        raise EngineError(f"program node {node_name} has no call target; rebuild the engine")
    if name in PYTHON_TARGETS:
        return PYTHON_TARGETS[name]
    ns, sep, rest = name.partition("::")
    op_name, dot, overload = rest.partition(".")
    if ns == "aten" and name not in ATEN_OPS:
        raise EngineError(f"program node {node_name} calls {name!r}, which an engine may not call")
    if not sep or not dot or ns not in OP_NAMESPACES or not op_name.isidentifier() or not overload.isidentifier():
        raise EngineError(f"program node {node_name} calls {name!r}, which an engine may not call")
    try:
        target = getattr(getattr(getattr(torch.ops, ns), op_name), overload)
    except (AttributeError, RuntimeError):
        raise EngineError(
            f"program node {node_name} calls {name}, which is not registered here (a kernel this install lacks?)"
        ) from None
    if not isinstance(target, torch._ops.OpOverload):
        raise EngineError(f"program node {node_name} calls {name}, which is not an operator")
    return target


def _decode(value: Any, env: dict[str, torch.fx.Node], node_name: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_decode(v, env, node_name) for v in value]
    if isinstance(value, dict) and len(value) == 1:
        ((key, inner),) = value.items()
        if key == "node":
            if inner not in env:
                raise EngineError(f"program node {node_name} reads {inner!r} before it is defined; rebuild the engine")
            return env[inner]
        if key == "tuple" and isinstance(inner, list):
            return tuple(_decode(v, env, node_name) for v in inner)
        if key == "float" and inner in ("inf", "-inf", "nan"):
            return float(inner)
        if key == "device" and inner in ("cpu", "cuda"):  # never "meta": a tensor without data
            return torch.device(inner)
        if key in _ENUMS and isinstance(inner, str):
            kind = _ENUMS[key][0]
            candidate = getattr(torch, inner, None) if inner.isidentifier() else None
            if isinstance(candidate, kind):
                return candidate
    raise EngineError(f"program node {node_name} has an argument {value!r:.60} an engine may not hold")
