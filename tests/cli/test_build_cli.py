"""`compiled-llm build` makes an engine from a transformers-written checkpoint of every family
and from a tiny preset; `inspect --json` shows norm+MLP fused once per layer, both residual adds
of every layer taken into their producers, add+norm only where an add is left (GPT-2's
embeddings), q/k/v+RoPE once per layer, and a smaller op count; --pass and --diff show the IR."""

import json

import pytest

from compiled_llm.cli.main import main
from helpers.hf_checkpoints import make_checkpoint

FAMILIES = ["qwen2", "qwen3", "llama", "gpt2"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    built = {}
    for family in FAMILIES:
        ckpt = root / f"ckpt-{family}"
        hf = make_checkpoint(family, ckpt)
        out = root / f"eng-{family}"
        assert main(["build", str(ckpt), "-o", str(out), "--quiet", "--dump-ir"]) == 0
        built[family] = (out, hf.config)
    return built


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_json_shows_fusions_per_layer(engines, family, capsys):
    out, hf_config = engines[family]
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    matches = {p["name"]: p["matches"] for p in report["passes"]}
    layers = hf_config.num_hidden_layers if family != "gpt2" else hf_config.n_layer
    assert matches["fuse_norm_mlp"] == layers
    assert matches["fuse_residual"] == 2 * layers
    assert matches["fuse_add_norm"] == (1 if family == "gpt2" else 0)
    assert matches["fuse_qkv_rope"] == layers
    assert sum(report["ops_after"].values()) < sum(report["ops_before"].values())
    assert report["kernels"]["paged_attention"] == "reference"
    fused = "cllm::fused_layer_norm_gelu_mlp" if family == "gpt2" else "cllm::fused_rms_norm_glu_mlp"
    assert report["ops_after"][fused] == layers
    assert report["ops_after"]["cllm::fused_linear_residual"] == layers
    assert "aten::add.Tensor" not in report["ops_after"]


def test_build_summary_table_names_passes_and_stages(tmp_path, capsys):
    assert main(["build", "tiny-gpt2", "-o", str(tmp_path / "e"), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "fuse_qkv_rope" in text and "cleanup_noop" in text and "(matched nothing)" in text
    assert "ops:" in text and "capture" in text and "write" in text


def test_inspect_pass_and_diff(engines, capsys):
    out, _ = engines["llama"]
    capsys.readouterr()
    assert main(["inspect", str(out), "--pass", "fuse_qkv_rope"]) == 0
    code = capsys.readouterr().out
    assert "cllm.fused_qkv_rope" in code and "cllm.rotary_embedding" not in code
    assert main(["inspect", str(out), "--diff", "captured", "fuse_norm_mlp"]) == 0
    diff = capsys.readouterr().out
    assert diff.startswith("--- ir/00_captured.py")
    assert any(line.startswith("+") and "fused_rms_norm_glu_mlp" in line for line in diff.splitlines())
    assert any(line.startswith("-") and "aten.silu" in line for line in diff.splitlines())
    assert main(["inspect", str(out), "--diff", "fuse_norm_mlp", "fuse_residual"]) == 0
    diff = capsys.readouterr().out.splitlines()
    assert any(line.startswith("+") and "cllm.fused_linear_residual" in line for line in diff)
    assert any(line.startswith("-") and "aten.add.Tensor" in line for line in diff)
    assert main(["inspect", str(out)]) == 0
    assert "cllm::fused_qkv_rope" in capsys.readouterr().out


def test_user_errors_exit_2_with_one_line(tmp_path, capsys):
    assert main(["build", str(tmp_path / "nowhere"), "-o", str(tmp_path / "e"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert main(["build", "tiny-qwen2", "-o", str(tmp_path / "e"), "--disable-pass", "nope"]) == 2
    assert "unknown pass 'nope'" in capsys.readouterr().err
    assert main(["build", "tiny-qwen2", "-o", str(tmp_path / "e"), "--max-model-len", "999999"]) == 2
    assert "--max-model-len" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_disable_pass_is_recorded(tmp_path, capsys):
    out = tmp_path / "e"
    assert main(["build", "tiny-qwen2", "-o", str(out), "--quiet", "--disable-pass", "fuse_add_norm"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    names = [p["name"] for p in json.loads(capsys.readouterr().out)["passes"]]
    assert "fuse_add_norm" not in names and "fuse_norm_mlp" in names
