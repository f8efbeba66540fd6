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


# ---------------------------------------------------------------------------------------------
# sm_90 code generation (no GPU needed): what the interpreter cannot see
# ---------------------------------------------------------------------------------------------

_ARG_TYPES = {"sm_ranges": "*i32", "instructions": "*i32", "wait_counters": "*i32", "wait_values": "*i32",
              "bump_counters": "*i32", "counters": "*i32", "op_addr": "*i64", "op_int": "*i32", "op_flt": "*fp32",
              "token_ids": "*i64", "positions": "*i64", "slot_mapping": "*i64", "seq_lens": "*i32",
              "block_tables": "*i32", "prefetch": "*i64"}


def launch_consts(rows: int, prefetch: bool = False, dt: str = "bf16", aligned: bool = True) -> dict:
    """What a launch passes as compile-time sizes for Qwen2.5-0.5B's shapes (head_dim 64, rows
    of 896 and 4,864, 132 lm_head tiles), as triton_kernel.block_sizes makes them."""
    from types import SimpleNamespace

    from compiled_llm.megakernel import triton_kernel

    enc = SimpleNamespace(max_head_dim=64, max_k=4864, max_tiles=132, aligned=aligned)
    return triton_kernel.block_sizes(rows, enc, num_warps=8, prefetch=prefetch, itemsize=2 if dt == "bf16" else 4)


@pytest.mark.parametrize("dt, rows", [("bf16", 1), ("fp32", 8)])
def test_the_kernel_compiles_for_sm90_with_acquire_waits_release_bumps_and_vector_weight_loads(dt, rows):
    """The waits are acquire loads and the bumps release adds (each by one thread of the CTA,
    between CTA barriers), and with aligned weights every weight load is a 16-byte vector."""
    import re

    from helpers.interpret_child import require_compiled_kernels
    from helpers.ttgir import compile_for_sm90

    require_compiled_kernels()
    from compiled_llm.megakernel import triton_kernel

    types = {**_ARG_TYPES, "kv_ptr": f"*{dt}"}
    ptx = compile_for_sm90(triton_kernel.megakernel, launch_consts(rows, dt=dt), 8, lambda n: types.get(n, "i32"),
                           lambda n, t: t.startswith("*")).asm["ptx"]
    assert re.search(r"ld\.global\.gpu\.acquire\.b32|atom\.global\.gpu\.acquire", ptx)
    assert re.search(r"red\.global\.gpu\.release\.add|atom\.global\.gpu\.release\.add", ptx)
    weight_loads = re.findall(r"ld\.global\.L1::evict_first\S*", ptx)
    assert weight_loads and all(".v4." in w for w in weight_loads), set(weight_loads)


def test_the_timed_form_reads_the_global_clock_and_the_untimed_form_does_not():
    """``TIMED`` (benchmarks/megakernel_timeline.py) stamps each instruction with %globaltimer;
    the form every step runs has no clock reads."""
    from helpers.interpret_child import require_compiled_kernels
    from helpers.ttgir import compile_for_sm90

    require_compiled_kernels()
    from compiled_llm.megakernel import triton_kernel

    for timed in (False, True):
        types = {**_ARG_TYPES, "kv_ptr": "*bf16", "stamps": "*i64" if timed else "*i32"}
        ptx = compile_for_sm90(triton_kernel.megakernel, {**launch_consts(1), "TIMED": timed}, 8,
                               lambda n: types.get(n, "i32"),
                               lambda n, t: t.startswith("*")).asm["ptx"]
        assert ("%globaltimer" in ptx) == timed


def test_the_prefetching_form_asks_l2_for_the_next_weights_by_bulk_copy_and_the_other_form_does_not():
    """With ``PREFETCH`` each SM asks the copy engine (``cp.async.bulk.prefetch.L2``) for its
    next instruction's weight rows before it waits; the interpreter's form has no PTX."""
    from helpers.interpret_child import require_compiled_kernels
    from helpers.ttgir import compile_for_sm90

    require_compiled_kernels()
    from compiled_llm.megakernel import triton_kernel

    types = {**_ARG_TYPES, "kv_ptr": "*bf16"}
    for prefetch in (False, True):
        ptx = compile_for_sm90(triton_kernel.megakernel, launch_consts(1, prefetch), 8,
                               lambda n: types.get(n, "i32"), lambda n, t: t.startswith("*")).asm["ptx"]
        assert ("cp.async.bulk.prefetch.L2.global" in ptx) == prefetch


@pytest.mark.parametrize("dt, rows, aligned", [("bf16", 1, True), ("bf16", 8, True), ("fp32", 1, True),
                                               ("bf16", 2, False)])
def test_no_weight_tile_changes_layout_inside_a_streaming_loop(dt, rows, aligned):
    """A layout conversion inside a K loop is a round trip through shared memory every step.
    The weight tiles (8K elements a step) must be used in the layout they are loaded in; what
    may still be converted is an x chunk (a K block of one row) or the embed's few indices."""
    import re

    from helpers.interpret_child import require_compiled_kernels
    from helpers.ttgir import compile_for_sm90, innermost_loop_bodies

    require_compiled_kernels()
    from compiled_llm.megakernel import triton_kernel

    consts = launch_consts(rows, dt=dt, aligned=aligned)
    types = {**_ARG_TYPES, "kv_ptr": f"*{dt}"}
    ttgir = compile_for_sm90(triton_kernel.megakernel, consts, 8, lambda n: types.get(n, "i32"),
                             lambda n, t: t.startswith("*")).asm["ttgir"]
    largest_x_chunk = max(consts["BLOCK_K"], consts["BLOCK_KL"], consts["BLOCK_KH"])
    converted, bodies = [], innermost_loop_bodies(ttgir)
    assert bodies
    for body in bodies:
        for line in body:
            if "ttg.convert_layout" in line:
                dims = re.search(r"tensor<((?:\d+x)+)", line).group(1).rstrip("x").split("x")
                converted.append(eval("*".join(dims)))  # noqa: S307 (digits and x only)
    assert max(converted, default=0) <= largest_x_chunk, sorted(converted)
