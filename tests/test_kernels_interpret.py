"""The Triton kernels match their references on the CPU (Triton interpreter, fp32).

The cases live in kernels_interpret_cases.py and run in a child pytest with TRITON_INTERPRET=1:
Triton decides at decoration time whether a kernel is interpreted, so the variable has to be set
before compiled_llm.kernels is imported, and setting it in this process would turn every later
test file's (and the GPU tests') kernels into interpreted ones.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CASES = Path(__file__).with_name("kernels_interpret_cases.py")


def test_triton_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", str(CASES)],
        cwd=CASES.parent.parent, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 30, proc.stdout[-2000:]
