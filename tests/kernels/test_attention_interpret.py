"""The paged attention kernels: what they compute (Triton interpreter, CPU, fp32) and that they
compile for Hopper.

The cases live in helpers/attention_interpret_cases.py and run in a child pytest with
TRITON_INTERPRET=1: Triton decides at decoration time whether a kernel is interpreted, so the
variable has to be set before compiled_llm.kernels is imported, and setting it in this process
would turn every later test file's (and the GPU tests') kernels into interpreted ones.

The interpreter runs programs one after another, so it cannot show races between programs; the
compile test checks the memory-ordering instructions the fused decode reduce relies on instead,
and tests/kernels/test_attention_gpu.py runs the kernels concurrently.
"""

import re
import subprocess
from pathlib import Path

import pytest
from helpers.interpret_child import CASE_GROUPS, assert_cases_pass, import_triton, require_compiled_kernels

triton = import_triton()

CASES = Path(__file__).parents[1] / "helpers" / "attention_interpret_cases.py"


@pytest.mark.parametrize("group", CASE_GROUPS)
def test_attention_kernels_under_interpreter(group, request):
    assert_cases_pass(CASES, group, request)


# ---------------------------------------------------------------------------------------------
# compile for sm_90 with the specialisations a real launch gets
# ---------------------------------------------------------------------------------------------

MAX_SHARED = 227 * 1024  # H100/H200 per-block limit
UNIT_STRIDES = ("stride_qd", "stride_kd", "stride_vd", "stride_c_d", "stride_bt_b", "stride_od")
INDEX_PTRS = {"slot_ptr": "*i64", "bt_ptr": "*i32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32",
              "counter_ptr": "*i32", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32"}


def _compile(kernel, consts, dtype, num_warps, num_stages):
    """triton.compile for sm_90 as a launch would specialise it: unit strides constant, other
    strides and pointers 16-divisible (without those hints loads are not vectorised and not
    pipelined, and the PTX would not be what runs)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = dict(consts, **{n: 1 for n in UNIT_STRIDES if n in kernel.arg_names})
    sig = {}
    for n in kernel.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = INDEX_PTRS.get(n, f"*{dtype}")
        else:
            sig[n] = "fp32" if n == "qk_scale" else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if sig[n] != "constexpr" and (n.endswith("_ptr") or n.startswith("stride_"))}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _stack_bytes(compiled) -> int | None:
    """Per-thread stack frame of the cubin (> 0: registers spilled), or None without cuobjdump."""
    import shutil
    import tempfile

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    tool = str(tool) if tool.exists() else shutil.which("cuobjdump")
    if tool is None or "cubin" not in compiled.asm:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
    found = re.search(r"STACK:(\d+)", res.stdout)
    return int(found.group(1)) if found else None


def _decode_variants():
    """Every decode bucket's config, at one split and at its most, over the GQA groups and head
    sizes of the supported families (every constexpr given: one left out would compile as a
    runtime argument, both sides of its branches)."""
    from compiled_llm.kernels import launch_configs

    from compiled_llm.kernels.triton_paged_attention import for_head_dim

    for bucket, bucket_cfg in launch_configs.DEFAULT_CONFIGS["paged_attention_decode"].items():
        for group, head_dim, window, softcap in LAYER_KINDS:
            cfg = for_head_dim(bucket_cfg, head_dim)
            for splits in (1, cfg["MAX_SPLITS"]):
                yield f"decode[{bucket}] G{group} D{head_dim} W{window} cap{softcap} splits={splits}", cfg, dict(
                    GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=16, NUM_SPLITS=splits,
                    BLOCK_H=16, BLOCK_N=cfg["BLOCK_N"], BLOCK_D=head_dim, BLOCK_G=triton.next_power_of_2(group),
                    BLOCK_P=min(triton.next_power_of_2(splits), triton.next_power_of_2(cfg["COMBINE_SPLITS"])),
                    IEEE=False, PDL=False, PREFETCH=bool(cfg.get("PREFETCH", 0)), WINDOW=window, SOFTCAP=softcap)


# (GQA group, head_dim, sliding window, soft cap) of the supported families' attention layers:
# Qwen2.5, Llama 3, Qwen3 / Mistral (window 4096), Gemma 2 (head_dim 256, capped; its global
# layers differ by the window alone), Gemma 3 (local, uncapped)
LAYER_KINDS = ((7, 64, 0, 0.0), (4, 64, 0, 0.0), (4, 128, 0, 0.0), (2, 128, 0, 0.0), (1, 64, 0, 0.0),
               (4, 128, 4096, 0.0), (2, 256, 4096, 50.0), (4, 256, 512, 0.0))


def test_attention_kernels_compile_for_sm90_with_default_configs():
    require_compiled_kernels()
    from compiled_llm.kernels import launch_configs
    from compiled_llm.kernels import triton_paged_attention as pa

    failures = []
    for label, cfg, consts in _decode_variants():
        try:
            c = _compile(pa._decode_kernel, consts, "bf16", cfg["num_warps"], cfg["num_stages"])
        except Exception as e:
            failures.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
            continue
        ptx = c.asm["ptx"]
        if c.metadata.shared > MAX_SHARED:
            failures.append(f"{label}: {c.metadata.shared} bytes of shared memory")
        # the prefetch holds two K/V tiles in registers: at head_dim 128 a few spill (24 bytes
        # with triton 3.9), and it is still faster on an H200 (benchmarks/NOTES.md); a sliding
        # layer's window bounds take a few registers more (56 bytes at head_dim 128)
        if (_stack_bytes(c) or 0) > ((64 if consts["WINDOW"] else 32) if consts["PREFETCH"] else 0):
            failures.append(f"{label}: registers spill ({_stack_bytes(c)} bytes of stack)")
        if consts["NUM_SPLITS"] > 1:
            # the ticket publishes this CTA's partials and acquires the others' (gpu scope);
            # the winner reads them from L2, past a possibly stale L1
            if not re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx):
                failures.append(f"{label}: no acq_rel gpu-scope atomic add")
            if "ld.global.cg" not in ptx:
                failures.append(f"{label}: partials not read with .cg")
        elif "atom." in ptx:
            failures.append(f"{label}: an atomic without a split reduce")
    for bucket, bucket_cfg in launch_configs.DEFAULT_CONFIGS["paged_attention_prefill"].items():
        for heads, kv_heads, head_dim, window, softcap in ((14, 2, 64, 0, 0.0), (32, 8, 64, 0, 0.0),
                                                           (16, 8, 128, 0, 0.0), (32, 8, 128, 4096, 0.0),
                                                           (8, 4, 256, 4096, 50.0), (4, 1, 256, 512, 0.0)):
            cfg = pa.for_head_dim(bucket_cfg, head_dim)
            block_m, tokens = pa.prefill_tile(heads, kv_heads, cfg["BLOCK_M"])
            consts = dict(GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=16, TOKENS=tokens, BLOCK_M=block_m,
                          BLOCK_N=cfg["BLOCK_N"], BLOCK_D=head_dim, IEEE=False, WINDOW=window, SOFTCAP=softcap)
            label = f"prefill[{bucket}] {heads}/{kv_heads} D{head_dim} W{window} cap{softcap}"
            try:
                c = _compile(pa._prefill_kernel, consts, "bf16", cfg["num_warps"], cfg["num_stages"])
            except Exception as e:
                failures.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
                continue
            if c.metadata.shared > MAX_SHARED:
                failures.append(f"{label}: {c.metadata.shared} bytes of shared memory")
            if _stack_bytes(c):
                failures.append(f"{label}: registers spill ({_stack_bytes(c)} bytes of stack)")
            if cfg["num_stages"] > 1 and "cp.async" not in c.asm["ptx"]:
                failures.append(f"{label}: K/V loads not pipelined (no cp.async)")
    assert not failures, "\n".join(failures)


def test_only_batches_the_decode_grid_holds_take_the_decode_kernel():
    import torch

    from compiled_llm.kernels import triton_paged_attention as pa

    def decode_shaped(num_seqs):  # one query row per sequence
        return pa.is_decode_batch(torch.empty(num_seqs, 1, 1), torch.empty(num_seqs + 1))

    assert decode_shaped(1) and decode_shaped(pa.MAX_DECODE_SEQS)
    assert not decode_shaped(pa.MAX_DECODE_SEQS + 1)  # CUDA's grid y: such a batch takes the prefill kernel
    assert not pa.is_decode_batch(torch.empty(5, 1, 1), torch.empty(3))  # two sequences, five rows
