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
import threading
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


def assert_cases_pass(cases: Path, group: str, request: pytest.FixtureRequest | None = None) -> None:
    """Every case of ``cases`` in ``group`` (a -m expression, one of CASE_GROUPS) ran under the
    interpreter and passed: no failure, error, skip or xfail, and every collected case either
    passed or belongs to the other group.

    With the calling test's ``request``: when this session also runs the test's other group
    (CI, a plain ``pytest``), one child runs every case for both, and each group's test checks
    that run: the cases run once, and the child's start (Python, torch, Triton, collection) is
    paid once, not twice. That run was started when the session was collected
    (``start_child_runs``) and has run beside the other tests since; this waits for it."""
    proc = _CHILD_RUNS.result(cases, _expression(cases, group, request))
    report = proc.stdout[-8000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    collected = re.search(r"^collected (\d+) items?", proc.stdout, re.M)
    outcomes = _summary_counts(proc.stdout)
    assert collected, report
    assert set(outcomes) - _NOT_OUTCOMES == {"passed"}, report
    assert outcomes["passed"] + outcomes.get("deselected", 0) == int(collected.group(1)), report


def _expression(cases: Path, group: str, request: pytest.FixtureRequest | None) -> str:
    if request is not None and _groups_selected(request) >= {p.values[0] for p in CASE_GROUPS}:
        return " or ".join(f"({p.values[0]})" for p in CASE_GROUPS)  # every case
    return group


class _ChildRuns:
    """The interpreter runs, one child at a time on a thread of this process, in the order they
    were asked for. Each child is one Python process on one core (OMP_NUM_THREADS=1), and most of
    the suite's other tests leave the second core of a two-core machine idle (one Python
    thread), so the runs the session will check start as soon as it is collected and are done
    (minutes of interpreted kernels) by the time their tests come up. A run nobody started is
    started when a test asks for it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._done: dict[tuple[Path, str], subprocess.CompletedProcess] = {}
        self._queued: list[tuple[Path, str]] = []
        self._ready = threading.Condition(self._lock)
        self._current: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False

    def start(self, keys: list[tuple[Path, str]]) -> None:
        with self._lock:
            for key in keys:
                if key not in self._done and key not in self._queued:
                    self._queued.append(key)
            if self._queued and self._thread is None:
                self._thread = threading.Thread(target=self._run_queue, name="interpreter-children", daemon=True)
                self._thread.start()

    def result(self, cases: Path, expression: str) -> subprocess.CompletedProcess:
        key = (cases, expression)
        self.start([key])
        with self._ready:
            while key not in self._done:
                self._ready.wait()
            return self._done[key]

    def stop(self) -> None:
        """The session is over: a child still running is killed (an interrupted session must not
        wait minutes for it), none is started after."""
        with self._lock:
            self._stopped = True
            self._queued.clear()
            if self._current is not None:
                self._current.kill()

    def _run_queue(self) -> None:
        while True:
            with self._lock:
                if not self._queued or self._stopped:
                    self._thread = None
                    return
                key = self._queued.pop(0)
            try:
                done = self._run_child(*key)
            except Exception as e:  # noqa: BLE001 - the waiting test reports it, the session goes on
                done = subprocess.CompletedProcess(key, 1, "", f"the interpreter run could not run: {e!r}")
            with self._ready:
                self._done[key] = done
                self._current = None
                self._ready.notify_all()

    def _run_child(self, cases: Path, expression: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        env.pop("PYTEST_ADDOPTS", None)  # the caller's -k/-x/-m must not thin out the child's run
        with self._lock:
            if self._stopped:
                return subprocess.CompletedProcess(cases, 1, "", "the session ended before this run")
            # PR_SET_PDEATHSIG: the child ends with this process, even one killed outright
            self._current = subprocess.Popen(
                [sys.executable, "-c", _CHILD_MAIN, "--no-header", "-rfEsxX", "-p", "no:cacheprovider", "-m",
                 expression, str(cases)],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
        proc = self._current
        try:
            out, err = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += "\nthe interpreter run took more than 900 s and was killed"
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# The child: pytest, after asking Linux to kill it when its parent (this test session) dies.
_CHILD_MAIN = """
import ctypes, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
except (OSError, AttributeError):
    pass
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


_CHILD_RUNS = _ChildRuns()


def _checks_a_child_run(item: pytest.Item) -> bool:
    """A test of an interpreter run: its module names a cases file ``CASES``, it takes ``group``."""
    cases = getattr(getattr(item, "module", None), "CASES", None)
    params = getattr(getattr(item, "callspec", None), "params", {})
    return isinstance(cases, Path) and "group" in params and item.get_closest_marker("gpu") is None


def checks_last(items: list[pytest.Item]) -> None:
    """Move the tests of interpreter runs to the end of the session, in place: their runs then
    have the whole session beside the other tests to finish, and nobody waits for them."""
    items.sort(key=_checks_a_child_run)  # stable: every other test keeps its order


def start_child_runs(items: list[pytest.Item]) -> None:
    """Start the interpreter runs that the collected ``items`` will check (each test module of
    interpreter cases names its cases file ``CASES`` and takes a ``group`` parameter)."""
    keys = []
    for item in items:
        if _checks_a_child_run(item):
            cases = item.module.CASES
            key = (cases, _expression(cases, item.callspec.params["group"], _ItemRequest(item)))
            if key not in keys:
                keys.append(key)
    _CHILD_RUNS.start(keys)


def stop_child_runs() -> None:
    _CHILD_RUNS.stop()


class _ItemRequest:
    """What ``_groups_selected`` reads of a test's request, for a collected item."""

    def __init__(self, item: pytest.Item):
        self.node, self.session = item, item.session


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
