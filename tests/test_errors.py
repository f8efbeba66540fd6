"""User mistakes fail through the CLI with exit code 2 and one stderr line, starting with
"error:", that names the problem (no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from compiled_llm.cli.main import main
from helpers.hf_checkpoints import make_checkpoint


@pytest.fixture
def ckpt(tmp_path):
    make_checkpoint("qwen2", tmp_path)
    return tmp_path


def fails_with(capsys, argv, *needles) -> str:
    capsys.readouterr()  # drop what setup printed (e.g. transformers' progress bars)
    rc = main(["run", *map(str, argv)])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def edit_weights(ckpt, fn):
    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_tensor_is_named(ckpt, capsys):
    edit_weights(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    fails_with(capsys, [ckpt, "--prompt-ids", "1,2"], "missing tensor", "model.layers.1.mlp.up_proj.weight")


def test_wrong_shape_is_named(ckpt, capsys):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)

    edit_weights(ckpt, shrink)
    fails_with(capsys, [ckpt, "--prompt-ids", "1,2"], "model.layers.0.self_attn.k_proj.weight", "(8, 64)", "(32, 64)")


def test_unexpected_tensor_is_named(ckpt, capsys):
    edit_weights(ckpt, lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(2)))
    fails_with(capsys, [ckpt, "--prompt-ids", "1,2"], "unexpected tensor", "model.layers.0.extra.weight")


def test_missing_gpt2_tensor_uses_checkpoint_name(tmp_path, capsys):
    make_checkpoint("gpt2", tmp_path)
    edit_weights(tmp_path, lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"))
    fails_with(capsys, [tmp_path, "--prompt-ids", "1,2"], "transformer.h.1.mlp.c_fc.bias")


def test_unknown_architecture_lists_the_supported_ones(ckpt, capsys):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["Olmo2ForCausalLM"], "olmo2"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    fails_with(capsys, [ckpt, "--prompt-ids", "1,2"], "Olmo2ForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel",
               "LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")


def test_corrupt_config_json(ckpt, capsys):
    (ckpt / "config.json").write_text("{oops")
    fails_with(capsys, [ckpt, "--prompt-ids", "1,2"], "config.json", "not valid JSON")


def test_missing_weights_file(ckpt, capsys):
    (ckpt / "model.safetensors").unlink()
    fails_with(capsys, [ckpt, "--prompt-ids", "1,2"], "no model.safetensors")


# the compiled path (the default) says "max length" as vLLM does; the reference path "context"
TOO_LONG = {"compiled": ([], "max length of"), "eager": (["--eager"], "context of")}


@pytest.mark.parametrize("path", TOO_LONG)
def test_prompt_longer_than_context(ckpt, capsys, path):
    ids = ",".join(["7"] * 250)
    flags, words = TOO_LONG[path]
    fails_with(capsys, [ckpt, "--prompt-ids", ids, "--max-tokens", 16, *flags], "250 tokens", f"{words} 256")


@pytest.mark.parametrize("path", TOO_LONG)
def test_text_prompt_longer_than_preset_context(capsys, path):
    flags, words = TOO_LONG[path]
    fails_with(capsys, ["tiny-gpt2", "--prompt", "x" * 1020, "--max-tokens", 8, *flags], "1020 tokens", f"{words} 1024")


@pytest.mark.parametrize(
    "option, value, needle",
    [
        ("--temperature", "-1", "temperature must be >= 0"),
        ("--temperature", "nan", "temperature"),
        ("--top-p", "0", "top_p must be in (0, 1]"),
        ("--top-p", "1.5", "top_p"),
        ("--top-k", "-3", "top_k must be -1"),
        ("--max-tokens", "0", "max_tokens must be an integer >= 1"),
    ],
)
def test_invalid_sampling_values(ckpt, capsys, option, value, needle):
    fails_with(capsys, [ckpt, "--prompt-ids", "1,2", option, value], needle, value)


def test_text_prompt_without_tokenizer(ckpt, capsys):
    fails_with(capsys, [ckpt, "--prompt", "hello"], "needs a tokenizer", "--prompt-ids")


@pytest.mark.parametrize("ids, needle", [("1,x,3", "not a comma-separated list"), ("1,300", "token id 300")])
def test_bad_prompt_ids(ckpt, capsys, ids, needle):
    fails_with(capsys, [ckpt, "--prompt-ids", ids], needle)


def test_no_prompt(ckpt, capsys):
    fails_with(capsys, [ckpt], "no prompt given")


def test_unknown_source(capsys):
    fails_with(capsys, ["not-a-model", "--prompt-ids", "1"], "not-a-model", "tiny-qwen2")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_gpu(capsys):
    fails_with(capsys, ["tiny-qwen2", "--prompt-ids", "1", "--device", "cuda"], "no CUDA GPU")


def test_console_prints_no_traceback(ckpt):
    """The same path through a real process: exit 2, one line on stderr."""
    edit_weights(ckpt, lambda t: t.pop("model.norm.weight"))
    r = subprocess.run(
        [sys.executable, "-m", "compiled_llm.cli.main", "run", str(ckpt), "--prompt-ids", "1,2"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert r.stderr.startswith("error: ") and "model.norm.weight" in r.stderr and "Traceback" not in r.stderr
