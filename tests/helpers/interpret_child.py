"""Runs a file of Triton kernel cases in a child pytest with TRITON_INTERPRET=1, and what the test
files around those runs (and the sm_90 compile tests) share.

Triton decides at decoration time whether a kernel is interpreted, so the variable has to be set
before compiled_llm.kernels is imported, and setting it in the test process would turn every later
test file's (and the GPU tests') kernels into interpreted ones.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository root, where the child pytest runs

# The two halves of a cases file: `-m "not slow"` runs the first, CI runs both. Together they
# are every case, since a case is either marked slow or not.
CASE_GROUPS = [pytest.param("not slow", id="fast"), pytest.param("slow", id="slow", marks=pytest.mark.slow)]

# Summary words that say nothing about a case's outcome.
_NOT_OUTCOMES = {"deselected", "warning", "warnings"}


def import_triton():
    """Triton, which is a dependency wherever it ships wheels (Linux): missing there, the install
    is broken and the tests fail; elsewhere the Triton tests skip."""
    if sys.platform == "linux":
        import triton

        return triton
    return pytest.importorskip("triton", reason="Triton ships no wheels for this platform")


def require_compiled_kernels() -> None:
    """The sm_90 compile tests need jitted, not interpreted, kernels in this process. The suite
    never sets TRITON_INTERPRET here (only in the interpreter runs' children), so this fails only
    when it comes from the caller's shell, where a skip would pass a suite that checked nothing."""
    assert os.environ.get("TRITON_INTERPRET") != "1", (
        "TRITON_INTERPRET=1 is set in the test process: unset it (the interpreter tests set it in a child)")


# child runs already made, by (cases file, -m expression): the two groups' tests share one
_RUNS: dict[tuple[Path, str], subprocess.CompletedProcess] = {}


def assert_cases_pass(cases: Path, group: str, request: pytest.FixtureRequest | None = None) -> None:
    """Every case of ``cases`` in ``group`` (a -m expression, one of CASE_GROUPS) ran under the
    interpreter and passed: no failure, error, skip or xfail, and every collected case either
    passed or belongs to the other group.

    With the calling test's ``request``: when this session also runs the test's other group
    (CI, a plain ``pytest``), one child runs every case for both, and each group's test checks
    that run: the cases run once, and the child's start (Python, torch, Triton, collection) is
    paid once, not twice."""
    expression = group
    if request is not None and _groups_selected(request) >= {p.values[0] for p in CASE_GROUPS}:
        expression = " or ".join(f"({p.values[0]})" for p in CASE_GROUPS)  # every case
    if (cases, expression) not in _RUNS:
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        env.pop("PYTEST_ADDOPTS", None)  # the caller's -k/-x/-m must not thin out the child's run
        _RUNS[cases, expression] = subprocess.run(
            [sys.executable, "-m", "pytest", "--no-header", "-rfEsxX", "-p", "no:cacheprovider", "-m", expression,
             str(cases)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
        )
    proc = _RUNS[cases, expression]
    report = proc.stdout[-8000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    collected = re.search(r"^collected (\d+) items?", proc.stdout, re.M)
    outcomes = _summary_counts(proc.stdout)
    assert collected, report
    assert set(outcomes) - _NOT_OUTCOMES == {"passed"}, report
    assert outcomes["passed"] + outcomes.get("deselected", 0) == int(collected.group(1)), report


def _groups_selected(request: pytest.FixtureRequest) -> set[str]:
    """The groups (``group`` parameters) of the calling test function that this session runs."""
    node = request.node
    return {item.callspec.params["group"] for item in request.session.items
            if item.path == node.path and getattr(item, "originalname", None) == node.originalname
            and "group" in getattr(getattr(item, "callspec", None), "params", {})}


def _summary_counts(stdout: str) -> dict[str, int]:
    """pytest's closing line ("== 12 passed, 3 deselected, 1 warning in 4.20s ==") as counts."""
    summary = stdout.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) ([a-z]+)", summary)}
