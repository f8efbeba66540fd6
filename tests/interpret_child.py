"""Runs a file of Triton kernel cases in a child pytest with TRITON_INTERPRET=1.

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


def assert_cases_pass(cases: Path, min_passed: int) -> None:
    """Every case in ``cases`` passes under the interpreter, and at least ``min_passed`` ran
    (a collection error or an import-time skip must not pass for success)."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", str(cases)],
        cwd=cases.parent.parent, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= min_passed, proc.stdout[-2000:]
