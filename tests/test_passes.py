"""Each pass leaves what the graph computes unchanged (the graph before and after it, run on
random inputs, agree), matches where the spec says it should (norm+MLP once per layer, add+norm
L-1 times (GPT-2: L), q/k/v+RoPE once per layer), shrinks the op count, and stores merged
weights once while dropping the originals."""

import copy

import pytest
import torch

from compiled_llm.build import lower, program_kernels
from compiled_llm.errors import CompiledLLMError
from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.graph.export import FlatProgram, capture, param_placeholder_names
from compiled_llm.graph.spec import kv_cache_shape
from compiled_llm.graph.weights import random_params
from compiled_llm.kernels import registry
from compiled_llm.passes import default_pass_names, get_pass, pipeline
from compiled_llm.passes.base import PassContext
from compiled_llm.passes.manager import PassManager, op_histogram
from compiled_llm.presets import preset_config

FAMILIES = ["tiny-qwen2", "tiny-qwen3", "tiny-llama", "tiny-gpt2"]


def _inputs(config, seed):
    gen = torch.Generator().manual_seed(seed)
    block = 8
    seqs = [ScheduledSeq(torch.randint(0, config.vocab_size, (n,), generator=gen).tolist(), c, [2 * i, 2 * i + 1])
            for i, (c, n) in enumerate([(0, 9), (3, 4), (10, 1)])]
    kv = torch.randn(kv_cache_shape(config, 8, block), generator=gen)
    return pack_batch(seqs, block), kv


def _run(gm, params, config, seed=0):
    batch, kv = _inputs(config, seed)
    out = FlatProgram(gm, param_placeholder_names(gm))(params, *batch, kv)
    return out, kv


@pytest.mark.parametrize("family", FAMILIES)
def test_every_pass_preserves_outputs_and_matches_where_expected(family):
    config = preset_config(family)
    params = random_params(config, seed=1)
    cap = capture(config, params)
    ctx = PassContext(config, dict(params), kernel_choice=registry.choose_providers("cpu", torch.float32))
    matches = {}
    for p in pipeline():
        before_gm, before_params = copy.deepcopy(cap.gm), dict(ctx.params)
        matches[p.name] = p.run(cap.gm, ctx)
        want, want_kv = _run(before_gm, before_params, config)
        got, got_kv = _run(cap.gm, ctx.params, config)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{p.name} changed the logits")
        torch.testing.assert_close(got_kv, want_kv, rtol=1e-5, atol=1e-5, msg=f"{p.name} changed the cache")
    L = config.num_layers
    assert matches["fuse_norm_mlp"] == L
    assert matches["fuse_add_norm"] == (L if family == "tiny-gpt2" else L - 1)
    assert matches["fuse_qkv_rope"] == L
    assert matches["select_kernels"] > 0


@pytest.mark.parametrize("family", ["tiny-qwen2", "tiny-gpt2"])
def test_merged_weights_are_stored_once_and_originals_dropped(family):
    config = preset_config(family)
    params = random_params(config, seed=2)
    lowered = lower(config, params, default_pass_names(), "cpu", torch.float32)
    names = set(lowered.param_names)
    assert set(lowered.params) == names
    for layer in range(config.num_layers):
        p = f"layers.{layer}."
        assert p + "qkv.weight" in names and p + "qkv.bias" in names
        assert not {p + "q.weight", p + "k.weight", p + "v.weight", p + "q.bias"} & names
        want = torch.cat([params[p + "q.weight"], params[p + "k.weight"], params[p + "v.weight"]])
        assert torch.equal(lowered.params[p + "qkv.weight"], want)
        if config.mlp_type == "silu_glu":
            assert p + "gate_up.weight" in names and p + "gate.weight" not in names and p + "up.weight" not in names
    # fewer stored tensor elements than the source (merged tensors replace, never duplicate)
    assert sum(t.numel() for t in lowered.params.values()) <= sum(t.numel() for t in params.values())


def test_op_count_shrinks_and_only_fused_ops_remain():
    config = preset_config("tiny-llama")
    lowered = lower(config, random_params(config), default_pass_names(), "cpu", torch.float32)
    before, after = lowered.histograms["00_captured"], op_histogram(lowered.gm)
    assert sum(after.values()) < sum(before.values())
    assert "aten::silu" in before and "aten::silu" not in after
    assert after["cllm::fused_rms_norm_glu_mlp"] == config.num_layers
    assert after["cllm::fused_qkv_rope"] == config.num_layers
    assert "cllm::rotary_embedding" not in after
    assert program_kernels(lowered.gm)["paged_attention"] == "reference"


def test_pass_manager_dumps_ir_before_and_after_each_pass(tmp_path):
    config = preset_config("tiny-qwen3")
    lower(config, random_params(config), default_pass_names(), "cpu", torch.float32, ir_dir=tmp_path)
    stages = sorted(p.name for p in tmp_path.glob("*.py"))
    assert stages[0] == "00_captured.py" and len(stages) == len(default_pass_names()) + 1
    assert "fused_qkv_rope" in (tmp_path / stages[-1]).read_text()
    assert "fused_qkv_rope" not in (tmp_path / "00_captured.py").read_text()


def test_disabled_pass_is_skipped_and_unknown_one_refused():
    names = [p.name for p in pipeline(disabled=["fuse_add_norm"])]
    assert "fuse_add_norm" not in names and "fuse_norm_mlp" in names
    with pytest.raises(CompiledLLMError, match="unknown pass 'nope'"):
        pipeline(disabled=["nope"])


def test_select_kernels_rewrites_to_the_chosen_provider():
    """A registered provider (same schema, its own op) replaces the semantic op in the graph."""
    lib = torch.library.Library("cllm", "FRAGMENT")
    try:
        @torch.library.custom_op("cllm::rms_norm__testprov", mutates_args=())
        def testprov(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            return torch.ops.cllm.rms_norm(x, weight, eps)

        @testprov.register_fake
        def _(x, weight, eps):
            return torch.empty_like(x)
    except RuntimeError:
        pass  # already defined by an earlier run in this process
    registry.register_provider("rms_norm", registry.Provider("testprov", torch.ops.cllm.rms_norm__testprov,
                                                             lambda d, t: d == "cpu", priority=10))
    try:
        assert registry.choose_providers("cpu", torch.float32)["rms_norm"] == "testprov"
        assert registry.choose_providers("cuda", torch.float32)["rms_norm"] != "testprov"  # cpu-only provider
        config = preset_config("tiny-qwen3")  # q/k norms stay inside fused_qkv_rope; final norm is rms_norm
        params = random_params(config)
        lowered = lower(config, params, default_pass_names(), "cpu", torch.float32)
        assert program_kernels(lowered.gm)["rms_norm"] == "testprov"
        want, _ = _run(capture(config, params).gm, params, config)
        got, _ = _run(lowered.gm, lowered.params, config)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        with pytest.raises(CompiledLLMError, match="no provider 'nope'"):
            registry.choose_providers("cpu", torch.float32, prefer={"rms_norm": "nope"})
    finally:
        registry.unregister_provider("rms_norm", "testprov")
    del lib
