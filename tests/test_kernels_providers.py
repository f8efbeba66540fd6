"""Provider registration, launch-config tables and opcheck of the reference ops (CPU, no kernel
runs here: the Triton kernels are exercised by test_kernels_interpret.py and the GPU tests)."""

import json

import pytest
import torch

from compiled_llm.errors import CompiledLLMError
from compiled_llm.graph import fused_ops, ops
from compiled_llm.kernels import cuda_norm_mlp, launch_configs, registry
from kernel_inputs import attention_case, mlp_gelu_inputs, mlp_glu_inputs, qkv_inputs

triton = pytest.importorskip("triton")
from compiled_llm.kernels import providers  # noqa: E402


def _schema_tail(op) -> str:
    """The schema after the op's name: arguments, mutations and returns."""
    return str(op.default._schema).split("(", 1)[1]


@pytest.mark.parametrize("name", list(providers.TRITON_OPS))
def test_triton_provider_has_the_semantic_schema_and_is_registered(name):
    assert _schema_tail(providers.provider_op(name, "triton")) == _schema_tail(getattr(torch.ops.cllm, name))
    p = registry.get_provider(name, "triton")
    assert p.overload.name() == f"cllm::{name}__triton"
    assert p.supports("cuda", torch.bfloat16) and p.supports("cuda", torch.float32)
    assert not p.supports("cpu", torch.float32)


@pytest.mark.parametrize("name", list(providers.CUDA_OPS))
def test_cuda_provider_has_the_semantic_schema_and_ranks_below_triton(name):
    assert _schema_tail(providers.provider_op(name, "cuda")) == _schema_tail(getattr(torch.ops.cllm, name))
    names = [p.name for p in registry.providers(name)]
    assert names.index("triton") < names.index("cuda") < names.index("reference")
    cuda = registry.get_provider(name, "cuda")
    assert not cuda.supports("cpu", torch.bfloat16)
    assert not cuda.supports("cuda", torch.float32)  # the CUDA kernels are 16-bit only


def test_default_choice_is_triton_on_cuda_and_reference_on_cpu():
    assert set(registry.choose_providers("cuda", torch.bfloat16).values()) == {"triton"}
    assert set(registry.choose_providers("cpu", torch.float32).values()) == {"reference"}


def test_cuda_extension_reports_why_it_cannot_build_on_a_cpu_torch():
    if torch.version.cuda is not None:
        pytest.skip("CUDA torch: the GPU tests build the extension")
    assert not cuda_norm_mlp.toolchain_available()
    assert cuda_norm_mlp.extension() is None and not cuda_norm_mlp.cuda_extension_ok()
    assert "toolchain" in cuda_norm_mlp.build_error()


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
    assert launch_configs.get("norm_mlp_decode", 1) == table["1"]
    assert launch_configs.get("norm_mlp_decode", 2) == table["16"]
    assert launch_configs.get("norm_mlp_decode", 16) == table["16"]
    assert launch_configs.get("norm_mlp_decode", 17) == table["inf"]


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
])
def test_invalid_launch_configs_are_refused(bad, fresh_configs):
    with pytest.raises(CompiledLLMError):
        launch_configs.use_configs(bad)


# ---------------------------------------------------------------------------------------------
# opcheck of the reference (semantic and fused) ops on the CPU
# ---------------------------------------------------------------------------------------------


def _reference_cases():
    f32 = torch.float32
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g)
    w, b = torch.randn(32, generator=g), torch.randn(32, generator=g)
    q, k = torch.randn(3, 4, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    attn = attention_case([(0, 5), (6, 3)], 4, 2, 16, 4, f32, "cpu", seed=1)
    return {
        "rms_norm": (x, w, 1e-6),
        "layer_norm": (x, w, b, 1e-5),
        "rotary_embedding": (q, k, torch.tensor([1, 0, 5]), ops.rope_cos_sin(16, 8, 10000.0)),
        "paged_attention": attn.args(attn.kv_cache.nan_to_num(0.0)),
        "fused_add_rms_norm": (x, r, w, 1e-6),
        "fused_add_layer_norm": (x, r, w, b, 1e-5),
        "fused_qkv_rope": qkv_inputs(3, 32, 4, 2, 16, f32, "cpu", 2, bias=True, qk_norm=True, rope=True, max_pos=8),
        "fused_rms_norm_glu_mlp": mlp_glu_inputs(3, 32, 24, f32, "cpu", 3),
        "fused_layer_norm_gelu_mlp": mlp_gelu_inputs(3, 32, 24, f32, "cpu", 4),
    }


@pytest.mark.parametrize("name", [*ops.SEMANTIC_OPS, *fused_ops.FUSED_OPS])
def test_opcheck_reference_op(name):
    torch.library.opcheck(getattr(torch.ops.cllm, name), _reference_cases()[name])
