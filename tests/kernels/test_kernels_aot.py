"""Every Triton kernel compiles for Hopper (sm_90) without a GPU.

The interpreter (test_kernels_interpret.py) checks what the kernels compute, but it never runs
Triton's code generator: tl.dot shape limits, type mismatches between branches, shared-memory
overflows only show up when compiling for a real target. triton.compile with an explicit
GPUTarget does that on a CPU machine (Triton ships ptxas), so a broken kernel fails here rather
than in scarce GPU time. Launch-shaped arguments: bf16/fp16 the real dtypes, fp32 for the
IEEE-dot variants.
"""

import inspect
import itertools

import pytest
from helpers.interpret_child import import_triton, require_compiled_kernels

triton = import_triton()

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from compiled_llm.kernels import launch_configs  # noqa: E402
from compiled_llm.kernels import (  # noqa: E402
    triton_all_reduce as tar,
    triton_bitmask as tb,
    triton_gemm_wq as gq,
    triton_kv_store as kvs,
    triton_norm as tn,
    triton_norm_mlp as tm,
    triton_paged_attention as pa,
    triton_qkv_rope as tq,
    triton_sampling as ts,
)

TARGET = GPUTarget("cuda", 90, 32)
MAX_SHARED = 227 * 1024  # H100/H200 per-block limit


def _stride_args(*names):
    return {n: 1 for n in names}


def _cases(dt):
    ieee = dt == "fp32"
    ptr = lambda *names: {n: f"*{dt}" for n in names}  # noqa: E731
    idx = {"bt_ptr": "*i32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "qk_scale": 1.0}
    cache_strides = _stride_args("stride_c_kv", "stride_c_blk", "stride_c_off", "stride_c_h", "stride_c_d")
    yield "kv_store", kvs._kv_store_kernel, 1, {
        **ptr("k_ptr", "v_ptr", "cache_ptr"), "slot_ptr": "*i64", **cache_strides,
        **_stride_args("stride_kt", "stride_kh", "stride_kd", "stride_vt", "stride_vh", "stride_vd"),
    }, dict(NUM_KV_HEADS=2, HEAD_DIM=64, BLOCK_SIZE=16, BLOCK_HK=2, BLOCK_D=64)
    for head_dim, group, block_n in ((64, 7, 32), (128, 2, 64)):
        for splits, prefetch in ((1, False), (16, False), (1, True)):  # direct output; fused reduce; next tile early
            yield f"decode D{head_dim} splits={splits} prefetch={prefetch}", pa._decode_kernel, 4, {
                **ptr("q_ptr", "k_ptr", "v_ptr", "cache_ptr", "out_ptr"), **idx, "slot_ptr": "*i64",
                "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "counter_ptr": "*i32", **cache_strides,
                **_stride_args("stride_qt", "stride_qh", "stride_qd", "stride_kt", "stride_kh", "stride_kd",
                               "stride_vt", "stride_vh", "stride_vd", "stride_bt_s", "stride_bt_b", "stride_ot",
                               "stride_oh", "stride_od", "stride_mo_s", "stride_mo_h", "stride_mo_p",
                               "stride_ml_s", "stride_ml_h"),
            }, dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=16, NUM_SPLITS=splits,
                    BLOCK_H=16, BLOCK_N=block_n, BLOCK_D=head_dim,
                    BLOCK_G=triton.next_power_of_2(group), BLOCK_P=16, IEEE=ieee, PDL=splits > 1,
                    PREFETCH=prefetch)
        yield f"prefill D{head_dim}", pa._prefill_kernel, 4, {
            **ptr("q_ptr", "cache_ptr", "out_ptr"), **idx, **cache_strides,
            **_stride_args("stride_qt", "stride_qh", "stride_qd", "stride_bt_s", "stride_bt_b", "stride_ot",
                           "stride_oh", "stride_od", "NUM_SEQS", "T"),
        }, dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=16, TOKENS=64 // group, BLOCK_M=64, BLOCK_N=64,
                BLOCK_D=head_dim, IEEE=ieee)
    for rms in (True, False):
        yield f"norm rms={rms}", tn._norm_kernel, 4, {
            **ptr("x_ptr", "res_ptr", "w_ptr", "b_ptr", "out_ptr", "sum_ptr"),
            **_stride_args("stride_x", "stride_r", "stride_o", "stride_s", "N"), "eps": 1.0,
        }, dict(IS_RMS=rms, HAS_RESIDUAL=rms, BLOCK_N=2048, STORE_INPUT=not rms)
        mlp_args = {
            **ptr("x_ptr", "nw_ptr", "nb_ptr", "w1_ptr", "b1_ptr", "act_ptr"), "s1_ptr": "*fp32", "z1_ptr": "*fp32",
            "eps": 1.0, **_stride_args("T", "H", "I", "stride_x", "stride_w1", "stride_a"),
        }
        yield f"norm_mlp_decode rms={rms}", tm._norm_mlp_decode_kernel, 4, mlp_args, dict(
            IS_RMS=rms, IS_GLU=rms, BLOCK_T=4, BLOCK_I=2, BLOCK_H=1024, PDL=rms, SCALED=False)
        # weight-only int8: int8 weight rows, a scale per row
        yield f"norm_mlp_decode int8 rms={rms}", tm._norm_mlp_decode_kernel, 4, {**mlp_args, "w1_ptr": "*i8"}, dict(
            IS_RMS=rms, IS_GLU=rms, BLOCK_T=4, BLOCK_I=2, BLOCK_H=2048, PDL=rms, SCALED=True)
        # weight-only int4: two weights a byte, a scale and zero point per group of 128 columns
        yield f"norm_mlp_decode int4 rms={rms}", tm._norm_mlp_decode_kernel, 4, {**mlp_args, "w1_ptr": "*u8"}, dict(
            IS_RMS=rms, IS_GLU=rms, BLOCK_T=2, BLOCK_I=2, BLOCK_H=2048, PDL=rms, INT4=True, GROUP=128, VB=16)
        yield f"act glu={rms}", tm._act_kernel, 4, {
            **ptr("in_ptr", "out_ptr"), **_stride_args("I", "stride_in", "stride_out"),
        }, dict(IS_GLU=rms, BLOCK=1024)
    # GeGLU (Gemma): the GLU forms with gelu_tanh for the gate's activation
    yield "norm_mlp_decode geglu", tm._norm_mlp_decode_kernel, 4, mlp_args, dict(
        IS_RMS=True, IS_GLU=True, BLOCK_T=4, BLOCK_I=2, BLOCK_H=1024, PDL=True, SCALED=False, GATE_GELU=True)
    yield "norm_mlp_decode int4 geglu", tm._norm_mlp_decode_kernel, 4, {**mlp_args, "w1_ptr": "*u8"}, dict(
        IS_RMS=True, IS_GLU=True, BLOCK_T=2, BLOCK_I=2, BLOCK_H=2048, PDL=True, INT4=True, GROUP=128, VB=16,
        GATE_GELU=True)
    yield "act geglu", tm._act_kernel, 4, {
        **ptr("in_ptr", "out_ptr"), **_stride_args("I", "stride_in", "stride_out"),
    }, dict(IS_GLU=True, BLOCK=1024, GATE_GELU=True)
    # weight-only int8/int4 past the decode forms: the GEMM at every bucket of its default table,
    # and the dequantizing kernel
    for (bucket, cfg), (scheme, wt) in itertools.product(launch_configs.DEFAULT_CONFIGS["gemm_wq"].items(),
                                                         (("int8", "*i8"), ("int4", "*u8"))):
        int4 = scheme == "int4"
        yield f"gemm_wq {scheme} bucket {bucket}", gq._gemm_wq_kernel, cfg["num_warps"], {
            **ptr("x_ptr", "b_ptr", "r_ptr", "out_ptr"), "w_ptr": wt, "s_ptr": "*fp32", "z_ptr": "*fp32",
            **_stride_args("M", "N", "K", "stride_x", "stride_w", "stride_r", "stride_o"),
        }, dict(HAS_BIAS=True, HAS_RESIDUAL=True, INT4=int4, GROUP=128, IEEE=ieee, BLOCK_M=cfg["BLOCK_M"],
                BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"])
    for int4, wt in ((False, "*i8"), (True, "*u8")):
        yield f"dequantize int4={int4}", gq._dequantize_kernel, 4, {
            "w_ptr": wt, "s_ptr": "*fp32", "z_ptr": "*fp32", **ptr("out_ptr"),
            **_stride_args("N", "K", "stride_w"),
        }, dict(INT4=int4, GROUP=128 if int4 else 1, BLOCK_N=8, BLOCK_K=1024)
    for greedy in (True, False):
        yield f"sample greedy={greedy}", ts._sample_kernel, 4, {
            **ptr("logits_ptr"), "temp_ptr": "*fp32", "seed_ptr": "*i32", "part_val_ptr": "*fp32",
            "part_idx_ptr": "*i32", "counter_ptr": "*i32", "out_ptr": "*i64",
            **_stride_args("V", "stride_l", "CHUNK", "SPLITS"),
        }, dict(GREEDY=greedy, BLOCK=1024, BLOCK_S=ts.MAX_SPLITS)
    yield "token bitmask", tb._bitmask_kernel, tb.NUM_WARPS, {
        **ptr("logits_ptr"), "bitmask_ptr": "*i32",
        **_stride_args("V", "stride_l", "stride_lv", "W", "stride_b", "stride_bw"),
    }, dict(BLOCK=tb.BLOCK_V)
    yield "qkv_epilogue", tq._qkv_epilogue_kernel, 1, {
        **ptr("q_src", "k_src", "v_src", "q_out", "k_out", "v_out", "q_norm_ptr", "k_norm_ptr"),
        "pos_ptr": "*i64", "cs_ptr": "*fp32", "eps": 1.0,
        **_stride_args("T", "stride_qt", "stride_qh", "stride_qd", "stride_kt", "stride_kh", "stride_kd",
                       "stride_vt", "stride_vh", "stride_vd", "stride_cs"),
    }, dict(NUM_HEADS=14, NUM_KV_HEADS=2, HAS_V=True, HEAD_DIM=64, HALF=32, BLOCK_HALF=32, HAS_NORM=True,
            HAS_ROPE=True, BLOCK_T=16)
    for residual, one_pass in itertools.product((True, False), (True, False)):  # the timer and trap as on a GPU
        yield f"custom all-reduce residual={residual} one_pass={one_pass}", tar._push_kernel, 8, {
            **ptr("x_ptr", "r_ptr", "out_ptr"), "bases": "*i64", "rank": "i32", "n": "i32", "slot_elems": "i32",
            "timeout_ns": "i64",
        }, dict(WORLD=2, HEADER=tar.HEADER_BYTES, CALL=tar.CALL_INDEX, DONE=tar.DONE_INDEX, HAS_RESIDUAL=residual,
                BLOCK=tar.MIN_CHUNK, ONE_PASS=one_pass, TIMER=True, PDL=True)
    # the largest one-pass chunk: x, the residual and the fp32 sum in registers
    yield "custom all-reduce one_pass=True, largest chunk", tar._push_kernel, 8, {
        **ptr("x_ptr", "r_ptr", "out_ptr"), "bases": "*i64", "rank": "i32", "n": "i32", "slot_elems": "i32",
        "timeout_ns": "i64",
    }, dict(WORLD=2, HEADER=tar.HEADER_BYTES, CALL=tar.CALL_INDEX, DONE=tar.DONE_INDEX, HAS_RESIDUAL=True,
            BLOCK=tar.MAX_CHUNK, ONE_PASS=True, TIMER=True, PDL=True)


def _with_defaults(kernel, consts):
    """``consts`` and the kernel's other constexprs at their defaults, as a launch leaves them."""
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.default is not inspect.Parameter.empty}
    return {**defaults, **consts}


def _signature(kernel, args, consts):
    sig = {}
    for name in kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        else:
            v = args[name]
            sig[name] = v if isinstance(v, str) else ("fp32" if isinstance(v, float) else "i32")
    return sig


@pytest.mark.parametrize("dt", ["bf16", "fp32"])
def test_every_kernel_compiles_for_sm90(dt):
    require_compiled_kernels()
    failures = []
    for label, kernel, num_warps, args, consts in _cases(dt):
        consts = _with_defaults(kernel, consts)
        try:
            src = ASTSource(fn=kernel, signature=_signature(kernel, args, consts), constexprs=consts)
            compiled = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": 2})
        except Exception as e:
            failures.append(f"{label}: {type(e).__name__}: {str(e)[:500]}")
            continue
        if compiled.metadata.shared > MAX_SHARED:
            failures.append(f"{label}: {compiled.metadata.shared} bytes of shared memory")
    assert not failures, "\n".join(failures)
