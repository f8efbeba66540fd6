"""The Triton kernels match their references on the CPU (Triton interpreter, fp32).

The cases live in kernels_interpret_cases.py and run in a child pytest with TRITON_INTERPRET=1:
Triton decides at decoration time whether a kernel is interpreted, so the variable has to be set
before compiled_llm.kernels is imported, and setting it in this process would turn every later
test file's (and the GPU tests') kernels into interpreted ones.
"""

from pathlib import Path

import pytest
from interpret_child import assert_cases_pass

pytest.importorskip("triton")

CASES = Path(__file__).with_name("kernels_interpret_cases.py")


def test_triton_kernels_under_interpreter():
    assert_cases_pass(CASES, 30)
