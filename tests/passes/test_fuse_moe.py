"""fuse_moe: a mixture of experts, as the spec writes it (router, top-k, every expert weighted),
becomes one cllm::fused_moe op per layer over the stacked expert weights, computing what it did;
the shard pass then splits each expert's columns over the ranks."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from compiled_llm.engine.build import lower
from compiled_llm.graph.export import FlatProgram, capture, param_placeholder_names
from compiled_llm.graph.fused_ops import fused_moe_ref
from compiled_llm.model import sharding
from compiled_llm.model.presets import preset_config
from compiled_llm.model.spec import forward
from compiled_llm.model.weights import random_params
from compiled_llm.passes import cleanup_noop, default_pass_names, fuse_moe, fuse_residual
from compiled_llm.passes.base import PassContext, aten, cllm, is_call, param_name
from compiled_llm.passes.manager import op_histogram
from helpers.program_inputs import mixed_batch

MIXTURES = ["tiny-qwen3-moe", "tiny-mixtral"]


def _captured(family, seed=1):
    config = preset_config(family)
    params = random_params(config, seed=seed)
    cap = capture(config, params)
    ctx = PassContext(config, dict(params))
    cleanup_noop.run(cap.gm, ctx)
    return config, params, cap.gm, ctx


def _run(gm, params, config, seed=0):
    batch, kv = mixed_batch(config, seed)
    return FlatProgram(gm, param_placeholder_names(gm))(params, *batch, kv)


@pytest.mark.parametrize("family", MIXTURES)
def test_each_mixture_layer_becomes_one_fused_moe_over_the_stacked_experts_and_its_input_norm(family):
    config, params, gm, ctx = _captured(family)
    before_gm, before_params = copy.deepcopy(gm), dict(ctx.params)
    assert fuse_moe.run(gm, ctx) == len(config.moe_layers)
    hist = op_histogram(gm)
    assert hist["cllm::fused_moe"] == len(config.moe_layers)
    assert not {"aten::topk", "aten::scatter", "aten::matmul", "aten::chunk"} & set(hist)
    fused = [n for n in gm.graph.nodes if is_call(n, cllm.fused_moe.default)]
    for layer, node in zip(config.moe_layers, fused):
        p = f"layers.{layer}."
        names = [param_name(a) for a in node.args[1:4]]
        assert names == [p + "router.weight", p + "experts.gate_up.weight", p + "experts.down.weight"]
        assert node.args[4:6] == (config.num_experts_per_tok, config.norm_topk_prob)
        # the post-attention RMSNorm, read by nothing else, folded in: the op normalises x itself
        assert param_name(node.args[6]) == p + "mlp_norm.weight" and node.args[7] == config.norm_eps
    assert "cllm::rms_norm" not in op_histogram(gm) or all(
        not any(is_call(u, cllm.fused_moe.default) for u in n.users)
        for n in gm.graph.nodes if is_call(n, cllm.rms_norm.default))
    assert ctx.params.keys() == params.keys()  # the spec's weights serve the op as they are
    torch.testing.assert_close(_run(gm, ctx.params, config), _run(before_gm, before_params, config),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", MIXTURES)
def test_the_whole_pipeline_on_a_mixture_computes_the_spec(family):
    """A mixture layer after every pass is one op: its norm before and its residual add after are
    the op's, so the next layer's q/k/v projection reads its output and folds its own norm."""
    config = preset_config(family)
    params = random_params(config, seed=5)
    lowered = lower(config, params, default_pass_names(), "cpu", torch.float32)
    hist = op_histogram(lowered.gm)
    assert hist["cllm::fused_moe"] == len(config.moe_layers)
    assert "aten::add.Tensor" not in hist and "cllm::fused_add_rms_norm" not in hist
    for node in lowered.gm.graph.nodes:
        if is_call(node, cllm.fused_moe.default):
            x, residual = node.args[0], node.args[8]
            assert residual is x and param_name(node.args[6]).endswith("mlp_norm.weight")
            readers = node.users
            assert any(is_call(u, cllm.fused_qkv_rope.default, aten.index_select.default) for u in readers)
            assert not any(is_call(u, cllm.rms_norm.default) for u in readers)
    batch, kv = mixed_batch(config, seed=6)
    kv_ref = kv.clone()
    got = FlatProgram(lowered.gm, lowered.param_names)(lowered.params, *batch, kv)
    torch.testing.assert_close(got, forward(config, params, batch, kv_ref), rtol=1e-5, atol=1e-5)


def test_a_mixture_whose_experts_output_is_read_elsewhere_is_left_alone():
    config, params, gm, ctx = _captured("tiny-qwen3-moe")
    experts = next(n for n in gm.graph.nodes if is_call(n, aten.matmul.default)
                   and "experts_down" in str(n.args[1].args[0]))
    with gm.graph.inserting_after(experts):  # a second reader of the experts' outputs
        gm.graph.call_function(aten.neg.default, (experts,))
    assert fuse_moe.run(gm, ctx) == 0
    assert "cllm::fused_moe" not in op_histogram(gm)


def test_a_norm_read_elsewhere_stays_and_the_residual_add_still_joins_the_mixture():
    """The norm's output has a second reader, so it is not folded; fuse_residual then gives the
    op its residual with the norm arguments at their defaults (None, 0.0)."""
    config, params, gm, ctx = _captured("tiny-qwen3-moe")
    norm = next(n for n in gm.graph.nodes if is_call(n, cllm.rms_norm.default)
                and "mlp_norm" in str(n.args[1]) and n.args[1].target.startswith("params_layers_1"))
    with gm.graph.inserting_after(norm):
        second_reader = gm.graph.call_function(aten.neg.default, (norm,))
    gm.graph.output_node().args = ((gm.graph.output_node().args[0], second_reader),)
    gm.recompile()
    before_gm, before_params = copy.deepcopy(gm), dict(ctx.params)
    assert fuse_moe.run(gm, ctx) == 1 and fuse_residual.run(gm, ctx) >= 1
    (fused,) = [n for n in gm.graph.nodes if is_call(n, cllm.fused_moe.default)]
    assert fused.args[0] is norm and fused.args[6:8] == (None, 0.0)
    assert isinstance(fused.args[8], torch.fx.Node)  # the residual stream
    got, want = _run(gm, ctx.params, config), _run(before_gm, before_params, config)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_bf16_mixture_fuses_with_its_float32_routing_and_sum():
    config = preset_config("tiny-mixtral")
    params = random_params(config, dtype=torch.bfloat16, seed=1)
    gm = capture(config, params).gm
    ctx = PassContext(config, dict(params), dtype=torch.bfloat16)
    cleanup_noop.run(gm, ctx)
    before = copy.deepcopy(gm)
    assert fuse_moe.run(gm, ctx) == len(config.moe_layers)
    torch.testing.assert_close(_run(gm, ctx.params, config), _run(before, params, config), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("change", ["smallest_k", "sum_over_tokens", "softmax_in_bf16"])
def test_a_routing_that_is_not_the_spec_s_is_left_alone(change):
    config = preset_config("tiny-qwen3-moe")
    params = random_params(config, dtype=torch.bfloat16, seed=1)
    gm = capture(config, params).gm
    ctx = PassContext(config, dict(params), dtype=torch.bfloat16)
    cleanup_noop.run(gm, ctx)
    topk = next(n for n in gm.graph.nodes if is_call(n, aten.topk.default))
    if change == "smallest_k":
        topk.args = (*topk.args[:2], -1, False)
    elif change == "sum_over_tokens":  # the renormalising sum over the wrong dim
        total = next(n for n in gm.graph.nodes if is_call(n, aten.sum.dim_IntList) and n.args[0].args[0] is topk)
        total.args = (total.args[0], [0], True)
    else:
        cast = topk.args[0].args[0]
        assert is_call(cast, aten.to.dtype)
        cast.args = (cast.args[0], torch.bfloat16)
    assert fuse_moe.run(gm, ctx) == 0


def test_experts_with_another_activation_are_left_alone():
    config, params, gm, ctx = _captured("tiny-mixtral")
    silu = next(n for n in gm.graph.nodes if is_call(n, aten.silu.default))
    silu.target = aten.gelu.default
    assert fuse_moe.run(gm, ctx) == len(config.moe_layers) - 1


@pytest.mark.parametrize("renormalize", [True, False])
def test_experts_split_over_ranks_sum_to_the_whole_mixture(renormalize):
    config = preset_config("tiny-qwen3-moe")
    plan = sharding.plan(config, 2)
    gen = torch.Generator().manual_seed(3)
    E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
    x, router = torch.randn(6, H, generator=gen), torch.randn(E, H, generator=gen)
    gate_up, down = torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5, torch.randn(E, H, I, generator=gen) / I ** 0.5
    whole = fused_moe_ref(x, router, gate_up, down, 2, renormalize)
    parts = [fused_moe_ref(x, router, sharding.shard_param(plan, r, "layers.1.experts.gate_up.weight", gate_up),
                           sharding.shard_param(plan, r, "layers.1.experts.down.weight", down), 2, renormalize)
             for r in range(2)]
    assert parts[0].shape == whole.shape
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)


def test_the_shard_pass_all_reduces_the_fused_mixture():
    config = preset_config("tiny-qwen3-moe")
    params = random_params(config)
    lowered = lower(config, params, default_pass_names(), "cpu", torch.float32, tp_rank=1, tp_size=2)
    moe = next(n for n in lowered.gm.graph.nodes if is_call(n, cllm.fused_moe.default))
    assert [u.target for u in moe.users] == [cllm.all_reduce.default]
    p = "layers.1.experts."
    half = config.moe_intermediate_size // 2
    whole_gate_up, whole_down = params[p + "gate_up.weight"], params[p + "down.weight"]
    # rank 1: the second half of each expert's gate rows, then of its up rows, and of its down columns
    want = torch.cat([whole_gate_up[:, half:2 * half], whole_gate_up[:, 3 * half:]], dim=1)
    assert torch.equal(lowered.params[p + "gate_up.weight"], want)
    assert torch.equal(lowered.params[p + "down.weight"], whole_down[:, :, half:])


def test_experts_whose_columns_do_not_split_are_refused():
    config = preset_config("tiny-qwen3-moe")
    odd = dataclasses.replace(config, moe_intermediate_size=45)
    with pytest.raises(Exception, match="cannot split the experts' 45 columns over 2 ranks"):
        sharding.plan(odd, 2)
