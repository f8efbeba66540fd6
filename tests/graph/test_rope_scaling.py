"""Rotary frequency scaling computed into the engine's cos/sin table at build: YaRN (Qwen2.5 and
Qwen3 past their original context) equals transformers' rotary embedding, and the spec equals
transformers' logits at positions beyond the original context; a scaling type not supported is
refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from compiled_llm.errors import UnsupportedArchitectureError
from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.model.config import ModelConfig, load_config
from compiled_llm.model.spec import ROPE_PARAM, derived_params, forward, kv_cache_shape
from compiled_llm.model.weights import load_params

ORIGINAL = 32


def qwen2_config(**scaling) -> transformers.Qwen2Config:
    return transformers.Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=ORIGINAL, tie_word_embeddings=False, rope_theta=10000.0,
        initializer_range=0.2,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, **scaling})


@pytest.mark.parametrize("scaling", [{}, {"beta_fast": 16.0, "beta_slow": 2.0}, {"truncate": False},
                                     {"mscale": 0.7, "mscale_all_dim": 1.0}, {"attention_factor": 1.3}])
def test_a_yarn_table_equals_transformers_rotary_embedding(tmp_path, scaling):
    hf = qwen2_config(**scaling)
    hf.save_pretrained(tmp_path)
    config = load_config(tmp_path)
    assert config.rope_scaling.rope_type == "yarn"
    assert config.max_position_embeddings == 4 * ORIGINAL  # as vLLM derives a yarn model's context
    table = derived_params(config, "cpu")[ROPE_PARAM]
    positions = torch.arange(config.max_position_embeddings)[None]
    rotary = transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding(hf)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    half = config.head_dim // 2
    torch.testing.assert_close(table, torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1), rtol=1e-6, atol=1e-6)


def test_the_spec_equals_transformers_beyond_the_original_context(tmp_path):
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(qwen2_config()).eval()
    hf.save_pretrained(tmp_path)
    config = load_config(tmp_path)
    params = load_params(config, tmp_path, torch.float32, "cpu")
    prompt = torch.randint(0, config.vocab_size, (3 * ORIGINAL,), generator=torch.Generator().manual_seed(1)).tolist()
    block = 16
    kv = torch.zeros(kv_cache_shape(config, 16, block))
    table = list(range(16))
    logits = forward(config, params, pack_batch([ScheduledSeq(prompt, 0, table)], block), kv)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    assert (logits[0] - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert logits[0].argmax() == ref.argmax()


def test_an_unsupported_rope_scaling_type_is_refused_in_one_line(tmp_path):
    hf = qwen2_config()
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    for key in ("rope_scaling", "rope_parameters"):
        if raw.get(key):
            raw[key].update(rope_type="longrope", long_factor=[1.0] * 8, short_factor=[1.0] * 8)
    path.write_text(json.dumps(raw))
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_config(tmp_path)
    assert "longrope" in str(e.value) and "yarn" in str(e.value) and "\n" not in str(e.value)


def test_a_yarn_config_survives_the_manifest_round_trip_and_bad_fields_are_named(tmp_path):
    qwen2_config(mscale=0.7, mscale_all_dim=1.0).save_pretrained(tmp_path)
    config = load_config(tmp_path)
    written = json.loads(json.dumps(config.to_dict()))
    assert ModelConfig.checked_from_dict(written) == config
    for field, value, named in [("beta_fast", None, "rope_scaling.beta_fast"), ("foo", 1, "'foo'"),
                                ("rope_type", "longrope", "rope_scaling.rope_type"),
                                ("truncate", "yes", "rope_scaling.truncate")]:
        bad = json.loads(json.dumps(written))
        bad["rope_scaling"][field] = value
        with pytest.raises(ValueError) as e:
            ModelConfig.checked_from_dict(bad)
        assert named in str(e.value) and "\n" not in str(e.value)


def test_a_built_yarn_engine_decodes_as_transformers_past_the_original_context(tmp_path):
    from compiled_llm import LLM, SamplingParams
    from compiled_llm.engine.build import build_engine
    from helpers.greedy_oracle import hf_greedy

    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(qwen2_config()).eval()
    hf.save_pretrained(tmp_path / "checkpoint")
    build_engine(str(tmp_path / "checkpoint"), tmp_path / "engine", dtype="float32", device="cpu", progress=False)
    prompt = torch.randint(0, 128, (2 * ORIGINAL,), generator=torch.Generator().manual_seed(2)).tolist()
    llm = LLM(str(tmp_path / "engine"), block_size=8)
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 24)
    assert len(set(out.outputs[0].token_ids)) >= 5  # a varied output, not one token repeated
