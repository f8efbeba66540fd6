"""What a ``program.json`` must be before a graph is built from it (serialize.py reads it).

The document is checked as data, iteratively and within fixed bounds, against the program's
schema: the node kinds and the keys each has, names that are Python identifiers (FX writes them
into code), placeholders first (the weights in the manifest's order, then the seven batch inputs
``FlatProgram`` passes), calls whose arguments match the operator's own schema (how many, which
keywords, what type each one is), values nested no deeper than a program nests them, and one
output that is a tensor node. So a tampered program is one EngineError naming the node, never a
RecursionError, a SyntaxError from FX's code generation or a wrong-arity call that fails at the
first step.
"""

from __future__ import annotations

import dataclasses
import functools
import keyword
import operator
from typing import Any, Callable

import torch

from compiled_llm.errors import EngineError

# What FlatProgram.forward passes after the weights, in order.
BATCH_INPUTS = ("token_ids", "positions", "query_start_loc", "seq_lens", "block_tables", "slot_mapping", "kv_cache")
NODE_KEYS = {
    "placeholder": {"name", "op", "param"},
    "call_function": {"name", "op", "target", "args", "kwargs"},
    "output": {"name", "op", "args"},
}
MAX_NODES = 1 << 20
MAX_NAME_CHARS = 256
# A program's deepest value is an output: [{"tuple": [{"node": x}]}] (4 levels below "args").
MAX_VALUE_DEPTH = 6
MAX_LIST_ITEMS = 4096
INT64 = (-(1 << 63), (1 << 63) - 1)
# The arity of the operator functions a program may call (serialize.PYTHON_TARGETS).
PYTHON_ARITY = {operator.neg: 1}
_ENUM_KEYS = ("dtype", "layout", "memory_format")
_SHAPE_OPS = ("aten::view.default", "aten::reshape.default")


def program_problem(message: str) -> EngineError:
    return EngineError(f"program.json: {message}; rebuild the engine")


def check_program(data: Any, resolve: Callable[[Any, str], Any], param_names: list[str] | None = None,
                  device: str | None = None, activations: int = 0) -> None:
    """Check the program document ``data`` (see the module docstring); ``resolve`` maps a target
    name to its operator (serialize.resolve_target), ``param_names`` are the manifest's weights
    and ``device`` the engine's device type (a program calls no other). ``activations``: the
    inputs a pipeline stage takes after the batch's (passes/pipeline_split.py)."""
    nodes = _node_list(data)
    defined: set[str] = set()
    tensors: set[str] = set()  # nodes that hold a tensor (not a size or a tuple of tensors)
    placeholders: list[dict] = []
    for index, entry in enumerate(nodes):
        name, op = _check_entry(entry, index, defined)
        if op == "placeholder":
            if len(placeholders) != len(defined):
                raise program_problem(f"placeholder {name} comes after a call; the inputs come first")
            placeholders.append(entry)
        elif op == "call_function":
            target = resolve(entry["target"], name)
            _check_call(name, entry["target"], target, entry["args"], entry["kwargs"], defined, device)
            if _returns_tensor(target):
                tensors.add(name)
        else:
            if index != len(nodes) - 1:
                raise program_problem(f"output node {name} is not the last node")
            _check_output(name, entry["args"], tensors)
        defined.add(name)
    if nodes[-1].get("op") != "output":
        raise program_problem("the program has no output node")
    _check_inputs(placeholders, param_names, activations)


def _node_list(data: Any) -> list:
    if not isinstance(data, dict):
        raise program_problem("it is not a JSON object")
    nodes = data.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise program_problem("the node list is missing or empty")
    if len(nodes) > MAX_NODES:
        raise program_problem(f"{len(nodes)} nodes, more than {MAX_NODES}")
    return nodes


def _check_entry(entry: Any, index: int, defined: set[str]) -> tuple[str, str]:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise program_problem(f"node #{index} is not an object with a name")
    name, op = entry["name"], entry.get("op")
    if len(name) > MAX_NAME_CHARS or not name.isidentifier() or keyword.iskeyword(name):
        raise program_problem(f"node #{index} has the name {name[:40]!r}, which is not a Python identifier")
    if name in defined:
        raise program_problem(f"node {name} is defined twice")
    if op not in NODE_KEYS:
        raise program_problem(f"node {name} has op {str(op)[:40]!r}, which an engine may not hold")
    if set(entry) != NODE_KEYS[op]:
        extra = sorted(set(entry) ^ NODE_KEYS[op])
        raise program_problem(f"{op} node {name} has or lacks the keys {', '.join(map(str, extra))[:80]}")
    for key in ("args", "kwargs"):
        if key in entry and not _shallow(entry[key]):
            raise program_problem(f"node {name} has {key} nested deeper than {MAX_VALUE_DEPTH} levels or too long")
    if op == "placeholder" and entry["param"] is not None and not isinstance(entry["param"], str):
        raise program_problem(f"placeholder {name} has a param that is not a weight name")
    return name, op


def _shallow(value: Any) -> bool:
    """Whether ``value`` nests at most MAX_VALUE_DEPTH containers deep and no container holds
    more than MAX_LIST_ITEMS items (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth > MAX_VALUE_DEPTH or len(item) > MAX_LIST_ITEMS:
                return False
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return True


def _check_inputs(placeholders: list[dict], param_names: list[str] | None, activations: int = 0) -> None:
    weights = [p["param"] for p in placeholders if p["param"] is not None]
    others = [p["name"] for p in placeholders if p["param"] is None]
    if placeholders[: len(weights)] != [p for p in placeholders if p["param"] is not None]:
        raise program_problem("a batch input comes before a weight; the weights come first")
    if param_names is not None and weights != list(param_names):
        raise program_problem("its weight inputs are not the manifest's param_names, in order")
    if len(others) != len(BATCH_INPUTS) + activations:
        what = f" and {activations} activations" if activations else ""
        raise program_problem(f"it takes {len(others)} inputs after its weights; a program takes {len(BATCH_INPUTS)} "
                              f"({', '.join(BATCH_INPUTS)}){what}")


def _check_output(name: str, args: Any, tensors: set[str]) -> None:
    if not isinstance(args, list) or len(args) != 1:
        raise program_problem(f"output node {name} does not return one value")
    value = args[0]
    if isinstance(value, dict) and set(value) == {"tuple"}:
        value = value["tuple"]
    items = value if isinstance(value, list) else [value]
    if not items or not all(_is_node_ref(v, tensors) for v in items):
        raise program_problem(f"output node {name} returns {_shown(args[0])}, not the logits tensor")


def _check_call(name: str, target_name: str, target: Any, args: Any, kwargs: Any, defined: set[str],
                device: str | None) -> None:
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise program_problem(f"node {name} has malformed arguments")
    if not isinstance(target, torch._ops.OpOverload):  # operator.getitem, operator.add, ...
        arity = PYTHON_ARITY.get(target, 2)
        if len(args) != arity or kwargs:
            raise program_problem(f"node {name} calls {target_name} with {len(args)} arguments and "
                                  f"{len(kwargs)} keywords; it takes {arity} arguments")
        kinds = ("node", "int") if target is operator.getitem else ("number",) * arity
        for kind, value in zip(kinds, args):
            ok = _is_node_ref(value, defined) if kind == "node" else _fits(kind, value, defined, device)
            if not ok:
                raise program_problem(f"node {name} passes {_shown(value)} to {target_name}")
        return
    schema = _signature(target)
    positional = [a for a in schema if not a.kwarg_only]
    if len(args) > len(positional):
        raise program_problem(f"node {name} calls {target_name} with {len(args)} arguments; it takes at most "
                              f"{len(positional)}")
    by_name = {a.name: a for a in schema}
    given = {a.name for a in positional[: len(args)]}
    for key in kwargs:
        if key not in by_name or key in given:
            raise program_problem(f"node {name} calls {target_name} with the keyword {str(key)[:40]!r}, "
                                  "which it does not take")
    missing = [a.name for a in schema if a.name not in given and a.name not in kwargs and a.required]
    if missing:
        raise program_problem(f"node {name} calls {target_name} without its argument {missing[0]!r}")
    for arg, value in [*zip(positional, args), *((by_name[k], v) for k, v in kwargs.items())]:
        _check_value(name, arg.name, arg.kind, value, defined, device)
    if target_name in _SHAPE_OPS:
        _check_shape_list(name, args[1] if len(args) > 1 else kwargs.get("size", kwargs.get("shape")))


def _check_value(name: str, arg: str, kind: str, value: Any, defined: set[str], device: str | None) -> None:
    """``value`` fits the schema type ``kind`` (str(Argument.type), "Node" for a tensor that
    must be a node) of the argument ``arg``."""
    optional = kind.startswith("Optional[")
    if optional:
        kind = kind[len("Optional["):-1]
    if value is None and optional:
        return
    if arg in _ENUM_KEYS:  # ScalarType, Layout and MemoryFormat show as int in schemas
        ok = isinstance(value, dict) and set(value) == {arg} and isinstance(value[arg], str)
    elif kind.startswith("List["):
        inner = kind[len("List["):-1]
        inner_optional = inner.startswith("Optional[")
        inner = inner[len("Optional["):-1] if inner_optional else inner
        inner = "Node" if inner == "Tensor" else inner
        ok = isinstance(value, list) and all(
            (v is None and inner_optional) or _fits(inner, v, defined, device) for v in value)
    else:
        ok = _fits(kind, value, defined, device)
    if not ok:
        raise program_problem(f"node {name} passes {_shown(value)} as its argument {arg!r}, which must be a {kind}")


def _fits(kind: str, value: Any, defined: set[str], device: str | None) -> bool:
    node = _is_node_ref(value, defined)
    if kind == "Node":
        return node
    if kind in ("int", "SymInt"):
        return node or _is_int(value)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str) and len(value) <= MAX_NAME_CHARS
    if kind == "Device":
        return (isinstance(value, dict) and set(value) == {"device"} and value["device"] in ("cpu", "cuda")
                and (device is None or value["device"] == device))
    # Tensor (a scalar aten wraps), float, number, Scalar, and types no engine op takes today
    return node or _is_number(value)


@dataclasses.dataclass(frozen=True)
class _Argument:
    name: str
    kind: str  # str(Argument.type), "Node" where only a node may stand for the tensor
    kwarg_only: bool
    required: bool


@functools.lru_cache(maxsize=None)
def _signature(target: torch._ops.OpOverload) -> tuple[_Argument, ...]:
    """The operator's arguments as the checks read them (schemas are slow to walk per node)."""
    scalar_ok = target.name().endswith(".Tensor")  # add.Tensor(x, 1): aten wraps a number as a tensor
    out = []
    for a in target._schema.arguments:
        kind = str(a.type)
        if kind in ("Tensor", "Optional[Tensor]") and not (scalar_ok and a.name == "other"):
            kind = kind.replace("Tensor", "Node")
        out.append(_Argument(a.name, kind, a.kwarg_only, not a.has_default_value()))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _returns_tensor(target: Any) -> bool:
    """Whether a call of ``target`` gives one tensor (getitem of a tuple of tensors is assumed to)."""
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return len(returns) == 1 and str(returns[0].type) == "Tensor"


def _check_shape_list(name: str, shape: Any) -> None:
    if not isinstance(shape, list):
        return  # reported by the type check
    literal = [v for v in shape if _is_int(v)]
    if any(v < -1 for v in literal) or literal.count(-1) > 1 or 0 in literal:
        raise program_problem(f"node {name} views a tensor as the shape {_shown(shape)}, which no tensor has")


def _is_node_ref(value: Any, defined: set[str]) -> bool:
    return isinstance(value, dict) and set(value) == {"node"} and isinstance(value["node"], str) \
        and value["node"] in defined


def _is_int(value: Any) -> bool:
    return type(value) is int and INT64[0] <= value <= INT64[1]


def _is_number(value: Any) -> bool:
    if isinstance(value, dict):
        return set(value) == {"float"} and value["float"] in ("inf", "-inf", "nan")
    return _is_int(value) or isinstance(value, (bool, float))


def _shown(value: Any) -> str:
    if isinstance(value, (list, dict)):
        return f"a {'list' if isinstance(value, list) else 'object'} of {len(value)}" if not _small(value) \
            else repr(value)[:60]
    return repr(value)[:60]


def _small(value: Any) -> bool:
    return _shallow(value) and len(repr(value)) < 200
