"""The weight-streaming GEMV kernels (triton_gemv, the norm + MLP decode form, the q/k/v decode
kernel): what they compute, and how they compile.

* What they compute: the cases in helpers/gemv_interpret_cases.py run in a child pytest with
  TRITON_INTERPRET=1 (the variable must be set before the kernels are decorated and must not
  leak into this process; see test_kernels_interpret.py).
* How they compile: each kernel is compiled for Hopper (sm_90) at the default launch configs and
  Qwen2.5-0.5B shapes, without a GPU, and its streaming loops are checked for layout conversions.
  A ``convert_layout`` inside a loop means every weight tile makes a round trip through shared
  memory (x and W tiles in different register layouts), which costs these bandwidth-bound
  kernels a large share of their speed while computing the same numbers, so no interpreter test
  would notice. The int4 forms' loops hold conversions between layouts that place every element
  alike (small index and mask tensors), which compile to nothing: for them the generated code
  itself is checked for what a real conversion compiles to (shared memory, barriers, shuffles).
"""

import re
from pathlib import Path

import pytest
from helpers.interpret_child import CASE_GROUPS, assert_cases_pass, import_triton, require_compiled_kernels
from helpers.ttgir import compile_for_sm90, innermost_loop_conversions

triton = import_triton()

CASES = Path(__file__).parents[1] / "helpers" / "gemv_interpret_cases.py"


@pytest.mark.parametrize("group", CASE_GROUPS)
def test_gemv_kernels_under_interpreter(group, request):
    assert_cases_pass(CASES, group, request)


# ---------------------------------------------------------------------------------------------
# sm_90 code generation
# ---------------------------------------------------------------------------------------------

QWEN = dict(H=896, I=4864, Hq=14, Hkv=2, D=64)


def _compile(kernel, dt, consts, num_warps, ptr_types=None):
    """The kernel for sm_90 as launches type its arguments: pointers of the dtype (positions
    int64, cos/sin fp32), eps fp32, the rest int32; pointers, strides and sizes 16-divisible."""
    special_ptrs = {"pos_ptr": "*i64", "cs_ptr": "*fp32", **(ptr_types or {})}

    def arg_type(name):
        if name.endswith("_ptr") or name.endswith("_out"):
            return special_ptrs.get(name, f"*{dt}")
        return "fp32" if "eps" in name else "i32"

    return compile_for_sm90(kernel, consts, num_warps, arg_type, lambda name, t: t.startswith("*")
                            or name.startswith("stride") or name in ("K", "H", "N", "I"))


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
        # SwiGLU, GeGLU (gelu_tanh gate) and GPT-2's GELU MLP
        for glu, gate_gelu in ((True, False), (True, True), (False, False)):
            kind = f"glu={glu} gate_gelu={gate_gelu}"
            if T == 1:  # decode_activation runs the one-row kernel for a single row
                yield f"norm_mlp_decode {kind} T=1 (one-row kernel)", tm._norm_mlp_one_row_kernel, \
                    tile["num_warps"], dict(IS_RMS=glu, IS_GLU=glu, BLOCK_I=tile["BLOCK_ROWS"],
                                            BLOCK_H=tile["BLOCK_K"], VEC=16 // itemsize, PDL=True,
                                            GATE_GELU=gate_gelu)
                continue
            yield f"norm_mlp_decode {kind} T={T}", tm._norm_mlp_decode_kernel, tile["num_warps"], dict(
                IS_RMS=glu, IS_GLU=glu, BLOCK_T=tile["BLOCK_T"], BLOCK_I=tile["BLOCK_ROWS"], BLOCK_H=tile["BLOCK_K"],
                PDL=True, GATE_GELU=gate_gelu)
        tile = tg.tile_config(launch_configs.get("qkv_decode", T), T, D // 2, H, itemsize, rows_key="BLOCK_P")
        yield f"qkv_decode T={T}", tq._qkv_decode_kernel, tile["num_warps"], dict(
            NUM_HEADS=QWEN["Hq"], NUM_KV_HEADS=QWEN["Hkv"], HEAD_DIM=D, HALF=D // 2,
            SPLITS=D // 2 // tile["BLOCK_ROWS"], BLOCK_T=tile["BLOCK_T"], BLOCK_P=tile["BLOCK_ROWS"],
            BLOCK_K=tile["BLOCK_K"], HAS_BIAS=True, HAS_INPUT_NORM=True, HAS_ROPE=True, PDL=True,
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
        converts = innermost_loop_conversions(compiled.asm["ttgir"])
        if converts:
            failures.append(f"{label}: {converts} layout conversions inside the streaming loops")
    assert not failures, "\n".join(failures)


def _int4_kernels_at_default_configs(dt):
    """The INT4 forms (which run at every T) at the default launch configs, widened as the
    wrappers widen them, for the numbers of rows each form is dispatched at by default."""
    import torch

    from compiled_llm.kernels import launch_configs
    from compiled_llm.kernels import triton_gemv as tg
    from compiled_llm.kernels import triton_norm_mlp as tm
    from compiled_llm.kernels import triton_qkv_rope as tq

    x = torch.empty(0, dtype=torch.bfloat16 if dt == "bf16" else torch.float32)
    w = torch.empty(0, dtype=torch.uint8)
    H, I, D = QWEN["H"], QWEN["I"], QWEN["D"]

    def tile(table, T, rows, K, k_key="BLOCK_K", rows_key="BLOCK_N", row_sets=1):
        cfg = tg.per_weight_bytes(launch_configs.get(table, T), k_key, x, w)
        t = tg.tile_config(cfg, T, rows, K, tg.weight_itemsize(w), rows_key=rows_key, k_key=k_key)
        return t, tg.int4_constants(K, torch.empty(0, K // 128), t, x, row_sets)

    for T in (1, 2, 4):
        for table, K in (("gemv", H), ("norm_mlp_down", I)):
            if not (tg.use_gemv(T) if table == "gemv" else tm.use_decode_form(T)):
                continue
            t, int4 = tile(table, T, H, K)
            yield f"int4 {table} T={T}", tg._gemv_kernel, t["num_warps"], dict(
                HAS_BIAS=True, HAS_RESIDUAL=True, BLOCK_T=t["BLOCK_T"], BLOCK_N=t["BLOCK_ROWS"],
                BLOCK_K=t["BLOCK_K"], PDL=True, **int4)
        for glu in (True, False) if tm.use_decode_form(T) else ():
            t, int4 = tile("norm_mlp_decode", T, I, H, k_key="BLOCK_H", rows_key="BLOCK_I", row_sets=1 + glu)
            yield f"int4 norm_mlp_decode glu={glu} T={T}", tm._norm_mlp_decode_kernel, t["num_warps"], dict(
                IS_RMS=glu, IS_GLU=glu, BLOCK_T=t["BLOCK_T"], BLOCK_I=t["BLOCK_ROWS"], BLOCK_H=t["BLOCK_K"],
                PDL=True, **int4)
        if not tq.use_decode_form(T):
            continue
        t, int4 = tile("qkv_decode", T, D // 2, H, rows_key="BLOCK_P", row_sets=2)
        yield f"int4 qkv_decode T={T}", tq._qkv_decode_kernel, t["num_warps"], dict(
            NUM_HEADS=QWEN["Hq"], NUM_KV_HEADS=QWEN["Hkv"], HEAD_DIM=D, HALF=D // 2,
            SPLITS=D // 2 // t["BLOCK_ROWS"], BLOCK_T=t["BLOCK_T"], BLOCK_P=t["BLOCK_ROWS"],
            BLOCK_K=t["BLOCK_K"], HAS_BIAS=True, HAS_INPUT_NORM=True, HAS_ROPE=True, PDL=True, **int4)


INT4_PTRS = {"w_ptr": "*u8", "w1_ptr": "*u8", "s_ptr": "*fp32", "s1_ptr": "*fp32", "z_ptr": "*fp32", "z1_ptr": "*fp32"}


def _streaming_ptx_loops(ptx: str) -> list[str]:
    """The innermost loops of PTX (LLVM marks their headers "This Inner Loop Header") that stream
    weights (their loads are evict-first), each from its header to its last branch back."""
    lines, loops = ptx.splitlines(), []
    for i, line in enumerate(lines):
        if "This Inner Loop Header" not in line:
            continue
        start = max(j for j in range(i + 1) if re.match(r"\$L__BB\d+_\d+:", lines[j]))
        label = lines[start].split(":")[0]
        end = max(j for j, b in enumerate(lines) if re.search(rf"\bbra(?:\.uni)?\s+\{label};", b))
        body = "\n".join(lines[start:end + 1])
        if "evict_first" in body:
            loops.append(body)
    return loops


def _loop_round_trips(ptx: str) -> int:
    """Shared-memory accesses, barriers and warp shuffles inside the streaming loops: what moving
    elements between threads (a real layout conversion) compiles to."""
    return sum(len(re.findall(r"\b(?:st\.shared|ld\.shared|bar\.sync|shfl\.sync)", body))
               for body in _streaming_ptx_loops(ptx))


@pytest.mark.parametrize("dt", ["bf16", "fp32"])
def test_int4_kernels_compile_for_sm90_without_round_trips_in_their_loops(dt):
    require_compiled_kernels()
    failures = []
    for label, kernel, num_warps, consts in _int4_kernels_at_default_configs(dt):
        try:
            ptx = _compile(kernel, dt, consts, num_warps, INT4_PTRS).asm["ptx"]
        except Exception as e:
            failures.append(f"{label}: {type(e).__name__}: {str(e)[:500]}")
            continue
        if not _streaming_ptx_loops(ptx):
            failures.append(f"{label}: no streaming loop found in the PTX")
        elif _loop_round_trips(ptx):
            failures.append(f"{label}: {_loop_round_trips(ptx)} shared-memory or shuffle ops in the streaming loops")
    assert not failures, "\n".join(failures)


def test_loop_conversion_check_sees_conversions():
    ir = "\n".join([
        "%a = scf.for %i = %c0 to %n step %c1 iter_args(%x = %z) -> (tensor<4xf32>) {",
        "  %b = ttg.convert_layout %x : tensor<4xf32, #blocked> -> tensor<4xf32, #blocked1>",
        "  scf.yield %b : tensor<4xf32>",
        "}",
        "%c = ttg.convert_layout %a : tensor<4xf32, #blocked> -> tensor<4xf32, #blocked1>",
    ])
    assert innermost_loop_conversions(ir) == 1


def test_ptx_round_trip_check_sees_shared_memory_in_a_streaming_loop():
    ptx = "\n".join([
        "$L__BB0_1:                              // =>This Inner Loop Header: Depth=1",
        "\tshfl.sync.bfly.b32 %r5, %r4, 16, 31, -1;",  # a reduction in a loop that streams nothing
        "\t@%p1 bra $L__BB0_1;",
        "$L__BB0_2:                              // =>This Loop Header: Depth=1",
        "$L__BB0_3:                              // =>This Inner Loop Header: Depth=2",
        "\tld.global.L1::evict_first.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];",
        "\tst.shared.b32 [%r2], %r1;",
        "\tbar.sync 0;",
        "\t@%p1 bra $L__BB0_3;",
        "\tld.shared.b32 %r3, [%r2];",
        "\t@%p2 bra $L__BB0_2;",
    ])
    assert len(_streaming_ptx_loops(ptx)) == 1 and _loop_round_trips(ptx) == 2
