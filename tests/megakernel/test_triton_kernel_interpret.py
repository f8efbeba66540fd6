"""The persistent megakernel computes what the schedule's interpreter and the per-op program
compute (logits, the KV cache, greedy tokens), and its counters end where the schedule says:
the cases in helpers/megakernel_interpret_cases.py, run in a child pytest with
TRITON_INTERPRET=1 (helpers/interpret_child.py says why a child)."""

from pathlib import Path

import pytest
from helpers.interpret_child import CASE_GROUPS, assert_cases_pass, import_triton

import_triton()

CASES = Path(__file__).parents[1] / "helpers" / "megakernel_interpret_cases.py"


@pytest.mark.parametrize("group", CASE_GROUPS)
def test_megakernel_under_interpreter(group, request):
    assert_cases_pass(CASES, group, request)
