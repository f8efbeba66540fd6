"""Model sources: local checkpoint directories, built-in presets (real shapes, random weights,
byte-level tokenizer) and hub ids that fail clearly when the hub cannot be reached."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from compiled_llm.model.config import config_from_hf, load_config
from compiled_llm.errors import CompiledLLMError
from compiled_llm.model.spec import param_shapes
from compiled_llm.model.weights import load_params
from compiled_llm.model.presets import PRESET_NAMES, preset_config, preset_hf_config
from compiled_llm.model.sources import (
    load_source_params,
    load_source_tokenizer,
    resolve_source,
    source_eos_token_ids,
)
from helpers.hf_checkpoints import make_checkpoint

# Published parameter counts (embeddings counted once when tied). num_params() leaves out biases
# and norm weights, a < 0.1% difference at these sizes.
PUBLISHED_PARAMS = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen3-0.6b": 596_049_920,
    "llama-3.2-1b": 1_235_814_400,
    "gpt2": 124_439_808,
    "llama-3.1-8b": 8_030_261_248,
    "qwen2.5-7b": 7_615_616_512,
    "mistral-7b": 7_248_023_552,
    "phi-3-mini": 3_821_079_552,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_real_shaped_presets_have_the_published_size(name):
    src = resolve_source(name)
    assert src.preset == name and src.model_dir is None
    n = src.config.num_params()
    assert abs(n - PUBLISHED_PARAMS[name]) / PUBLISHED_PARAMS[name] < 0.002, n


def test_real_shaped_preset_numbers():
    q2 = preset_config("qwen2.5-0.5b")
    assert (q2.hidden_size, q2.intermediate_size, q2.num_layers, q2.num_heads, q2.num_kv_heads) == (896, 4864, 24, 14, 2)
    assert q2.qkv_bias and q2.tie_word_embeddings and q2.rope_theta == 1e6 and q2.max_position_embeddings == 32768
    q3 = preset_config("qwen3-0.6b")
    assert q3.qk_norm and q3.head_dim == 128 and q3.hidden_size // q3.num_heads == 64
    assert (q3.num_layers, q3.num_kv_heads, q3.max_position_embeddings) == (28, 8, 40960)
    ll = preset_config("llama-3.2-1b")
    assert ll.rope_scaling.factor == 32 and ll.rope_scaling.original_max_position_embeddings == 8192
    assert (ll.rope_theta, ll.vocab_size, ll.max_position_embeddings) == (500000.0, 128256, 131072)
    l8 = preset_config("llama-3.1-8b")
    assert (l8.head_dim, l8.num_heads // l8.num_kv_heads, l8.intermediate_size, l8.tie_word_embeddings) == (128, 4, 14336, False)
    assert l8.rope_scaling.factor == 8 and l8.rope_scaling.original_max_position_embeddings == 8192
    q7 = preset_config("qwen2.5-7b")
    assert (q7.head_dim, q7.num_heads // q7.num_kv_heads, q7.intermediate_size, q7.qkv_bias) == (128, 7, 18944, True)
    assert not q7.tie_word_embeddings and q7.vocab_size == 152064
    g = preset_config("gpt2")
    assert (g.norm_type, g.position_type, g.vocab_size, g.max_position_embeddings) == ("layer", "learned", 50257, 1024)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_preset_config_is_a_valid_transformers_config(name):
    """A preset is a real config.json: transformers accepts it and reads back the same model."""
    import transformers

    hf = preset_hf_config(name)
    model_type = hf.pop("model_type")
    via_transformers = transformers.AutoConfig.for_model(model_type, **hf).to_dict()
    via_transformers["architectures"] = hf["architectures"]
    assert config_from_hf(via_transformers) == preset_config(name)


def test_tiny_preset_params_are_seeded_and_shaped():
    src = resolve_source("tiny-qwen3")
    a = load_source_params(src, torch.float32, "cpu")
    b = load_source_params(src, torch.float32, "cpu")
    shapes = param_shapes(src.config)
    assert {k: tuple(v.shape) for k, v in a.items()} == shapes
    assert all(torch.equal(a[k], b[k]) for k in a)
    half = load_source_params(src, torch.bfloat16, "cpu")
    assert half["embed.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("name", [n for n in PRESET_NAMES if n.startswith("tiny-")])
def test_presets_tokenize_text_and_stop_on_chat_specials(name):
    src = resolve_source(name)
    tok = load_source_tokenizer(src)
    ids = tok.encode_chat("hello")
    assert max(ids) < src.config.vocab_size
    assert set(source_eos_token_ids(src, tok)) == {256, 258}  # <|endoftext|>, <|im_end|>
    assert set(src.config.eos_token_ids) == {256, 258}


def test_local_directory_source(tmp_path):
    make_checkpoint("qwen2", tmp_path)
    src = resolve_source(str(tmp_path))
    assert src.model_dir == tmp_path and src.preset is None
    assert src.config == load_config(tmp_path)
    params = load_source_params(src, torch.float32, "cpu")
    ref = load_params(src.config, tmp_path, torch.float32, "cpu")
    assert params.keys() == ref.keys() and all(torch.equal(params[k], ref[k]) for k in params)
    assert load_source_tokenizer(src) is None  # make_checkpoint writes no tokenizer


def test_generation_config_eos_ids_are_added(tmp_path):
    make_checkpoint("qwen2", tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 9]}')
    src = resolve_source(str(tmp_path))
    assert {7, 9} <= set(source_eos_token_ids(src))


@pytest.mark.parametrize(
    "source, message",
    [
        ("no-such-preset", "not a directory, a preset"),
        ("tiny_qwen2", "tiny-qwen2"),  # the message lists the presets
    ],
)
def test_unknown_source_names_the_choices(source, message):
    with pytest.raises(CompiledLLMError, match=message):
        resolve_source(source)


def test_file_is_not_a_source(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(CompiledLLMError, match="is a file"):
        resolve_source(str(f))


def test_hub_id_offline_says_to_pass_a_local_directory(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.monotonic()
    with pytest.raises(CompiledLLMError, match="local checkpoint directory") as e:
        resolve_source("compiled-llm-tests/no-such-model-7f3a")
    assert "HF_HUB_OFFLINE" in str(e.value)
    assert time.monotonic() - t0 < 10


def test_hub_id_unreachable_fails_fast_through_the_cli(tmp_path):
    """With the hub endpoint pointing at a closed port the download attempt fails in seconds."""
    env = dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    env.pop("HF_HUB_OFFLINE", None)
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "compiled_llm.cli.main", "run", "compiled-llm-tests/no-such-model-7f3a",
         "--prompt-ids", "1,2"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:")
    assert "no-such-model-7f3a" in lines[0] and "local checkpoint directory" in lines[0]
    assert time.monotonic() - t0 < 60
