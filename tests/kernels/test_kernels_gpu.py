"""Triton and CUDA C++ providers against the references on a GPU, at real model shapes.

Qwen2.5-0.5B (H 896, I 4864, 14 q / 2 kv heads, head_dim 64), Llama-3.2-1B (H 2048, I 8192,
32 / 8 heads, head_dim 64), Qwen3-0.6B's q/k-norm attention (16 / 8 heads, head_dim 128) and
GPT-2 (H 768, I 3072, 12 heads); fresh random bf16 and fp16 inputs; relative error
||out - ref|| / ||ref|| <= 1e-2. Outputs are poisoned (the allocator's free blocks filled with
NaN) before each run, and cache slots outside every context hold NaN, so an element a kernel
forgets to write or a slot it wrongly reads shows up. Decode-path providers are also captured
in a CUDA graph and replayed on new inputs, as the runtime does.

The ops' optional epilogues and prologues are checked both ways: the o projection with its
residual add (fused_linear_residual) at decode and prefill row counts, the MLPs with and without
a residual, and fused_qkv_rope with and without the layer's input RMSNorm folded in.
"""

import pytest
import torch

pytest.importorskip("triton")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from compiled_llm.graph import fused_ops, ops  # noqa: E402
from compiled_llm.kernels import cuda_norm_mlp, providers, triton_norm_mlp  # noqa: E402
from helpers.kernel_inputs import (  # noqa: E402
    attention_case, mlp_gelu_inputs, mlp_glu_inputs, poison_allocator, qkv_inputs, rel_err,
)

DEV = "cuda"
TOL = 1e-2
DTYPES = [torch.bfloat16, torch.float16]
MODELS = {
    "qwen2.5-0.5b": dict(H=896, I=4864, Hq=14, Hkv=2, D=64),
    "llama-3.2-1b": dict(H=2048, I=8192, Hq=32, Hkv=8, D=64),
}
QWEN3 = dict(H=1024, I=3072, Hq=16, Hkv=8, D=128)
GPT2 = dict(H=768, I=3072, Hq=12, Hkv=12, D=64)
GEMMA3 = dict(H=1152, I=6912, Hq=4, Hkv=1, D=256)  # head_dim 256, one kv head, q/k norms


def triton_op(name):
    return providers.provider_op(name, providers.TRITON)


def _poisoned_call(fn, *args, numel=1 << 22, **kwargs):
    poison_allocator(DEV, numel, numel // 4, numel // 16)
    return fn(*args, **kwargs)


def _rnd(gen, *shape, dtype, scale=1.0, shift=0.0):
    return (torch.randn(shape, generator=gen) * scale + shift).to(DEV, dtype)


def linear_residual_inputs(T: int, K: int, N: int, dtype, seed: int, bias: bool = False):
    """(x [T, K], weight [N, K], bias [N] or None, residual [T, N]), unit-variance activations."""
    gen = torch.Generator().manual_seed(seed)
    return (_rnd(gen, T, K, dtype=dtype), _rnd(gen, N, K, dtype=dtype, scale=K ** -0.5),
            _rnd(gen, N, dtype=dtype, scale=0.1) if bias else None, _rnd(gen, T, N, dtype=dtype))


def residual_like(out_args, seed: int):
    """A residual stream for an MLP (shaped like its input x) in x's dtype."""
    x = out_args[0]
    return _rnd(torch.Generator().manual_seed(seed), *x.shape, dtype=x.dtype)


def input_norm(args, seed: int):
    """(norm_weight [H], norm_eps): the layer's input RMSNorm for fused_qkv_rope."""
    x = args[0]
    return _rnd(torch.Generator().manual_seed(seed), x.shape[-1], dtype=x.dtype, scale=0.1, shift=1.0), 1e-6


def projection_err(out, ref, residual) -> float:
    """rel_err of the part the op adds to the residual (the residual alone would pass rel_err
    of the sums), in float64."""
    return rel_err(out.double() - residual.double(), ref.double() - residual.double())


# ---------------------------------------------------------------------------------------------
# paged attention
# ---------------------------------------------------------------------------------------------


def _run_attention(case, op):
    out_cache, ref_cache = case.kv_cache.clone(), case.kv_cache.clone()
    out = _poisoned_call(op, *case.args(out_cache))
    ref = ops.paged_attention(*case.args(ref_cache))
    torch.cuda.synchronize()
    assert torch.equal(out_cache.nan_to_num(7.0), ref_cache.nan_to_num(7.0)), "kv store wrote wrong slots"
    err = rel_err(out, ref)
    assert err <= TOL, err
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", list(MODELS))
def test_paged_attention_decode(model, dtype):
    m = MODELS[model]
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(1, 3000, (13,), generator=g).tolist() + [1, 16, 17]
    case = attention_case([(c - 1, 1) for c in ctx], m["Hq"], m["Hkv"], m["D"], 16, dtype, DEV, seed=1,
                          pad_rows=3, max_blocks=256)
    out = _run_attention(case, triton_op("paged_attention"))
    assert out[-3:].abs().sum() == 0  # padding rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", list(MODELS))
def test_paged_attention_prefill_and_mixed(model, dtype):
    m = MODELS[model]
    specs = [(0, 300), (500, 128), (1000, 1), (0, 17), (33, 64)]
    case = attention_case(specs, m["Hq"], m["Hkv"], m["D"], 16, dtype, DEV, seed=2)
    _run_attention(case, triton_op("paged_attention"))


def test_paged_attention_head_dim_128_decode_and_prefill():
    m = QWEN3
    for specs, pad in (([(700, 1), (0, 1), (60, 1)], 1), ([(0, 200), (90, 40)], 0)):
        case = attention_case(specs, m["Hq"], m["Hkv"], m["D"], 16, torch.bfloat16, DEV, seed=3, pad_rows=pad)
        _run_attention(case, triton_op("paged_attention"))


# ---------------------------------------------------------------------------------------------
# norms, qkv + rope
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [896, 2048, 768])
@pytest.mark.parametrize("T", [1, 7, 512])
def test_norms(T, H, dtype):
    g = torch.Generator().manual_seed(T * H)
    x, r = (torch.randn(T, H, generator=g).to(DEV, dtype) for _ in range(2))
    w, b = (torch.randn(H, generator=g).to(DEV, dtype) for _ in range(2))
    assert rel_err(_poisoned_call(triton_op("rms_norm"), x, w, 1e-6), ops.rms_norm_ref(x, w, 1e-6)) <= TOL
    assert rel_err(_poisoned_call(triton_op("layer_norm"), x, w, b, 1e-5), ops.layer_norm_ref(x, w, b, 1e-5)) <= TOL
    for name, args in (("fused_add_rms_norm", (x, r, w, 1e-6)), ("fused_add_layer_norm", (x, r, w, b, 1e-5))):
        normed, summed = _poisoned_call(triton_op(name), *args)
        ref_n, ref_s = getattr(fused_ops, name + "_ref")(*args)
        assert torch.equal(summed, ref_s)
        assert rel_err(normed, ref_n) <= TOL
    # Gemma's post-norm: the residual added after the norm
    post = _poisoned_call(triton_op("fused_rms_norm_residual"), x, w, 1e-6, r)
    assert rel_err(post, fused_ops.fused_rms_norm_residual_ref(x, w, 1e-6, r)) <= TOL


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "gpt2", "gemma3"])
@pytest.mark.parametrize("T", [1, 256])
@pytest.mark.parametrize("folded_norm", [False, True], ids=["x", "rms_norm(x)"])
def test_fused_qkv_rope(family, T, dtype, folded_norm):
    if folded_norm and family == "gpt2":
        pytest.skip("GPT-2's LayerNorm is never folded into fused_qkv_rope")
    m = {"qwen2": MODELS["qwen2.5-0.5b"], "qwen3": QWEN3, "llama": MODELS["llama-3.2-1b"], "gpt2": GPT2,
         "gemma3": GEMMA3}[family]
    args = qkv_inputs(T, m["H"], m["Hq"], m["Hkv"], m["D"], dtype, DEV, seed=T,
                      bias=family in ("qwen2", "gpt2"), qk_norm=family in ("qwen3", "gemma3"), rope=family != "gpt2")
    if folded_norm:
        args = (*args, *input_norm(args, seed=T + 1))
    out = _poisoned_call(triton_op("fused_qkv_rope"), *args)
    ref = fused_ops.fused_qkv_rope_ref(*args)
    for o, r in zip(out, ref):
        assert o.shape == r.shape
        assert rel_err(o, r) <= TOL


# ---------------------------------------------------------------------------------------------
# weight-only int8 / int4 kernels (decode forms, and the quantized GEMM past them): equal the
# ops' dequantizing references
# ---------------------------------------------------------------------------------------------

QUANT_SHAPES = {**MODELS, "llama-3.1-8b": dict(H=4096, I=14336, Hq=32, Hkv=8, D=128)}


def _quantized(w, scheme):
    from compiled_llm.graph.quantized_ops import quantize

    return tuple(t.to(DEV) if t is not None else None for t in quantize(w, scheme))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("model", list(QUANT_SHAPES))
@pytest.mark.parametrize("T", [1, 2, 4, 16, 300])
def test_quantized_kernels(model, T, scheme):
    """The o projection + residual, the lm_head-shaped linear, the norm + MLP and q/k/v + RoPE,
    bf16, at real shapes: the decode forms at a few rows (the compiled INT4 forms read each code
    as a denormal float, triton_gemv.int4_codes: a kernel built with denormals flushed would zero
    every product), the quantized GEMM at 16 rows (triton_gemm_wq, tensor cores) and the
    dequantized scratch weight with cuBLAS at 300."""
    from compiled_llm.graph import quantized_ops as qo

    m = QUANT_SHAPES[model]
    dtype = torch.bfloat16
    x, w, _, r = linear_residual_inputs(T, m["Hq"] * m["D"], m["H"], dtype, seed=T)
    q = _quantized(w, scheme)
    out = _poisoned_call(triton_op("fused_linear_residual_wq"), x, *q, None, r)
    ref = qo.fused_linear_residual_wq_ref(x, *q, None, r)
    assert projection_err(out, ref, r) <= TOL
    x, w, _, _ = linear_residual_inputs(T, m["H"], 32_000, dtype, seed=T + 1)
    q = _quantized(w, scheme)
    assert rel_err(_poisoned_call(triton_op("linear_wq"), x, *q), qo.linear_wq_ref(x, *q)) <= TOL
    x, nw, eps, gate_up, down = mlp_glu_inputs(T, m["H"], m["I"], dtype, DEV, seed=T + 2)
    r = residual_like((x,), seed=T + 3)
    args = (x, nw, eps, *_quantized(gate_up, scheme), *_quantized(down, scheme), r)
    out = _poisoned_call(triton_op("fused_rms_norm_glu_mlp_wq"), *args)
    _check_mlp(out, qo.fused_rms_norm_glu_mlp_wq_ref(*args), r)
    geglu = (*args, "gelu_tanh")  # Gemma's GeGLU through the same kernels
    out = _poisoned_call(triton_op("fused_rms_norm_glu_mlp_wq"), *geglu)
    _check_mlp(out, qo.fused_rms_norm_glu_mlp_wq_ref(*geglu), r)
    args = qkv_inputs(T, m["H"], m["Hq"], m["Hkv"], m["D"], dtype, DEV, seed=T + 4, bias=model.startswith("qwen"),
                      qk_norm=False, rope=True)
    qargs = (args[0], *_quantized(args[1], scheme), *args[2:], *input_norm(args, seed=T + 5))
    out = _poisoned_call(triton_op("fused_qkv_rope_wq"), *qargs)
    for o, ref in zip(out, qo.fused_qkv_rope_wq_ref(*qargs)):
        assert rel_err(o, ref) <= TOL


@pytest.mark.parametrize("model", list(QUANT_SHAPES))
@pytest.mark.parametrize("T", [1, 3, 8])
def test_cuda_int4_gemv_equals_the_references(model, T):
    """The tensor-core int4 GEMV (cuda_gemv_int4) at real shapes and a few rows: down + residual
    (the longest K; Triton where x does not fit a block's shared memory), an lm_head-shaped linear
    with a bias and a column count no tile divides, RMSNorm + gate/up + silu * up, then down +
    residual, and RMSNorm + q/k/v (+ bias) + RoPE at scattered positions. It must build here and
    take the calls that fit."""
    from compiled_llm.graph import quantized_ops as qo
    from compiled_llm.kernels import cuda_gemv_int4

    if not cuda_gemv_int4.cuda_extension_ok():
        pytest.fail(f"CUDA int4 GEMV did not build: {cuda_gemv_int4.build_error()}")
    cuda = lambda name: providers.provider_op(name, providers.CUDA)  # noqa: E731
    m = QUANT_SHAPES[model]
    dtype = torch.bfloat16
    x, w, _, r = linear_residual_inputs(T, m["I"], m["H"], dtype, seed=T)  # down: the longest K
    q = _quantized(w, "int4")
    fits = cuda_gemv_int4.shared_memory_bytes(T, m["I"], m["H"]) <= 227 * 1024
    assert cuda_gemv_int4.takes(x, *q, r) == fits  # Llama-3.1-8B's 8 rows of 14,336 do not: Triton
    out = _poisoned_call(cuda("fused_linear_residual_wq"), x, *q, None, r)
    assert projection_err(out, qo.fused_linear_residual_wq_ref(x, *q, None, r), r) <= TOL
    x, w, b, _ = linear_residual_inputs(T, m["H"], 32_008, dtype, seed=T + 1, bias=True)
    q = _quantized(w, "int4")
    assert cuda_gemv_int4.takes(x, *q, b)
    assert rel_err(_poisoned_call(cuda("linear_wq"), x, *q, b), qo.linear_wq_ref(x, *q, b)) <= TOL
    x, nw, eps, gate_up, down = mlp_glu_inputs(T, m["H"], m["I"], dtype, DEV, seed=T + 2)
    r = residual_like((x,), seed=T + 3)
    args = (x, nw, eps, *_quantized(gate_up, "int4"), *_quantized(down, "int4"), r)
    assert cuda_gemv_int4.takes(x, *args[3:6], nw, r, mode="glu")
    _check_mlp(_poisoned_call(cuda("fused_rms_norm_glu_mlp_wq"), *args), qo.fused_rms_norm_glu_mlp_wq_ref(*args), r)
    geglu = (*args, "gelu_tanh")  # the kernel's GLU epilogue is silu's: GeGLU runs Triton's INT4 form
    _check_mlp(_poisoned_call(cuda("fused_rms_norm_glu_mlp_wq"), *geglu), qo.fused_rms_norm_glu_mlp_wq_ref(*geglu), r)
    args = qkv_inputs(T, m["H"], m["Hq"], m["Hkv"], m["D"], dtype, DEV, seed=T + 4, bias=model.startswith("qwen"),
                      qk_norm=False, rope=True)
    qargs = (args[0], *_quantized(args[1], "int4"), *args[2:], *input_norm(args, seed=T + 5))
    x, qw, qs, qz, b, _, _, pos, cs, Hq, Hkv, D, _, nw, neps = qargs
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert cuda_gemv_int4.takes_qkv(x, qw, qs, qz, b, None, pos, cs, D, nw) == (qw.shape[0] // 32 >= sms // 2)
    refs = qo.fused_qkv_rope_wq_ref(*qargs)
    for o, ref in zip(_poisoned_call(cuda("fused_qkv_rope_wq"), *qargs), refs):
        assert o.is_contiguous() and rel_err(o, ref) <= TOL
    # the CUDA form itself, also where the provider leaves the call to Triton (Qwen's bias)
    for o, ref in zip(_poisoned_call(cuda_gemv_int4.qkv_int4, x, qw, qs, qz, b, nw, neps, pos, cs, Hq, Hkv, D), refs):
        assert o.is_contiguous() and rel_err(o, ref) <= TOL


def test_cuda_int4_provider_hands_other_calls_to_triton():
    """int8 weights, more rows than the mma's 8 and fp16 x run the Triton kernels, correctly; so
    does q/k/v with Qwen3's per-head q/k norm."""
    from compiled_llm.graph import quantized_ops as qo
    from compiled_llm.kernels import cuda_gemv_int4

    op = providers.provider_op("fused_linear_residual_wq", providers.CUDA)
    for T, scheme, dtype in ((1, "int8", torch.bfloat16), (16, "int4", torch.bfloat16), (1, "int4", torch.float16)):
        x, w, _, r = linear_residual_inputs(T, 2048, 2048, dtype, seed=T)
        q = _quantized(w, scheme)
        assert not cuda_gemv_int4.takes(x, *q, r)
        out = _poisoned_call(op, x, *q, None, r)
        assert projection_err(out, qo.fused_linear_residual_wq_ref(x, *q, None, r), r) <= TOL
    args = qkv_inputs(1, 1024, 16, 8, 128, torch.bfloat16, DEV, seed=5, bias=False, qk_norm=True, rope=True)
    qargs = (args[0], *_quantized(args[1], "int4"), *args[2:], *input_norm(args, seed=6))
    assert not cuda_gemv_int4.takes_qkv(*qargs[:5], qargs[5], qargs[7], qargs[8], 128, qargs[13])
    out = _poisoned_call(providers.provider_op("fused_qkv_rope_wq", providers.CUDA), *qargs)
    for o, ref in zip(out, qo.fused_qkv_rope_wq_ref(*qargs)):
        assert rel_err(o, ref) <= TOL


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_dequantize_kernel_writes_exactly_the_reference_weight(scheme):
    """The scratch weight that prefill-sized quantized matmuls hand cuBLAS (triton_gemm_wq):
    bit for bit the reference's bf16 weight, at Llama-3.1-8B's down projection."""
    from compiled_llm.graph.quantized_ops import dequantize
    from compiled_llm.kernels import triton_gemm_wq

    w = torch.randn(4096, 14336, generator=torch.Generator().manual_seed(9)).to(DEV) * 0.02
    q = _quantized(w, scheme)
    assert torch.equal(triton_gemm_wq.dequantize(*q, torch.bfloat16), dequantize(*q, torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding(dtype):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(300, 14, 64, generator=g).to(DEV, dtype)
    k = torch.randn(300, 2, 64, generator=g).to(DEV, dtype)
    pos = torch.randint(0, 4096, (300,), generator=g).to(DEV)
    cs = ops.rope_cos_sin(64, 4096, 1e6).to(DEV)
    for o, r in zip(_poisoned_call(triton_op("rotary_embedding"), q, k, pos, cs), ops.rotary_embedding(q, k, pos, cs)):
        assert rel_err(o, r) <= TOL


# ---------------------------------------------------------------------------------------------
# o projection + residual add
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("T", [1, 2, 4, 16, 300])
def test_fused_linear_residual(model, T, dtype):
    m = MODELS[model]
    args = linear_residual_inputs(T, m["Hq"] * m["D"], m["H"], dtype, seed=T)
    out = _poisoned_call(triton_op("fused_linear_residual"), *args)
    ref = fused_ops.fused_linear_residual_ref(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) <= TOL
    assert projection_err(out, ref, args[3]) <= TOL


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5, 300])
def test_fused_linear_residual_with_bias(T, dtype):
    """GPT-2's o projection carries a bias."""
    args = linear_residual_inputs(T, GPT2["Hq"] * GPT2["D"], GPT2["H"], dtype, seed=T, bias=True)
    out = _poisoned_call(triton_op("fused_linear_residual"), *args)
    ref = fused_ops.fused_linear_residual_ref(*args)
    assert rel_err(out, ref) <= TOL and projection_err(out, ref, args[3]) <= TOL


# ---------------------------------------------------------------------------------------------
# norm + MLP: Triton decode and prefill forms, CUDA C++; with and without the residual add
# ---------------------------------------------------------------------------------------------


def _check_mlp(out, ref, residual):
    assert rel_err(out, ref) <= TOL
    if residual is not None:
        assert projection_err(out, ref, residual) <= TOL


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("T,form", [(1, "decode"), (4, "decode"), (16, "decode"), (64, "decode"),
                                    (1, "prefill"), (300, "prefill")])
@pytest.mark.parametrize("with_residual", [False, True], ids=["mlp", "mlp+residual"])
def test_rms_norm_glu_mlp_triton(model, T, form, dtype, with_residual):
    m = MODELS[model]
    args = mlp_glu_inputs(T, m["H"], m["I"], dtype, DEV, seed=T)
    r = residual_like(args, seed=T + 1) if with_residual else None
    out = _poisoned_call(triton_norm_mlp.fused_rms_norm_glu_mlp, *args, form=form, residual=r)
    _check_mlp(out, fused_ops.fused_rms_norm_glu_mlp_ref(*args, residual=r), r)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,form", [(1, "decode"), (4, "decode"), (16, "decode"), (1, "prefill"), (300, "prefill")])
@pytest.mark.parametrize("with_residual", [False, True], ids=["mlp", "mlp+residual"])
def test_rms_norm_geglu_mlp_triton(T, form, dtype, with_residual):
    """Gemma 3's GeGLU (activation="gelu_tanh") through the SwiGLU kernels' every form, as the
    graph calls it (the provider op, residual and activation positional)."""
    args = mlp_glu_inputs(T, GEMMA3["H"], GEMMA3["I"], dtype, DEV, seed=T)
    r = residual_like(args, seed=T + 1) if with_residual else None
    out = _poisoned_call(triton_norm_mlp.fused_rms_norm_glu_mlp, *args, r, "gelu_tanh", form=form)
    _check_mlp(out, fused_ops.fused_rms_norm_glu_mlp_ref(*args, r, "gelu_tanh"), r)
    out = _poisoned_call(triton_op("fused_rms_norm_glu_mlp"), *args, r, "gelu_tanh")  # its form picked by T
    _check_mlp(out, fused_ops.fused_rms_norm_glu_mlp_ref(*args, r, "gelu_tanh"), r)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,form", [(1, "decode"), (9, "decode"), (200, "prefill")])
@pytest.mark.parametrize("with_residual", [False, True], ids=["mlp", "mlp+residual"])
def test_layer_norm_gelu_mlp_triton(T, form, dtype, with_residual):
    args = mlp_gelu_inputs(T, GPT2["H"], GPT2["I"], dtype, DEV, seed=T)
    r = residual_like(args, seed=T + 1) if with_residual else None
    out = _poisoned_call(triton_norm_mlp.fused_layer_norm_gelu_mlp, *args, form=form, residual=r)
    _check_mlp(out, fused_ops.fused_layer_norm_gelu_mlp_ref(*args, residual=r), r)


@pytest.mark.parametrize("name", ["fused_rms_norm_glu_mlp", "fused_layer_norm_gelu_mlp"])
@pytest.mark.parametrize("T", [1, 300])
def test_triton_mlp_providers_pass_the_residual(name, T):
    """The provider ops (what the graph calls) forward their residual to the kernels."""
    m = MODELS["qwen2.5-0.5b"] if "glu" in name else GPT2
    inputs = mlp_glu_inputs if "glu" in name else mlp_gelu_inputs
    args = inputs(T, m["H"], m["I"], torch.bfloat16, DEV, seed=T)
    r = residual_like(args, seed=T + 2)
    out = _poisoned_call(triton_op(name), *args, r)
    _check_mlp(out, getattr(fused_ops, name + "_ref")(*args, r), r)


def _cuda_ext():
    if not cuda_norm_mlp.cuda_extension_ok():
        pytest.fail(f"CUDA norm+MLP extension did not build: {cuda_norm_mlp.build_error()}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("T", [1, 3, 8, 40])  # 40 rows: the provider's matmul path
@pytest.mark.parametrize("with_residual", [False, True], ids=["mlp", "mlp+residual"])
def test_rms_norm_glu_mlp_cuda(model, T, dtype, with_residual):
    _cuda_ext()
    m = MODELS[model]
    args = mlp_glu_inputs(T, m["H"], m["I"], dtype, DEV, seed=T)
    r = residual_like(args, seed=T + 1) if with_residual else None
    out = _poisoned_call(providers.provider_op("fused_rms_norm_glu_mlp", providers.CUDA), *args, r)
    _check_mlp(out, fused_ops.fused_rms_norm_glu_mlp_ref(*args, r), r)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 8, 40])  # 40 rows: the provider's matmul path
@pytest.mark.parametrize("with_residual", [False, True], ids=["mlp", "mlp+residual"])
def test_rms_norm_geglu_mlp_cuda(T, dtype, with_residual):
    """Gemma 3's GeGLU through the CUDA gate/up kernel's gelu_tanh form."""
    _cuda_ext()
    args = mlp_glu_inputs(T, GEMMA3["H"], GEMMA3["I"], dtype, DEV, seed=T)
    r = residual_like(args, seed=T + 1) if with_residual else None
    out = _poisoned_call(providers.provider_op("fused_rms_norm_glu_mlp", providers.CUDA), *args, r, "gelu_tanh")
    _check_mlp(out, fused_ops.fused_rms_norm_glu_mlp_ref(*args, r, "gelu_tanh"), r)


def test_cuda_geglu_rounds_as_the_triton_kernel_does():
    """Both decode kernels round gate, up, gelu(gate) and the product where torch does: their
    activations agree to an ulp or two of bf16 (sums in different orders), far closer than
    either is to silu's."""
    _cuda_ext()
    x, nw, eps, gate_up, _ = mlp_glu_inputs(4, GEMMA3["H"], GEMMA3["I"], torch.bfloat16, DEV, seed=31)
    ext = cuda_norm_mlp.extension()
    n = ext.cllm_norm(x, nw, None, eps)
    cuda = ext.cllm_gate_up_act(n, gate_up, None, True, True)
    tri = triton_norm_mlp.decode_activation(x, nw, None, eps, gate_up, None, True, True, activation="gelu_tanh")
    silu = ext.cllm_gate_up_act(n, gate_up, None, True, False)
    assert rel_err(cuda, tri) <= 1e-2 < rel_err(silu, tri)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 8, 40])
@pytest.mark.parametrize("with_residual", [False, True], ids=["mlp", "mlp+residual"])
def test_layer_norm_gelu_mlp_cuda(T, dtype, with_residual):
    _cuda_ext()
    args = mlp_gelu_inputs(T, GPT2["H"], GPT2["I"], dtype, DEV, seed=T)
    r = residual_like(args, seed=T + 1) if with_residual else None
    out = _poisoned_call(providers.provider_op("fused_layer_norm_gelu_mlp", providers.CUDA), *args, r)
    _check_mlp(out, fused_ops.fused_layer_norm_gelu_mlp_ref(*args, r), r)


# ---------------------------------------------------------------------------------------------
# CUDA-graph capture of the decode path
# ---------------------------------------------------------------------------------------------


def _capture_and_replay(fn, static_args, new_args):
    """Capture fn(*static_args) in a CUDA graph, copy new_args into the static tensors, replay;
    returns the graph's outputs (as the runtime would see them)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up outside the capture (first calls compile the kernels)
            fn(*static_args)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn(*static_args)
    for dst, src in zip(static_args, new_args):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    return outs


def test_decode_attention_replays_in_cuda_graph():
    m = MODELS["qwen2.5-0.5b"]
    cfg = dict(num_heads=m["Hq"], num_kv_heads=m["Hkv"], head_dim=m["D"], block_size=16, dtype=torch.bfloat16,
               device=DEV, max_blocks=128)
    first = attention_case([(40, 1), (900, 1), (0, 1)], seed=5, pad_rows=1, **cfg)
    # same bucket (4 rows), other contexts and slots; same number of cache blocks
    second = attention_case([(1500, 1), (3, 1), (77, 1)], seed=6, pad_rows=1, extra_blocks=0, **cfg)
    nb = max(first.kv_cache.shape[1], second.kv_cache.shape[1])
    pad = lambda c: torch.nn.functional.pad(c, (0, 0, 0, 0, 0, 0, 0, nb - c.shape[1]), value=float("nan"))  # noqa: E731
    static = list(first.args(pad(first.kv_cache)))
    new = list(second.args(pad(second.kv_cache)))
    out = _capture_and_replay(triton_op("paged_attention"), static, new)
    ref_cache = pad(second.kv_cache)
    ref = ops.paged_attention(*new[:3], ref_cache, *new[4:])
    assert rel_err(out, ref) <= TOL
    assert torch.equal(static[3].nan_to_num(7.0), ref_cache.nan_to_num(7.0))
    assert out[-1].abs().sum() == 0


@pytest.mark.parametrize("provider", ["triton", "cuda"])
def test_decode_mlp_replays_in_cuda_graph(provider):
    """As the graph calls it: with the residual stream added."""
    if provider == "cuda":
        _cuda_ext()
    m = MODELS["qwen2.5-0.5b"]
    first = mlp_glu_inputs(4, m["H"], m["I"], torch.bfloat16, DEV, seed=7)
    second = mlp_glu_inputs(4, m["H"], m["I"], torch.bfloat16, DEV, seed=8)
    static = [*first, residual_like(first, seed=70)]
    new = [*second, residual_like(second, seed=80)]
    out = _capture_and_replay(providers.provider_op("fused_rms_norm_glu_mlp", provider), static, new)
    _check_mlp(out, fused_ops.fused_rms_norm_glu_mlp_ref(*new), new[-1])


def test_decode_linear_residual_replays_in_cuda_graph():
    m = MODELS["qwen2.5-0.5b"]
    static = list(linear_residual_inputs(4, m["Hq"] * m["D"], m["H"], torch.bfloat16, seed=20))
    new = linear_residual_inputs(4, m["Hq"] * m["D"], m["H"], torch.bfloat16, seed=21)
    out = _capture_and_replay(triton_op("fused_linear_residual"), static, new)
    ref = fused_ops.fused_linear_residual_ref(*new)
    assert rel_err(out, ref) <= TOL and projection_err(out, ref, new[3]) <= TOL


def test_decode_norm_and_qkv_replay_in_cuda_graph():
    """fused_qkv_rope as the graph calls it, with the layer's input RMSNorm folded in."""
    m = QWEN3
    first = qkv_inputs(8, m["H"], m["Hq"], m["Hkv"], m["D"], torch.bfloat16, DEV, 9, False, True, True)
    second = qkv_inputs(8, m["H"], m["Hq"], m["Hkv"], m["D"], torch.bfloat16, DEV, 10, False, True, True)
    static = [*first, *input_norm(first, seed=90)]
    new = (*second, *input_norm(second, seed=100))
    outs = _capture_and_replay(triton_op("fused_qkv_rope"), static, new)
    for o, r in zip(outs, fused_ops.fused_qkv_rope_ref(*new)):
        assert rel_err(o, r) <= TOL
    g = torch.Generator().manual_seed(11)
    static = [torch.randn(8, 896, generator=g).to(DEV, torch.bfloat16) for _ in range(3)] + [1e-6]
    new = [torch.randn(8, 896, generator=g).to(DEV, torch.bfloat16) for _ in range(3)] + [1e-6]
    static[2], new[2] = static[2][0], new[2][0]  # weight [H]
    normed, summed = _capture_and_replay(triton_op("fused_add_rms_norm"), static, new)
    ref_n, ref_s = fused_ops.fused_add_rms_norm_ref(*new)
    assert torch.equal(summed, ref_s) and rel_err(normed, ref_n) <= TOL


# ---------------------------------------------------------------------------------------------
# the grammar bitmask of structured output, at Qwen2.5's vocabulary
# ---------------------------------------------------------------------------------------------

QWEN_LOGITS, QWEN_TOKENIZER = 151936, 151665  # the model's padded vocabulary, the tokenizer's


def _qwen_bitmask(gen, rows: int, vocab: int) -> torch.Tensor:
    """Random words; from three rows on, row 1 all -1 and row 2 allowing token 227 alone."""
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), generator=gen, dtype=torch.int32)
    if rows >= 3:
        bitmask[1] = -1
        bitmask[2] = 0
        bitmask[2, 7] = 1 << 3
    return bitmask.to(DEV)


@pytest.mark.parametrize("mask_vocab", [QWEN_LOGITS, QWEN_TOKENIZER], ids=["model's", "tokenizer's"])
def test_token_bitmask_kernel_equals_the_reference_on_bf16_rows(mask_vocab):
    """[4, 151936] bf16 logits, masks of the model's vocabulary and of the tokenizer's (narrower:
    the padding tokens are disallowed in every row, the all -1 one's included)."""
    from compiled_llm.kernels import triton_bitmask

    gen = torch.Generator().manual_seed(40)
    logits = _rnd(gen, 4, QWEN_LOGITS, dtype=torch.bfloat16)
    bitmask = _qwen_bitmask(gen, 4, mask_vocab)
    want, got = logits.clone(), logits.clone()
    ops.apply_token_bitmask_ref(want, bitmask)
    triton_bitmask.apply_token_bitmask(got, bitmask)
    assert torch.equal(got, want)
    assert torch.isfinite(got[2]).nonzero().flatten().tolist() == [7 * 32 + 3]
    if mask_vocab == QWEN_LOGITS:
        assert torch.equal(got[1], logits[1])
    else:
        assert torch.isneginf(got[:, 32 * bitmask.shape[1]:]).all()


def test_token_bitmask_kernel_compiles_once_for_every_batch_size_and_mask_width():
    """One compiled kernel a dtype: the rows, the vocabulary and the mask width change nothing
    (what lets the build's warm-up compile it once)."""
    from compiled_llm.kernels import triton_bitmask

    kernel = triton_bitmask._bitmask_kernel
    gen = torch.Generator().manual_seed(41)
    variants = lambda: sum(len(cache[0]) for cache in kernel.device_caches.values())  # noqa: E731
    triton_bitmask.apply_token_bitmask(_rnd(gen, 1, QWEN_LOGITS, dtype=torch.bfloat16), _qwen_bitmask(gen, 1, 32))
    compiled = variants()
    for rows, vocab, mask_vocab in ((3, QWEN_LOGITS, QWEN_TOKENIZER), (16, QWEN_LOGITS, QWEN_LOGITS),
                                    (17, 32000, 32000), (512, QWEN_LOGITS, QWEN_LOGITS)):
        logits = _rnd(gen, rows, vocab, dtype=torch.bfloat16)
        want = logits.clone()
        bitmask = _qwen_bitmask(gen, rows, mask_vocab)
        ops.apply_token_bitmask_ref(want, bitmask)
        triton_bitmask.apply_token_bitmask(logits, bitmask)
        assert torch.equal(logits, want), rows
    assert variants() == compiled


# ---------------------------------------------------------------------------------------------
# opcheck of every provider op on the GPU
# ---------------------------------------------------------------------------------------------


def _gpu_opcheck_cases():
    bf = torch.bfloat16
    g = torch.Generator().manual_seed(12)
    x, r = (torch.randn(5, 256, generator=g).to(DEV, bf) for _ in range(2))
    w, b = (torch.randn(256, generator=g).to(DEV, bf) for _ in range(2))
    q, k = torch.randn(5, 4, 64, generator=g).to(DEV, bf), torch.randn(5, 2, 64, generator=g).to(DEV, bf)
    pos, cs = torch.tensor([1, 0, 5, 9, 2], device=DEV), ops.rope_cos_sin(64, 16, 10000.0).to(DEV)
    prefill = attention_case([(0, 20), (30, 9)], 4, 2, 64, 16, bf, DEV, seed=13)
    decode = attention_case([(30, 1), (0, 1)], 4, 2, 64, 16, bf, DEV, seed=14, pad_rows=1)
    qkv_ns = qkv_inputs(1, 256, 4, 2, 64, bf, DEV, 20, False, False, True, max_pos=16)  # Llama-like decode
    glu, gelu = mlp_glu_inputs(1, 256, 512, bf, DEV, 21), mlp_gelu_inputs(3, 256, 512, bf, DEV, 29)
    mask_words = torch.randint(-2**31, 2**31 - 1, (3, 282), generator=g, dtype=torch.int32).to(DEV)
    return {
        "rms_norm/triton": (x, w, 1e-6),
        "layer_norm/triton": (x, w, b, 1e-5),
        "fused_add_rms_norm/triton": (x, r, w, 1e-6),
        "fused_add_layer_norm/triton": (x, r, w, b, 1e-5),
        "fused_rms_norm_residual/triton": (x, w, 1e-6, r),
        "rotary_embedding/triton": (q, k, pos, cs),
        "fused_qkv_rope/triton": qkv_inputs(5, 256, 4, 2, 64, bf, DEV, 15, True, True, True, max_pos=16),
        "fused_qkv_rope/triton/input_norm": (*qkv_ns, *input_norm(qkv_ns, seed=24)),
        "fused_linear_residual/triton": linear_residual_inputs(5, 256, 192, bf, seed=22),
        "fused_linear_residual/triton/bias": linear_residual_inputs(1, 256, 192, bf, seed=23, bias=True),
        "fused_rms_norm_glu_mlp/triton": mlp_glu_inputs(5, 256, 512, bf, DEV, 16),
        "fused_rms_norm_glu_mlp/triton/residual": (*glu, residual_like(glu, seed=25)),
        "fused_layer_norm_gelu_mlp/triton": mlp_gelu_inputs(5, 256, 512, bf, DEV, 17),
        "fused_layer_norm_gelu_mlp/triton/residual": (*gelu, residual_like(gelu, seed=26)),
        "paged_attention/triton": prefill.args(prefill.kv_cache.nan_to_num(0.0)),
        "paged_attention/triton/decode": decode.args(decode.kv_cache.nan_to_num(0.0)),
        "fused_rms_norm_glu_mlp/cuda": mlp_glu_inputs(5, 256, 512, bf, DEV, 18),
        "fused_rms_norm_glu_mlp/cuda/residual": (*glu, residual_like(glu, seed=27)),
        "fused_rms_norm_glu_mlp/triton/geglu": (*glu, residual_like(glu, seed=30), "gelu_tanh"),
        "fused_rms_norm_glu_mlp/cuda/geglu": (*glu, residual_like(glu, seed=30), "gelu_tanh"),
        "fused_layer_norm_gelu_mlp/cuda": mlp_gelu_inputs(5, 256, 512, bf, DEV, 19),
        "fused_layer_norm_gelu_mlp/cuda/residual": (*gelu, residual_like(gelu, seed=28)),
        "apply_token_bitmask/triton": (torch.randn(3, 9000, generator=g).to(DEV, bf), mask_words),
    }


OPCHECK_IDS = [
    "rms_norm/triton", "layer_norm/triton", "fused_add_rms_norm/triton", "fused_add_layer_norm/triton",
    "fused_rms_norm_residual/triton",
    "rotary_embedding/triton", "fused_qkv_rope/triton", "fused_qkv_rope/triton/input_norm",
    "fused_linear_residual/triton", "fused_linear_residual/triton/bias",
    "fused_rms_norm_glu_mlp/triton", "fused_rms_norm_glu_mlp/triton/residual",
    "fused_layer_norm_gelu_mlp/triton", "fused_layer_norm_gelu_mlp/triton/residual",
    "paged_attention/triton", "paged_attention/triton/decode",
    "fused_rms_norm_glu_mlp/cuda", "fused_rms_norm_glu_mlp/cuda/residual",
    "fused_rms_norm_glu_mlp/triton/geglu", "fused_rms_norm_glu_mlp/cuda/geglu",
    "fused_layer_norm_gelu_mlp/cuda", "fused_layer_norm_gelu_mlp/cuda/residual",
    "apply_token_bitmask/triton",
]


@pytest.mark.parametrize("case", OPCHECK_IDS)
def test_opcheck_provider_ops_on_gpu(case):
    name, provider = case.split("/")[:2]
    if provider == "cuda":
        _cuda_ext()
    torch.library.opcheck(providers.provider_op(name, provider), _gpu_opcheck_cases()[case])
