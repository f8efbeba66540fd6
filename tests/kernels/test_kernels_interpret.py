"""The Triton kernels match their references on the CPU (Triton interpreter, fp32).

The cases live in helpers/kernels_interpret_cases.py and run in a child pytest with TRITON_INTERPRET=1:
Triton decides at decoration time whether a kernel is interpreted, so the variable has to be set
before compiled_llm.kernels is imported, and setting it in this process would turn every later
test file's (and the GPU tests') kernels into interpreted ones.
"""

from pathlib import Path

import pytest
from helpers.interpret_child import CASE_GROUPS, assert_cases_pass, import_triton

import_triton()

CASES = Path(__file__).parents[1] / "helpers" / "kernels_interpret_cases.py"


@pytest.mark.parametrize("group", CASE_GROUPS)
def test_triton_kernels_under_interpreter(group, request):
    assert_cases_pass(CASES, group, request)
