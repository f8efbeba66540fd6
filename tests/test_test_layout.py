"""The tests mirror the source tree: a test module sits in the folder of the code it specifies
(tests/serve/core/ for compiled_llm/serve/core/, tests/benchmarks/ for benchmarks/), package-wide
ones at tests/ itself. What test modules share lives in tests/helpers/, a package they import as
``helpers.<module>``; no test module imports another, and the only other Python files are
conftests."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
HELPERS = TESTS / "helpers"


def python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def is_test_module(path: Path) -> bool:
    return path.name.startswith("test_")


def imported_names(path: Path) -> set[str]:
    """Every module name ``path`` imports, at any depth of its code (absolute imports only; a
    relative one is named by its dots and module, as ``.kernel_inputs``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def test_no_test_module_is_imported_by_another_file():
    offenders = {f"{p.relative_to(TESTS)} imports {name}"
                 for p in python_files() for name in imported_names(p)
                 if any(part.startswith("test_") for part in name.lstrip(".").split("."))}
    assert not offenders, sorted(offenders)


def test_helpers_are_imported_through_their_package():
    """``from helpers.lively import ...``, never ``from lively import ...``: helpers/ itself is
    not on sys.path, tests/ is (its conftest puts it there)."""
    helper_names = {p.stem for p in HELPERS.glob("*.py")} - {"__init__"}
    offenders = {f"{p.relative_to(TESTS)} imports {name}"
                 for p in python_files() for name in imported_names(p)
                 if name.split(".")[0] in helper_names or name.startswith(".")}
    assert not offenders, sorted(offenders)


def test_every_python_file_outside_helpers_is_a_test_module_or_a_conftest():
    stray = [str(p.relative_to(TESTS)) for p in python_files()
             if HELPERS not in p.parents and not is_test_module(p) and p.name != "conftest.py"]
    assert not stray, stray


def test_helpers_is_a_package_of_no_test_modules():
    assert (HELPERS / "__init__.py").is_file()
    assert not [p.name for p in HELPERS.rglob("test_*.py")]


def test_test_module_names_are_unique_across_folders():
    """pytest imports each test module by its basename (the folders are not packages)."""
    seen: dict[str, list[str]] = {}
    for p in python_files():
        if is_test_module(p):
            seen.setdefault(p.name, []).append(str(p.relative_to(TESTS)))
    assert not {name: where for name, where in seen.items() if len(where) > 1}


def test_every_test_folder_is_a_folder_of_the_package_or_of_benchmarks():
    folders = {p.parent for p in python_files() if is_test_module(p)} - {TESTS}
    unmirrored = [str(f.relative_to(TESTS)) for f in folders
                  if not (ROOT / "compiled_llm" / f.relative_to(TESTS)).is_dir()
                  and not (ROOT / f.relative_to(TESTS)).is_dir()]
    assert not unmirrored, unmirrored
