"""The mixture-of-experts kernels (triton_fused_moe): what they compute, and how they compile.

* What they compute: the cases in helpers/moe_interpret_cases.py run in a child pytest with
  TRITON_INTERPRET=1 (the variable must be set before the kernels are decorated and must not
  leak into this process; see test_kernels_interpret.py).
* How they compile: every kernel is compiled for Hopper (sm_90) at the default launch configs
  and Qwen3-30B-A3B's expert shapes (H 2048, I 768, 128 experts, top 8), without a GPU; the
  decode kernels' streaming loops (the routing's too) are checked for layout conversions (a weight tile's round trip
  through shared memory every step: see test_gemv_interpret.py).
"""

from pathlib import Path

import pytest
from helpers.interpret_child import CASE_GROUPS, assert_cases_pass, import_triton, require_compiled_kernels
from helpers.ttgir import compile_for_sm90, innermost_loop_conversions

triton = import_triton()

CASES = Path(__file__).parents[1] / "helpers" / "moe_interpret_cases.py"


@pytest.mark.parametrize("group", CASE_GROUPS)
def test_fused_moe_kernels_under_interpreter(group, request):
    assert_cases_pass(CASES, group, request)


# ---------------------------------------------------------------------------------------------
# sm_90 code generation
# ---------------------------------------------------------------------------------------------

QWEN3_MOE = dict(H=2048, I=768, E=128, top_k=8)
INDEX_PTRS = {"ids_ptr": "*i32", "sorted_ids_ptr": "*i32", "sorted_pairs_ptr": "*i32", "block_expert_ptr": "*i32",
              "num_padded_ptr": "*i32", "order_ptr": "*i64", "weights_ptr": "*fp32", "logits_ptr": "*fp32",
              "count_ptr": "*i32"}
FLOAT_ARGS = {"norm_eps"}


def _compile(kernel, dt, consts, num_warps, num_stages=1):
    """The kernel for sm_90 as the wrappers type its arguments: index and routing-weight pointers
    as they pass them, the others of the model's dtype; pointers, strides and hidden sizes
    16-divisible."""
    return compile_for_sm90(
        kernel, consts, num_warps,
        lambda name: INDEX_PTRS.get(name, f"*{dt}") if name.endswith("_ptr") else "fp32" if name in FLOAT_ARGS else "i32",
        lambda name, t: t.startswith("*") or name.startswith("stride") or name in ("H", "I"), num_stages)


def _kernels_at_default_configs(dt):
    """(label, kernel, num_warps, num_stages, constexprs, streams) of every kernel as the wrappers
    launch it at decode (T = 1) and prefill (T = 512) sizes; ``streams``: a decode kernel."""
    from compiled_llm.kernels import triton_fused_moe as moe
    from compiled_llm.kernels.triton_common import next_pow2, row_warps

    H, I, E, top_k = QWEN3_MOE["H"], QWEN3_MOE["I"], QWEN3_MOE["E"], QWEN3_MOE["top_k"]
    itemsize = 2 if dt == "bf16" else 4
    vec = 16 // itemsize
    yield "route", moe._route_kernel, row_warps(E), 1, dict(
        TOP_K=top_k, RENORMALIZE=True, BLOCK_E=next_pow2(E), BLOCK_K=top_k, PDL=True), False
    tile = moe._streaming_tile("fused_moe_route", 1, (E, H), E, H, itemsize, "BLOCK_R", "BLOCK_H")
    yield "route decode", moe._route_decode_kernel, tile["num_warps"], 1, dict(
        TOP_K=top_k, RENORMALIZE=True, HAS_NORM=True, BLOCK_R=tile["BLOCK_ROWS"], BLOCK_H=tile["BLOCK_K"], VEC=vec,
        BLOCK_E=next_pow2(E), BLOCK_K=top_k, PDL=True), True
    tile = moe._streaming_tile("fused_moe_decode", 1, (2 * I, H), I, H, itemsize, "BLOCK_I", "BLOCK_H")
    yield "gate/up decode", moe._gate_up_decode_kernel, tile["num_warps"], 1, dict(
        TOP_K=top_k, BLOCK_I=tile["BLOCK_ROWS"], BLOCK_H=tile["BLOCK_K"], VEC=vec, PDL=True), True
    tile = moe._streaming_tile("fused_moe_down", 1, (H, I), H, I, itemsize, "BLOCK_N", "BLOCK_K")
    yield "down decode", moe._down_decode_kernel, tile["num_warps"], 1, dict(
        TOP_K=top_k, BLOCK_N=tile["BLOCK_ROWS"], BLOCK_K=tile["BLOCK_K"], VEC=vec, HAS_RESIDUAL=True, PDL=True), True
    T = 512
    blk = moe.gemm_blocks(T, top_k, H, I)
    block_e = next_pow2(E)
    yield "align", moe._align_kernel, 4, 1, dict(
        BLOCK_M=blk["BLOCK_M"], BLOCK_E=block_e, BLOCK_D=max(moe.MIN_DOT, min(1024, moe.ALIGN_TILE // block_e))), False
    common = dict(IEEE=dt == "fp32", BLOCK_M=blk["BLOCK_M"], GROUP_M=blk["GROUP_M"])
    yield "gate/up GEMM", moe._gate_up_gemm_kernel, blk["num_warps"], blk["num_stages"], dict(
        TOP_K=top_k, BLOCK_N=blk["GATE_UP_N"], BLOCK_K=blk["GATE_UP_K"], **common), False
    yield "down GEMM", moe._down_gemm_kernel, blk["num_warps"], blk["num_stages"], dict(
        BLOCK_N=blk["DOWN_N"], BLOCK_K=blk["DOWN_K"], **common), False
    yield "slot sum", moe._sum_slots_kernel, 4, 1, dict(TOP_K=top_k, BLOCK=moe.SUM_BLOCK, HAS_RESIDUAL=True), False


@pytest.mark.parametrize("dt", ["bf16", "fp32"])
def test_fused_moe_kernels_compile_for_sm90_without_layout_round_trips_in_decode_loops(dt):
    require_compiled_kernels()
    failures = []
    for label, kernel, num_warps, num_stages, consts, streams in _kernels_at_default_configs(dt):
        try:
            compiled = _compile(kernel, dt, consts, num_warps, num_stages)
        except Exception as e:
            failures.append(f"{label}: {type(e).__name__}: {str(e)[:500]}")
            continue
        converts = innermost_loop_conversions(compiled.asm["ttgir"]) if streams else 0
        if converts:
            failures.append(f"{label}: {converts} layout conversions inside the streaming loops")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("change, message", [
    (dict(top_k=5), "top_k is 5; it must be in 1..4"),
    (dict(router=(3, 32)), "the router has 3 experts, gate_up 4, down 4"),
    (dict(gate_up=(4, 18, 32)), "are not \\[E, 2I, 32\\] and \\[E, 32, I\\]"),
    (dict(x=(2, 16)), "x must be \\[T, 32\\]"),
    (dict(norm=(16,)), "the norm weight is \\(16,\\), not \\[32\\]"),
    (dict(residual=(3, 32)), "the residual is \\(3, 32\\), x \\(2, 32\\): they must match"),
])
def test_arguments_the_kernels_would_read_past_are_refused_in_one_line(change, message):
    import torch

    from compiled_llm.kernels import triton_fused_moe

    shapes = {"x": (2, 32), "router": (4, 32), "gate_up": (4, 16, 32), "down": (4, 32, 8), **change}
    args = [torch.zeros(shapes[n]) for n in ("x", "router", "gate_up", "down")]
    optional = [torch.zeros(change[n]) if n in change else None for n in ("norm", "residual")]
    with pytest.raises(ValueError, match=message):
        triton_fused_moe.fused_moe(*args, change.get("top_k", 2), True, optional[0], 1e-6, optional[1])
