"""cllm::fused_moe's Triton kernels on the GPU at real shapes (Qwen3-30B-A3B's and Mixtral's layer,
fewer experts where the dense reference would not fit): both forms match the op's reference, and
each runs inside a CUDA graph with the routing decided on the device (a replay after new inputs
computes the new routing), with the layer's input norm and residual add folded in as the passes
fold them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from compiled_llm.graph.fused_ops import fused_moe_ref  # noqa: E402
from compiled_llm.kernels import triton_fused_moe  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b (4 experts)": (4, 2, 4096, 14336)}


def _layer(E, H, I, seed):
    g = torch.Generator("cuda").manual_seed(seed)
    return (torch.randn(E, H, generator=g, device="cuda", dtype=torch.bfloat16) * H ** -0.5,
            torch.randn(E, 2 * I, H, generator=g, device="cuda", dtype=torch.bfloat16) * H ** -0.5,
            torch.randn(E, H, I, generator=g, device="cuda", dtype=torch.bfloat16) * I ** -0.5)


def _norm_and_residual(T, H, seed):
    g = torch.Generator("cuda").manual_seed(seed)
    return (torch.rand(H, generator=g, device="cuda").to(torch.bfloat16) + 0.5, 1e-6,
            torch.randn(T, H, generator=g, device="cuda", dtype=torch.bfloat16))


@pytest.mark.parametrize("folded", [False, True], ids=["bare", "norm+residual"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("T", [1, 3, 200])
@pytest.mark.parametrize("form", ["decode", "prefill"])
def test_both_forms_match_the_reference_at_real_shapes(shape, T, form, folded):
    E, k, H, I = SHAPES[shape]
    router, gate_up, down = _layer(E, H, I, seed=T)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    extra = _norm_and_residual(T, H, seed=T + 1) if folded else ()
    got = triton_fused_moe.fused_moe(x, router, gate_up, down, k, True, *extra, form=form)
    want = fused_moe_ref(x, router, gate_up, down, k, True, *extra)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("T", [1, 2, 64])
def test_a_captured_mixture_routes_each_replay_on_the_device(T):
    E, k, H, I = SHAPES["qwen3-30b-a3b"]
    router, gate_up, down = _layer(E, H, I, seed=7)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    norm_weight, eps, residual = _norm_and_residual(T, H, seed=8)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        triton_fused_moe.fused_moe(x, router, gate_up, down, k, True, norm_weight, eps, residual)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_fused_moe.fused_moe(x, router, gate_up, down, k, True, norm_weight, eps, residual)
    for seed in (1, 2, 3):
        x.copy_(torch.randn(T, H, generator=torch.Generator("cuda").manual_seed(seed), device="cuda",
                            dtype=torch.bfloat16))
        graph.replay()
        want = fused_moe_ref(x, router, gate_up, down, k, True, norm_weight, eps, residual)
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    assert not triton_fused_moe._route_counters(x.device).any()  # every replay left them at zero
