"""`compare` checks an engine against the spec and against transformers (100% greedy agreement
over 8 prompts x 32 tokens, max|Δlogit| <= 1e-4 relative in fp32), exits 0 only within tolerance,
and names the first pass that changes the numbers when a wrong rewrite is planted."""

import pytest
import torch

from compiled_llm.engine.build import build_engine
from compiled_llm.cli.main import main
from compiled_llm.engine.compare import compare_engine, judge
from compiled_llm.errors import CompiledLLMError
from compiled_llm.passes import default_pass_names, register_pass, unregister_pass
from compiled_llm.passes.base import Pass
from helpers.hf_checkpoints import make_checkpoint
from helpers.wrong_passes import drop_q_bias

FAMILIES = ["qwen2", "qwen3", "llama", "gpt2", "mistral", "phi3", "gemma2", "gemma3", "qwen3_moe", "mixtral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_agrees_with_spec_and_transformers(family, tmp_path, capsys):
    make_checkpoint(family, tmp_path / "ckpt")
    out = tmp_path / "engine"
    assert main(["build", str(tmp_path / "ckpt"), "-o", str(out), "--quiet"]) == 0
    for reference in ("spec", "hf"):
        capsys.readouterr()
        code = main(["compare", str(out), "--num-prompts", "8", "--max-tokens", "32", "--reference", reference])
        lines = capsys.readouterr().out.strip().splitlines()
        assert code == 0, lines[-1]
        assert sum(line.strip().startswith("prompt ") for line in lines) == 8
        assert lines[-1].startswith(f"PASS: vs {reference}: greedy agreement 100.00% (256/256)")


def test_planted_wrong_pass_is_named(tmp_path, capsys):
    register_pass(Pass("drop_q_bias", drop_q_bias, "test: a wrong rewrite"))
    try:
        names = default_pass_names()
        names.insert(names.index("fuse_qkv_rope"), "drop_q_bias")
        make_checkpoint("qwen2", tmp_path / "ckpt")
        out = tmp_path / "engine"
        build_engine(str(tmp_path / "ckpt"), out, pass_names=names, progress=False)
        capsys.readouterr()
        code = main(["compare", str(out), "--num-prompts", "4", "--max-tokens", "8"])
        lines = capsys.readouterr().out.strip().splitlines()
        assert code == 1
        assert lines[-1].startswith("FAIL: vs spec")
        assert lines[-1].endswith("first pass that changes the numbers: drop_q_bias")
        assert any("after fuse_norm_mlp" in line and line.endswith("ok") for line in lines)
        assert any("after fuse_residual" in line and line.endswith("ok") for line in lines)
    finally:
        unregister_pass("drop_q_bias")


def test_judge_tolerances():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(4, 2, 50, generator=gen)  # [K, N, V]
    tokens = ref.argmax(-1).T
    prompts = [[1, 2], [3]]
    assert judge(ref.clone(), tokens, ref, prompts, torch.float32).ok
    # fp32: a small relative error is fine, a larger one is not
    assert judge(ref + 1e-6, tokens, ref, prompts, torch.float32).ok
    assert not judge(ref + 1e-2, tokens, ref, prompts, torch.float32).ok
    # one flipped token to the reference's second choice: fine in bf16 only if >= 99% agree
    flipped = tokens.clone()
    flipped[0, 0] = ref[0, 0].topk(2).indices[1]
    v = judge(ref, flipped, ref, prompts, torch.bfloat16)
    assert v.agree == 7 and v.flips_outside_top_k == 0 and not v.ok  # 7/8 < 99%
    # a flip to a token outside the reference's top 5 is counted
    far = tokens.clone()
    far[1, 2] = ref[2, 1].argmin()
    assert judge(ref, far, ref, prompts, torch.bfloat16).flips_outside_top_k == 1


def test_compare_refuses_bad_arguments(tmp_path):
    out = tmp_path / "engine"
    build_engine("tiny-gpt2", out, progress=False)
    from compiled_llm.errors import CompiledLLMError

    with pytest.raises(CompiledLLMError, match="--num-prompts"):
        compare_engine(out, num_prompts=0)
    with pytest.raises(CompiledLLMError, match="--reference hf needs the source checkpoint"):
        compare_engine(out, num_prompts=1, max_tokens=2, reference="hf")


def test_compare_of_a_tensor_parallel_engine_needs_the_runtime_to_start_its_ranks(tmp_path):
    """engine/compare does not import the runtime above it: the caller hands in how the other
    ranks start (the CLI passes serve.executor's start_ranks)."""
    out = tmp_path / "tp2"
    build_engine("tiny-qwen2", out, dtype="float32", device="cpu", progress=False, tensor_parallel_size=2)
    with pytest.raises(CompiledLLMError, match="tensor-parallel engine \\(2 ranks\\).*needs start_ranks"):
        compare_engine(out, num_prompts=1, max_tokens=2)
