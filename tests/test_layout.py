"""The package reads as its pipeline: every import (module-level or inside a function, and every
``python -m compiled_llm...`` a module starts) points down the stack of layers below, never up
and never in a circle.

The model is written in the op vocabulary (``graph/ops.py`` and the fused, quantized and
collective ops), which imports nothing of ours; the rest of ``graph/`` captures and serializes
the model. The kernel registry sits below the passes that choose from it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import compiled_llm

PACKAGE = Path(compiled_llm.__file__).parent

# Lowest first: a module may import its own layer and the layers before it.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "cache_dir"),
    ("graph.ops", "graph.fused_ops", "graph.quantized_ops", "graph.collective_ops"),
    ("model",),
    ("graph",),
    ("kernels",),
    ("passes",),
    # the megakernel backend: the post-pass program's decode step as a schedule of instructions
    ("megakernel",),
    ("engine",),
    # the runtime's rooms, in the order a step flows through them
    ("serve.sampling_params",),
    ("serve.core",),
    ("serve.outputs", "serve.engine_config", "serve.server_config"),
    ("serve.worker",),
    ("serve.executor",),
    ("serve.llm_engine", "serve.reference", "serve.profiling"),
    # what drives an engine: the loop of LLM, the engine process of serve, a build's kernel warm-up
    ("serve.engine_loop", "serve.engine_process", "serve.kernel_warmup"),
    ("serve.metrics",),
    ("serve.openai",),
    ("serve.llm",),
    # Ray Serve's application: engine replicas under the OpenAI server's app (an optional extra)
    ("serve.ray_serve",),
    ("serve",),
    ("cli",),
    ("",),  # compiled_llm/__init__.py: the public API's names, loaded lazily
]

# "compiled_llm.x.y" as a string: what `python -m` starts, and the lazy exports' targets
_MODULE_STRING = re.compile(r"^compiled_llm(\.\w+)+$")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def known_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every compiled_llm module ``path`` imports, at any depth of its code, or names as a
    module string; ``from pkg import name`` counts as importing ``pkg.name`` when that is a
    module."""
    found: set[str] = set()
    this = module_name(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_STRING.match(node.value):
            names = [node.value]
        for name in names:
            # the module itself, or the package a dotted attribute lives in
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name.startswith("compiled_llm") and name != this:
                found.add(name)
    return found


def layer_of(module: str) -> int:
    rel = module.removeprefix("compiled_llm").removeprefix(".")
    best, best_len = None, -1
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (rel == prefix or rel.startswith(prefix + ".") or prefix == "") and len(prefix) > best_len:
                best, best_len = level, len(prefix)
    assert best is not None, module
    return best


def import_graph() -> dict[str, set[str]]:
    modules = known_modules()
    return {name: imported_modules(path, modules) for name, path in modules.items()}


def test_no_import_points_up_a_layer():
    upward = sorted(
        f"{a} -> {b}"
        for a, targets in import_graph().items()
        for b in targets
        if layer_of(b) > layer_of(a)
    )
    assert upward == []


def test_no_import_cycle():
    graph = import_graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert cycles == []


def test_every_module_has_a_layer_and_the_walk_sees_function_level_imports():
    modules = known_modules()
    assert all(layer_of(m) is not None for m in modules)
    # the facade names llm as a string (a lazy export, as `python -m` names what it starts), and
    # run imports it inside a function only: the walk must see both kinds of arrow, or the two
    # tests above prove nothing
    graph = import_graph()
    assert "compiled_llm.serve.llm" in graph["compiled_llm"]
    assert "compiled_llm.serve.llm" in graph["compiled_llm.cli.run"]
    assert "compiled_llm.cli.main" in graph["compiled_llm.cli.bench.coldstart"]  # python -m compiled_llm.cli.main


def test_the_runtime_top_level_holds_at_most_twelve_modules():
    top = [p.name for p in (PACKAGE / "serve").glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= 12, sorted(top)


# Ray is an optional extra (compiled_llm[ray]): these modules alone import it, and the rest of
# the package imports them only inside a function, so nothing loads Ray until it is asked for
RAY_MODULES = ("compiled_llm.serve.executor.ray_executor", "compiled_llm.serve.engine_process.ray_replicas",
               "compiled_llm.serve.ray_serve")


def _is_ray_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in RAY_MODULES)


def _imports(tree: ast.AST, top_level_only: bool) -> set[str]:
    """The dotted names ``tree`` imports (absolute imports), those run at import time only when
    ``top_level_only`` (a function's body runs later; a class's runs at import)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if top_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.add(child.module)
                found.update(f"{child.module}.{a.name}" for a in child.names)
            visit(child)

    visit(tree)
    return found


def test_only_the_ray_modules_import_ray_and_nothing_else_loads_them_at_import():
    importers, eager = [], []
    for name, path in known_modules().items():
        tree = ast.parse(path.read_text(), str(path))
        if any(n == "ray" or n.startswith("ray.") for n in _imports(tree, top_level_only=False)):
            importers.append(name)
        if not _is_ray_module(name) and any(_is_ray_module(n) for n in _imports(tree, top_level_only=True)):
            eager.append(name)
    assert importers and all(_is_ray_module(m) for m in importers), importers
    assert eager == []
    # the executor's module and the package's __init__ import without Ray (LLMEngine names the
    # executor's module inside a function; Ray itself is imported when an executor starts)
    for name in RAY_MODULES:
        tree = ast.parse(known_modules()[name].read_text())
        assert not any(n == "ray" or n.startswith("ray.") for n in _imports(tree, top_level_only=True)), name
