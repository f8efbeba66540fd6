"""Provider registration, launch-config tables, opcheck of the reference ops and what their
optional epilogue/prologue arguments compute (CPU, no kernel runs here: the Triton kernels are
exercised by test_kernels_interpret.py and the GPU tests; the providers' shape fallbacks to the
reference do run here)."""

import inspect
import json

import pytest
import torch
import torch.nn.functional as F

from compiled_llm.errors import CompiledLLMError
from compiled_llm.graph import fused_ops, ops
from compiled_llm.kernels import cuda_build, cuda_gemv_int4, cuda_norm_mlp, launch_configs, registry
from helpers.kernel_inputs import attention_case, mlp_gelu_inputs, mlp_glu_inputs, qkv_inputs

triton = pytest.importorskip("triton")
from compiled_llm.kernels import providers  # noqa: E402


def _schema_tail(op) -> str:
    """The schema after the op's name: arguments, mutations and returns."""
    return str(op.default._schema).split("(", 1)[1]


@pytest.mark.parametrize("name", [*providers.TRITON_KERNELS, *providers.SAMPLER_KERNELS])
def test_triton_provider_has_the_semantic_schema_and_is_registered(name):
    assert _schema_tail(providers.provider_op(name, "triton")) == _schema_tail(getattr(torch.ops.cllm, name))
    p = registry.get_provider(name, "triton")
    assert p.overload.name() == f"cllm::{name}__triton"
    assert p.supports("cuda", torch.bfloat16) and p.supports("cuda", torch.float32)
    assert not p.supports("cpu", torch.float32)


@pytest.mark.parametrize("name", list(providers.CUDA_KERNELS))
def test_cuda_provider_has_the_semantic_schema_and_ranks_below_triton(name):
    assert _schema_tail(providers.provider_op(name, "cuda")) == _schema_tail(getattr(torch.ops.cllm, name))
    names = [p.name for p in registry.providers(name)]
    assert names.index("triton") < names.index("cuda") < names.index("reference")
    cuda = registry.get_provider(name, "cuda")
    assert not cuda.supports("cpu", torch.bfloat16)
    assert not cuda.supports("cuda", torch.float32)  # the CUDA kernels are 16-bit only


# these references are their implementation (torch.distributed, and the lookup beside it); the
# all-reduce has a kernel (custom push kernel over symmetric memory), which falls back to its reference
TORCH_DISTRIBUTED_ONLY = {"all_gather_columns", "vocab_shard_embedding"}


def test_every_op_but_the_gather_and_the_lookup_has_a_triton_provider():
    assert {*providers.TRITON_KERNELS, *providers.SAMPLER_KERNELS} == set(ops.OPS) - TORCH_DISTRIBUTED_ONLY
    assert set(ops.OPS) == set(registry.op_names())


def test_default_choice_is_triton_on_cuda_and_reference_on_cpu():
    """...but the int4 decode GEMV's three ops get its CUDA provider where it can be built."""
    cuda = registry.choose_providers("cuda", torch.bfloat16)
    int4_ops = set(providers.CUDA_INT4_KERNELS)
    assert {p for op, p in cuda.items() if op not in TORCH_DISTRIBUTED_ONLY | int4_ops} == {"triton"}
    assert {cuda[op] for op in int4_ops} == {"cuda" if cuda_build.toolchain_available() else "triton"}
    assert {cuda[op] for op in TORCH_DISTRIBUTED_ONLY} == {"reference"}
    assert set(registry.choose_providers("cpu", torch.float32).values()) == {"reference"}


def test_sampler_kernels_are_chosen_through_the_registry():
    """The sampler's ops get the provider choose_providers would: the Triton kernels on CUDA,
    the torch references on the CPU (called as plain functions, no dispatcher)."""
    assert registry.kernel_for("greedy_sample", "cuda", torch.bfloat16) is providers.triton_sampling.greedy_argmax
    assert registry.kernel_for("temperature_sample", "cuda", torch.float32) is providers.triton_sampling.gumbel_sample
    assert registry.kernel_for("greedy_sample", "cpu", torch.float32) is ops.greedy_sample_ref
    assert registry.kernel_for("temperature_sample", "cpu", torch.bfloat16) is ops.temperature_sample_ref
    bitmask = providers.triton_bitmask.apply_token_bitmask
    assert registry.kernel_for("apply_token_bitmask", "cuda", torch.bfloat16) is bitmask
    assert registry.kernel_for("apply_token_bitmask", "cpu", torch.float32) is ops.apply_token_bitmask_ref


def test_provider_ops_take_the_semantic_fake():
    """A provider op traces like its semantic op: same fake, so the same output metadata."""
    x, w = torch.randn(3, 32), torch.randn(32)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(w)
        got = providers.provider_op("rms_norm", "triton")(fx, fw, 1e-6)
        want = torch.ops.cllm.rms_norm(fx, fw, 1e-6)
    assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())


def test_register_kernel_sends_what_the_kernel_does_not_handle_to_the_reference():
    """handles() gets the op arguments its parameters name; a kernel registered twice only comes
    back into the registry; a handles() reading a defaulted argument is refused."""
    calls = []

    def kernel(x, weight, eps):
        calls.append(x.shape)
        return ops.rms_norm_ref(x, weight, eps) + 1

    def wide(x):
        return x.shape[-1] >= 16

    try:
        p = registry.register_kernel("rms_norm", "test_handles", kernel, supports=lambda d, t: False, handles=wide)
        w16, w8 = torch.ones(16), torch.ones(8)
        x16, x8 = torch.randn(2, 16), torch.randn(2, 8)
        assert torch.equal(p.overload(x16, w16, 1e-6), ops.rms_norm_ref(x16, w16, 1e-6) + 1)
        assert torch.equal(p.fn(x8, w8, 1e-6), ops.rms_norm_ref(x8, w8, 1e-6))
        assert calls == [(2, 16)]
        assert registry.direct_calls()[p.overload] is p.fn
        registry.unregister_provider("rms_norm", "test_handles")
        assert p.overload not in registry.direct_calls()
        again = registry.register_kernel("rms_norm", "test_handles", kernel, supports=lambda d, t: False, handles=wide)
        assert again.overload is p.overload and again.fn is p.fn
        with pytest.raises(CompiledLLMError, match="another kernel"):
            registry.register_kernel("rms_norm", "test_handles", kernel, supports=lambda d, t: False)
    finally:
        registry.unregister_provider("rms_norm", "test_handles")
    with pytest.raises(CompiledLLMError, match="norm_eps"):
        registry.register_kernel("fused_qkv_rope", "test_bad", kernel, supports=lambda d, t: False,
                                 handles=lambda norm_eps: True)
    with pytest.raises(CompiledLLMError, match="no semantic op"):
        registry.register_kernel("no_such_op", "test_bad", kernel, supports=lambda d, t: False)


def test_cuda_extensions_report_why_they_cannot_build_on_a_cpu_torch():
    if torch.version.cuda is not None:
        pytest.skip("CUDA torch: the GPU tests build the extensions")
    assert not cuda_build.toolchain_available()
    for ext in (cuda_norm_mlp, cuda_gemv_int4):
        assert ext.extension() is None and not ext.cuda_extension_ok()
        assert "toolchain" in ext.build_error()


def test_cuda_int4_gemv_takes_only_bf16_int4_calls_of_a_few_rows():
    """What the tensor-core GEMV takes is decided on the arguments alone, before any build; the
    rest run Triton. (On a CPU torch it takes nothing: no extension.)"""
    from compiled_llm.graph.quantized_ops import quantize

    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(3))
    int4, int8 = quantize(w, "int4"), quantize(w, "int8")
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    assert not cuda_gemv_int4.takes(x, *int8)
    assert not cuda_gemv_int4.takes(x, *int4)  # on the CPU
    assert cuda_gemv_int4.launch_shape(128256, 2048) == (1, 2)  # the 1B's lm_head: 16 groups
    assert cuda_gemv_int4.launch_shape(128256, 4096) == (1, 4)
    assert cuda_gemv_int4.launch_shape(4096, 14336) == (2, 8)
    assert cuda_gemv_int4.launch_shape(2 * 8192, 2048, "glu") == (1, 4)
    assert cuda_gemv_int4.launch_shape(6144, 4096, "qkv") == (1, 8)  # a block: 16 rows and their RoPE pairs


# ---------------------------------------------------------------------------------------------
# launch configs
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_configs():
    launch_configs.use_configs(None)
    yield
    launch_configs.use_configs(None)


def test_launch_config_buckets_pick_the_smallest_bucket_holding_T(fresh_configs):
    table = launch_configs.DEFAULT_CONFIGS["norm_mlp_decode"]
    assert set(table) == {"1", "2", "4", "8", "inf", "shapes"}
    assert launch_configs.get("norm_mlp_decode", 1) == table["1"]
    assert launch_configs.get("norm_mlp_decode", 3) == table["4"]
    assert launch_configs.get("norm_mlp_decode", 4) == table["4"]
    assert launch_configs.get("norm_mlp_decode", 5) == table["8"]
    assert launch_configs.get("norm_mlp_decode", 9) == table["inf"]


def test_a_weight_shape_with_its_own_buckets_takes_them_where_they_hold_T(fresh_configs):
    launch_configs.use_configs({"gemv": {
        "1": {"BLOCK_K": 1024}, "inf": {"BLOCK_K": 512},
        "shapes": {"4096x2048": {"1": {"BLOCK_K": 2048}}, "64x64": {"8": {"BLOCK_K": 64}}},
    }})
    assert launch_configs.get("gemv", 1, shape=(4096, 2048)) == {"BLOCK_K": 2048}
    assert launch_configs.get("gemv", 2, shape=(4096, 2048)) == {"BLOCK_K": 512}  # no shape bucket holds 2
    assert launch_configs.get("gemv", 1, shape=(2048, 4096)) == {"BLOCK_K": 1024}  # rows x columns, not swapped
    assert launch_configs.get("gemv", 1) == {"BLOCK_K": 1024}  # no shape given
    assert launch_configs.get("gemv", 5, shape=(64, 64)) == {"BLOCK_K": 64}
    assert launch_configs.get("gemv", 9, shape=(64, 64)) == {"BLOCK_K": 512}


def test_shipped_shape_buckets_leave_other_models_on_the_general_ones(fresh_configs):
    """Llama-3.1-8B at TP=2 has its own batch-1 MLP and q/k/v configs; the same kernels at TP=1
    and the sub-2B shapes keep the general table's."""
    table = launch_configs.DEFAULT_CONFIGS
    tp2_gate_up, tp2_down, tp2_qkv = (2 * 7168, 4096), (4096, 7168), ((16 + 2 * 4) * 128, 4096)
    assert launch_configs.get("norm_mlp_decode", 1, shape=tp2_gate_up) == table["norm_mlp_decode"]["shapes"]["14336x4096"]["1"]
    assert launch_configs.get("norm_mlp_down", 1, shape=tp2_down) == table["norm_mlp_down"]["shapes"]["4096x7168"]["1"]
    assert launch_configs.get("qkv_decode", 1, shape=tp2_qkv) == table["qkv_decode"]["shapes"]["3072x4096"]["1"]
    assert launch_configs.get("norm_mlp_decode", 1, shape=tp2_gate_up) != table["norm_mlp_decode"]["1"]
    assert launch_configs.get("qkv_decode", 1, shape=tp2_qkv) != table["qkv_decode"]["1"]
    # 8B at TP=1, Qwen2.5-0.5B, Llama-3.2-1B: (gate + up, down, q + k + v) weight shapes
    for gate_up, down, qkv in (((2 * 14336, 4096), (4096, 14336), ((32 + 2 * 8) * 128, 4096)),
                               ((2 * 4864, 896), (896, 4864), ((14 + 2 * 2) * 64, 896)),
                               ((2 * 8192, 2048), (2048, 8192), ((32 + 2 * 8) * 64, 2048))):
        assert launch_configs.get("norm_mlp_decode", 1, shape=gate_up) == table["norm_mlp_decode"]["1"]
        assert launch_configs.get("norm_mlp_down", 1, shape=down) == table["norm_mlp_down"]["1"]
        assert launch_configs.get("qkv_decode", 1, shape=qkv) == table["qkv_decode"]["1"]


def test_launch_configs_round_trip_through_json_and_override(fresh_configs):
    stored = json.loads(launch_configs.to_json())
    assert stored == launch_configs.DEFAULT_CONFIGS
    launch_configs.use_configs({"paged_attention_prefill": {"inf": {"BLOCK_M": 32, "BLOCK_N": 32,
                                                                    "num_warps": 4, "num_stages": 1}}})
    assert launch_configs.get("paged_attention_prefill", 100)["BLOCK_M"] == 32
    assert launch_configs.get("norm_mlp_decode", 1) == stored["norm_mlp_decode"]["1"]  # others kept
    launch_configs.use_configs(stored)
    assert launch_configs.current() == launch_configs.DEFAULT_CONFIGS


@pytest.mark.parametrize("bad", [
    {"no_such_kernel": {"inf": {}}},
    {"norm": {"16": {"MAX_WARPS": 4}}},  # no catch-all bucket
    {"norm": {"inf": {"MAX_WARPS": -1}}},
    {"norm": {"big": {"MAX_WARPS": 4}, "inf": {"MAX_WARPS": 4}}},
    {"gemv": {"inf": {"BLOCK_K": 512}, "shapes": {"4096": {"1": {"BLOCK_K": 512}}}}},  # not NxK
    {"gemv": {"inf": {"BLOCK_K": 512}, "shapes": {"8x8": {"one": {"BLOCK_K": 512}}}}},
    {"gemv": {"inf": {"BLOCK_K": 512}, "shapes": {"8x8": {"1": {"BLOCK_K": 0}}}}},
    {"gemv": {"inf": {"BLOCK_K": 512}, "shapes": [1, 2]}},
])
def test_invalid_launch_configs_are_refused(bad, fresh_configs):
    with pytest.raises(CompiledLLMError):
        launch_configs.use_configs(bad)


# ---------------------------------------------------------------------------------------------
# opcheck of the reference (semantic and fused) ops on the CPU
# ---------------------------------------------------------------------------------------------


def _linear_residual_inputs(T, K, N, bias, seed, dtype=torch.float32):
    """(x [T, K], weight [N, K], bias [N] or None, residual [T, N])."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(T, K, generator=g), torch.randn(N, K, generator=g) * K ** -0.5
    b, r = torch.randn(N, generator=g), torch.randn(T, N, generator=g)
    return x.to(dtype), w.to(dtype), b.to(dtype) if bias else None, r.to(dtype)


def _with_residual(args, seed):
    """MLP inputs plus a residual shaped like the MLP's output (which is shaped like x)."""
    g = torch.Generator().manual_seed(seed)
    return (*args, torch.randn(args[0].shape, generator=g).to(args[0].dtype))


def _with_input_norm(args, seed):
    """fused_qkv_rope inputs plus the layer's input RMSNorm weight and eps."""
    g = torch.Generator().manual_seed(seed)
    H = args[0].shape[-1]
    return (*args, (1.0 + 0.1 * torch.randn(H, generator=g)).to(args[0].dtype), 1e-5)


def _reference_cases():
    f32 = torch.float32
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g)
    collectives = {
        "all_reduce": (x, r),
        "all_gather_columns": (x, 30),
        "vocab_shard_embedding": (torch.randn(8, 32, generator=g), torch.tensor([3, 9, 12, 5]), torch.tensor([4])),
    }
    w, b = torch.randn(32, generator=g), torch.randn(32, generator=g)
    q, k = torch.randn(3, 4, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    attn = attention_case([(0, 5), (6, 3)], 4, 2, 16, 4, f32, "cpu", seed=1)
    return {
        **collectives,
        "rms_norm": (x, w, 1e-6),
        "layer_norm": (x, w, b, 1e-5),
        "rotary_embedding": (q, k, torch.tensor([1, 0, 5]), ops.rope_cos_sin(16, 8, 10000.0)),
        "paged_attention": attn.args(attn.kv_cache.nan_to_num(0.0)),
        "fused_add_rms_norm": (x, r, w, 1e-6),
        "fused_add_layer_norm": (x, r, w, b, 1e-5),
        "fused_rms_norm_residual": (x, w, 1e-6, r),
        "linear": _linear_residual_inputs(3, 32, 24, bias=True, seed=7)[:3],
        "fused_linear_residual": _linear_residual_inputs(3, 32, 24, bias=True, seed=5),
        "fused_qkv_rope": qkv_inputs(3, 32, 4, 2, 16, f32, "cpu", 2, bias=True, qk_norm=True, rope=True, max_pos=8),
        "fused_rms_norm_glu_mlp": mlp_glu_inputs(3, 32, 24, f32, "cpu", 3),
        "fused_layer_norm_gelu_mlp": mlp_gelu_inputs(3, 32, 24, f32, "cpu", 4),
        "fused_moe": (x, torch.randn(4, 32, generator=g), torch.randn(4, 2 * 8, 32, generator=g),
                      torch.randn(4, 32, 8, generator=g), 2, True),
        "greedy_sample": (torch.randn(3, 50, generator=g),),
        # temperature 0 everywhere: the draw is the argmax, so the output is deterministic
        "temperature_sample": (torch.randn(3, 50, generator=g), torch.zeros(3)),
        # mutates the logits; the second row's mask (all -1) leaves it as it is
        "apply_token_bitmask": (torch.randn(3, 50, generator=g),
                                torch.tensor([[5, 1 << 20], [-1, -1], [0, 3]], dtype=torch.int32)),
        **_quantized_cases(),
    }


def _quantized_cases(scheme=None, T=3, I=24):
    """The weight-only quantized ops with ``scheme``'s weights, or int8 weights for some and int4
    for others (both encodings must pass through the schema and the fake); hidden size 32 (int4
    groups of 32 columns), I the linear's outputs and the MLPs' intermediate size (the down
    projections' int4 groups: 8 columns at I = 24, 16 at 48)."""
    from compiled_llm.graph.quantized_ops import quantize

    f32 = torch.float32
    s8, s4 = ("int8", "int4") if scheme is None else (scheme, scheme)
    x, w, b, r = _linear_residual_inputs(T, 32, I, bias=True, seed=13)
    qkv = qkv_inputs(T, 32, 4, 2, 16, f32, "cpu", 14, bias=True, qk_norm=True, rope=True, max_pos=8)
    glu = mlp_glu_inputs(T, 32, I, f32, "cpu", 15)
    gelu = mlp_gelu_inputs(T, 32, I, f32, "cpu", 16)
    return {
        "linear_wq": (x, *quantize(w, s8), b),
        "fused_linear_residual_wq": (x, *quantize(w, s4), b, r),
        "fused_qkv_rope_wq": (qkv[0], *quantize(qkv[1], s8), *qkv[2:]),
        "fused_rms_norm_glu_mlp_wq": (*glu[:3], *quantize(glu[3], s4), *quantize(glu[4], s8)),
        "fused_layer_norm_gelu_mlp_wq": (*gelu[:4], *quantize(gelu[4], s8), gelu[5], *quantize(gelu[6], s4), gelu[7]),
    }


QUANTIZED_OPS = list(_quantized_cases())


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("name", QUANTIZED_OPS)
def test_opcheck_quantized_op_with_each_scheme(name, scheme):
    torch.library.opcheck(getattr(torch.ops.cllm, name), _quantized_cases(scheme)[name])


@pytest.mark.parametrize("name", list(ops.OPS))
def test_opcheck_reference_op(name):
    torch.library.opcheck(getattr(torch.ops.cllm, name), _reference_cases()[name])


def _optional_arg_cases():
    """The reference ops again, with their optional trailing arguments given."""
    f32 = torch.float32
    return {
        "fused_linear_residual": _linear_residual_inputs(3, 32, 24, bias=False, seed=6),
        "fused_rms_norm_glu_mlp": _with_residual(mlp_glu_inputs(3, 32, 24, f32, "cpu", 7), 8),
        "fused_layer_norm_gelu_mlp": _with_residual(mlp_gelu_inputs(3, 32, 24, f32, "cpu", 9), 10),
        "fused_qkv_rope": _with_input_norm(
            qkv_inputs(3, 32, 4, 2, 16, f32, "cpu", 11, bias=True, qk_norm=True, rope=True, max_pos=8), 12),
    }


@pytest.mark.parametrize("name", list(_optional_arg_cases()))
def test_opcheck_reference_op_with_optional_args(name):
    torch.library.opcheck(getattr(torch.ops.cllm, name), _optional_arg_cases()[name])


# ---------------------------------------------------------------------------------------------
# what the optional arguments compute: exactly the unfused ops they replace, roundings included
# (bf16, where an add in float32 before rounding would differ)
# ---------------------------------------------------------------------------------------------

BF16 = torch.bfloat16


@pytest.mark.parametrize("bias", [False, True])
def test_linear_residual_is_the_rounded_linear_plus_residual(bias):
    x, w, b, r = _linear_residual_inputs(5, 64, 48, bias, seed=13, dtype=BF16)
    out = torch.ops.cllm.fused_linear_residual(x, w, b, r)
    assert out.dtype == BF16 and out.shape == r.shape
    assert torch.equal(out, r + F.linear(x, w, b))


@pytest.mark.parametrize("name,inputs", [("fused_rms_norm_glu_mlp", mlp_glu_inputs),
                                         ("fused_layer_norm_gelu_mlp", mlp_gelu_inputs)])
def test_mlp_residual_is_added_to_the_rounded_mlp_output(name, inputs):
    args = inputs(5, 64, 96, BF16, "cpu", 14)
    with_r = _with_residual(args, 15)
    op = getattr(torch.ops.cllm, name)
    assert torch.equal(op(*with_r), with_r[-1] + op(*args))
    assert torch.equal(getattr(fused_ops, name + "_ref")(*with_r), with_r[-1] + op(*args))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_input_norm_is_the_rounded_rms_norm_of_x(qk_norm):
    args = qkv_inputs(5, 64, 4, 2, 16, BF16, "cpu", 16, bias=True, qk_norm=qk_norm, rope=True, max_pos=32)
    with_norm = _with_input_norm(args, 17)
    norm_weight, norm_eps = with_norm[-2:]
    normed_x = ops.rms_norm_ref(args[0], norm_weight, norm_eps)
    for got, want in zip(torch.ops.cllm.fused_qkv_rope(*with_norm),
                         torch.ops.cllm.fused_qkv_rope(normed_x, *args[1:])):
        assert torch.equal(got, want)


def test_optional_args_default_to_the_old_behaviour():
    """Leaving them out (older graphs, other callers) is the same as passing None / no norm."""
    mlp = mlp_glu_inputs(3, 32, 24, BF16, "cpu", 18)
    assert torch.equal(torch.ops.cllm.fused_rms_norm_glu_mlp(*mlp, None), torch.ops.cllm.fused_rms_norm_glu_mlp(*mlp))
    qkv = qkv_inputs(3, 32, 4, 2, 16, BF16, "cpu", 19, bias=False, qk_norm=False, rope=True, max_pos=8)
    for a, b in zip(torch.ops.cllm.fused_qkv_rope(*qkv, None, 0.0), torch.ops.cllm.fused_qkv_rope(*qkv)):
        assert torch.equal(a, b)


def test_glu_mlp_activation_is_silu_by_default_or_gelu_tanh():
    """``activation`` comes last, "silu" (SwiGLU) by default, what graphs written before it meant;
    "gelu_tanh" is Gemma's GeGLU, bit for bit the unfused graph's F.gelu(approximate="tanh")."""
    x, nw, eps, gu, dw = mlp_glu_inputs(5, 64, 96, BF16, "cpu", 23)
    op = torch.ops.cllm.fused_rms_norm_glu_mlp
    assert torch.equal(op(x, nw, eps, gu, dw, None, "silu"), op(x, nw, eps, gu, dw))
    gate, up = F.linear(ops.rms_norm_ref(x, nw, eps), gu).chunk(2, -1)
    want = F.linear(F.gelu(gate, approximate="tanh") * up, dw)
    assert torch.equal(op(x, nw, eps, gu, dw, None, "gelu_tanh"), want)
    with pytest.raises(ValueError, match="unknown GLU activation 'relu'"):
        fused_ops.fused_rms_norm_glu_mlp_ref(x, nw, eps, gu, dw, None, "relu")


@pytest.mark.parametrize("name", ["fused_rms_norm_glu_mlp", "fused_rms_norm_glu_mlp_wq"])
def test_opcheck_glu_mlp_with_gelu_tanh(name):
    torch.library.opcheck(getattr(torch.ops.cllm, name), (*_reference_cases()[name], None, "gelu_tanh"))


def test_cuda_mlp_provider_gets_the_activation_and_adds_the_residual_after_it():
    """The CUDA norm+MLP kernels have no residual epilogue: their provider passes them the op's
    arguments but the residual (the activation after it included) and adds the residual itself."""
    seen = []

    def kernel(*args):
        seen.append(args[5:])
        return fused_ops.fused_rms_norm_glu_mlp_ref(*args[:5], None, *args[5:])

    call = providers._residual_after("fused_rms_norm_glu_mlp", kernel)
    args = mlp_glu_inputs(3, 32, 24, torch.float32, "cpu", 24)
    r = _with_residual(args, 25)[-1]
    assert torch.equal(call(*args, r, "gelu_tanh"), fused_ops.fused_rms_norm_glu_mlp_ref(*args, r, "gelu_tanh"))
    assert torch.equal(call(*args), fused_ops.fused_rms_norm_glu_mlp_ref(*args))
    assert seen == [("gelu_tanh",), ()]


# ---------------------------------------------------------------------------------------------
# Triton providers: shapes the kernels leave to the reference (these run on the CPU)
# ---------------------------------------------------------------------------------------------


def test_triton_linear_residual_sends_a_broadcast_residual_to_the_reference():
    x, w, b, r = _linear_residual_inputs(3, 32, 24, bias=True, seed=20)
    row = r[0]  # [N]: broadcast over the rows, which the kernel's epilogue does not do
    out = providers.provider_op("fused_linear_residual", "triton")(x, w, b, row)
    assert torch.equal(out, fused_ops.fused_linear_residual_ref(x, w, b, row))


def test_triton_qkv_fallback_keeps_the_input_norm():
    """An odd head_dim goes to the reference, which must still apply norm_weight."""
    args = _with_input_norm(qkv_inputs(3, 30, 2, 1, 5, torch.float32, "cpu", 21, bias=False, qk_norm=False,
                                       rope=False), 22)
    for got, want in zip(providers.provider_op("fused_qkv_rope", "triton")(*args), fused_ops.fused_qkv_rope_ref(*args)):
        assert torch.equal(got, want)


def _handles(name):
    return providers.TRITON_KERNELS[name][1]


def _handles_args(name, args):
    """The arguments of a call that its provider's ``handles`` reads, by name."""
    params = ops.OPS[name].params
    wanted = inspect.signature(_handles(name)).parameters
    return {p: args[params.index(p)] for p in wanted}


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("name", QUANTIZED_OPS)
def test_triton_quantized_providers_take_both_schemes_at_every_size(name, scheme):
    """An int8 or int4 engine never runs the dequantizing reference: decode steps run the decode
    forms, prefill sizes the quantized GEMM (int4 groups of 16 columns and more)."""
    for T in (1, 64):
        args = _quantized_cases(scheme, T=T, I=48)[name]
        assert _handles(name)(**_handles_args(name, args)), T


def test_quantized_gemm_leaves_int4_groups_narrower_than_a_dot_to_the_reference():
    """At prefill sizes an int4 weight in groups of 8 columns (K = 24) has no tl.dot-sized K step
    in one group: the call runs the reference; the decode form still streams it."""
    name = "fused_rms_norm_glu_mlp_wq"
    assert not _handles(name)(**_handles_args(name, _quantized_cases("int4", T=64, I=24)[name]))
    assert _handles(name)(**_handles_args(name, _quantized_cases("int4", T=1, I=24)[name]))
    assert _handles(name)(**_handles_args(name, _quantized_cases("int8", T=64, I=24)[name]))


def test_triton_int4_providers_refuse_groups_their_kernels_do_not_tile():
    """A thread's 16 bytes (32 columns) must lie in one group: groups of 48 columns (not from
    quantize, which makes powers of two) go to the reference."""
    from compiled_llm.graph.quantized_ops import quantize

    x, w, _, _ = _linear_residual_inputs(1, 96, 24, bias=True, seed=22)
    q, scale, zero = quantize(w, "int4")  # groups of 32
    assert _handles("linear_wq")(x, q, scale, zero)
    assert not _handles("linear_wq")(x, q, scale[:, :2], zero[:, :2])  # 2 groups of 48
    assert not _handles("linear_wq")(x, q, scale, None)  # uint8 weights need their zero points


def test_runtime_program_calls_provider_functions_directly_and_keeps_the_saved_graph():
    """The op-by-op runtime program skips the dispatcher for provider ops (host time per call);
    the graph it was made from, which is what an engine saves, still names the ops."""
    from compiled_llm.engine.program import PortableProgram
    from compiled_llm.engine.build import lower
    from compiled_llm.passes import default_pass_names
    from compiled_llm.model.sources import load_source_params, resolve_source

    src = resolve_source("tiny-qwen2")
    lowered = lower(src.config, load_source_params(src, torch.float32, "cpu"), default_pass_names(), "cuda", torch.float32, {})
    program = PortableProgram(lowered.gm, lowered.param_names)
    direct = registry.direct_calls()
    saved = [n.target for n in program.module.gm.graph.nodes if n.op == "call_function"]
    run = [n.target for n in program._run.gm.graph.nodes if n.op == "call_function"]
    assert sum(t in direct for t in saved) >= 4 * src.config.num_layers // 2
    assert not any(t in direct for t in run)
    assert sum(t in direct.values() for t in run) == sum(t in direct for t in saved)
    assert "__triton" in program.module.gm.code
