"""The weight-streaming GEMV kernels (triton_gemv, the norm + MLP decode form, the q/k/v decode
kernel): what they compute, and how they compile.

* What they compute: the cases in gemv_interpret_cases.py run in a child pytest with
  TRITON_INTERPRET=1 (the variable must be set before the kernels are decorated and must not
  leak into this process; see test_kernels_interpret.py).
* How they compile: each kernel is compiled for Hopper (sm_90) at the default launch configs and
  Qwen2.5-0.5B shapes, without a GPU, and its streaming loops are checked for layout conversions.
  A ``convert_layout`` inside a loop means every weight tile makes a round trip through shared
  memory (x and W tiles in different register layouts), which costs these bandwidth-bound
  kernels a large share of their speed while computing the same numbers, so no interpreter test
  would notice.
"""

from pathlib import Path

import pytest
from interpret_child import CASE_GROUPS, assert_cases_pass, import_triton, require_compiled_kernels

triton = import_triton()

CASES = Path(__file__).with_name("gemv_interpret_cases.py")


@pytest.mark.parametrize("group", CASE_GROUPS)
def test_gemv_kernels_under_interpreter(group):
    assert_cases_pass(CASES, group)


# ---------------------------------------------------------------------------------------------
# sm_90 code generation
# ---------------------------------------------------------------------------------------------

QWEN = dict(H=896, I=4864, Hq=14, Hkv=2, D=64)


def _compile(kernel, dt, consts, num_warps):
    """triton.compile for sm_90 with launch-like argument types: pointers and int arguments that
    real launches pass 16-divisible (strides, hidden sizes) marked so, as Triton specialises them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    special_ptrs = {"pos_ptr": "*i64", "cs_ptr": "*fp32"}
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        if name.endswith("_ptr") or name.endswith("_out"):
            sig[name] = special_ptrs.get(name, f"*{dt}")
        elif "eps" in name:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if sig[name].startswith("*") or name.startswith("stride") or name in ("K", "H", "N", "I"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 1})


def _innermost_loop_conversions(ttgir: str) -> int:
    """convert_layout ops inside innermost scf.for bodies (the streaming loops)."""
    lines, count = ttgir.splitlines(), 0
    for start, line in enumerate(lines):
        if "scf.for" not in line:
            continue
        depth, body = 0, []
        for inner in lines[start:]:
            depth += inner.count("{") - inner.count("}")
            body.append(inner)
            if depth <= 0:
                break
        if not any("scf.for" in b for b in body[1:]):
            count += sum("ttg.convert_layout" in b for b in body)
    return count


def _kernels_at_default_configs(dt):
    from compiled_llm.kernels import launch_configs
    from compiled_llm.kernels import triton_gemv as tg
    from compiled_llm.kernels import triton_norm_mlp as tm
    from compiled_llm.kernels import triton_qkv_rope as tq

    itemsize = 2 if dt == "bf16" else 4
    H, I, D = QWEN["H"], QWEN["I"], QWEN["D"]
    for T in (1, 2, 4):
        for table, K in (("gemv", H), ("norm_mlp_down", I)):
            tile = tg.tile_config(launch_configs.get(table, T), T, H, K, itemsize)
            if T == 1:  # gemv() runs the one-row kernel for a single row
                yield f"{table} T=1 (one-row kernel)", tg._gemv_one_row_kernel, tile["num_warps"], dict(
                    HAS_BIAS=True, HAS_RESIDUAL=True, BLOCK_N=tile["BLOCK_ROWS"], BLOCK_K=tile["BLOCK_K"],
                    VEC=16 // itemsize, PDL=True)
                continue
            yield f"{table} T={T}", tg._gemv_kernel, tile["num_warps"], dict(
                HAS_BIAS=True, HAS_RESIDUAL=True, BLOCK_T=tile["BLOCK_T"], BLOCK_N=tile["BLOCK_ROWS"],
                BLOCK_K=tile["BLOCK_K"], PDL=True)
        tile = tg.tile_config(launch_configs.get("norm_mlp_decode", T), T, I, H, itemsize,
                              rows_key="BLOCK_I", k_key="BLOCK_H")
        for glu in (True, False):
            if T == 1:  # decode_activation runs the one-row kernel for a single row
                yield f"norm_mlp_decode glu={glu} T=1 (one-row kernel)", tm._norm_mlp_one_row_kernel, \
                    tile["num_warps"], dict(IS_RMS=glu, IS_GLU=glu, BLOCK_I=tile["BLOCK_ROWS"],
                                            BLOCK_H=tile["BLOCK_K"], VEC=16 // itemsize, PDL=True)
                continue
            yield f"norm_mlp_decode glu={glu} T={T}", tm._norm_mlp_decode_kernel, tile["num_warps"], dict(
                IS_RMS=glu, IS_GLU=glu, BLOCK_T=tile["BLOCK_T"], BLOCK_I=tile["BLOCK_ROWS"], BLOCK_H=tile["BLOCK_K"],
                PDL=True)
        tile = tg.tile_config(launch_configs.get("qkv_decode", T), T, D // 2, H, itemsize, rows_key="BLOCK_P")
        for qk_norm in (False, True):
            yield f"qkv_decode qk_norm={qk_norm} T={T}", tq._qkv_decode_kernel, tile["num_warps"], dict(
                NUM_HEADS=QWEN["Hq"], NUM_KV_HEADS=QWEN["Hkv"], HEAD_DIM=D, HALF=D // 2,
                SPLITS=1 if qk_norm else D // 2 // tile["BLOCK_ROWS"], BLOCK_T=tile["BLOCK_T"],
                BLOCK_P=tile["BLOCK_ROWS"], BLOCK_K=tile["BLOCK_K"], BLOCK_HALF=D // 2,
                HAS_BIAS=True, HAS_INPUT_NORM=True, HAS_QK_NORM=qk_norm, HAS_ROPE=True, PDL=True,
                ONE_ROW=T == 1, VEC=16 // itemsize)


@pytest.mark.parametrize("dt", ["bf16", "fp32"])
def test_gemv_kernels_compile_for_sm90_without_layout_round_trips(dt):
    require_compiled_kernels()
    failures = []
    for label, kernel, num_warps, consts in _kernels_at_default_configs(dt):
        try:
            compiled = _compile(kernel, dt, consts, num_warps)
        except Exception as e:
            failures.append(f"{label}: {type(e).__name__}: {str(e)[:500]}")
            continue
        converts = _innermost_loop_conversions(compiled.asm["ttgir"])
        if converts:
            failures.append(f"{label}: {converts} layout conversions inside the streaming loops")
    assert not failures, "\n".join(failures)


def test_loop_conversion_check_sees_conversions():
    ir = "\n".join([
        "%a = scf.for %i = %c0 to %n step %c1 iter_args(%x = %z) -> (tensor<4xf32>) {",
        "  %b = ttg.convert_layout %x : tensor<4xf32, #blocked> -> tensor<4xf32, #blocked1>",
        "  scf.yield %b : tensor<4xf32>",
        "}",
        "%c = ttg.convert_layout %a : tensor<4xf32, #blocked> -> tensor<4xf32, #blocked1>",
    ])
    assert _innermost_loop_conversions(ir) == 1
