"""Rotary frequency scaling computed into the engine's cos/sin table at build: YaRN (Qwen2.5 and
Qwen3 past their original context), linear (Gemma 3's global layers) and LongRoPE (Phi-3 128k,
Phi-3.5: short factors below the original context, long ones from it on) equal transformers'
rotary embedding, and the spec equals transformers' logits at positions beyond the original
context; a scaling type not supported is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from compiled_llm.errors import UnsupportedArchitectureError
from compiled_llm.graph import ops
from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.model.config import ModelConfig, config_from_hf, load_config
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
            raw[key].update(rope_type="dynamic")
    path.write_text(json.dumps(raw))
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_config(tmp_path)
    message = str(e.value)
    assert "'dynamic'" in message and "\n" not in message
    assert all(name in message for name in ("llama3", "yarn", "linear", "longrope"))


def test_a_yarn_config_survives_the_manifest_round_trip_and_bad_fields_are_named(tmp_path):
    qwen2_config(mscale=0.7, mscale_all_dim=1.0).save_pretrained(tmp_path)
    config = load_config(tmp_path)
    written = json.loads(json.dumps(config.to_dict()))
    assert ModelConfig.checked_from_dict(written) == config
    for field, value, named in [("beta_fast", None, "rope_scaling.beta_fast"), ("foo", 1, "'foo'"),
                                ("rope_type", "dynamic", "rope_scaling.rope_type"),
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


# --- linear and LongRoPE ------------------------------------------------------------------------

LONG = 4 * ORIGINAL  # the longrope checkpoints' max_position_embeddings
HALF = 8  # head_dim 16: one factor per rotated pair


def longrope_factors() -> tuple[list[float], list[float]]:
    """Short and long factors unlike each other and unlike 1, as Phi-3's are."""
    gen = torch.Generator().manual_seed(5)
    return (1 + torch.rand(HALF, generator=gen)).tolist(), (1 + 8 * torch.rand(HALF, generator=gen)).tolist()


def phi3_config(**rope) -> transformers.Phi3Config:
    short, long = longrope_factors()
    return transformers.Phi3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=LONG, original_max_position_embeddings=ORIGINAL,
        tie_word_embeddings=False, sliding_window=None, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short,
                                         "long_factor": long, **rope})


def hf_cos_sin(rotary, positions: int) -> torch.Tensor:
    """transformers' cos/sin for a sequence of ``positions`` tokens, in our table's layout."""
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(positions)[None])
    half = cos.shape[-1] // 2
    return torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1)


@pytest.mark.parametrize("rope", [{}, {"attention_factor": 1.3}, {"factor": 2.0}])
def test_a_longrope_table_is_transformers_short_factors_within_the_original_context_and_long_ones_beyond(
        tmp_path, rope):
    hf = phi3_config(**rope)
    hf.save_pretrained(tmp_path)
    config = load_config(tmp_path)
    assert config.rope_scaling.rope_type == "longrope" and config.max_position_embeddings == LONG
    table = derived_params(config, "cpu")[ROPE_PARAM]
    assert table.shape == (LONG, 16) and table.dtype == torch.float32
    rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(hf)
    # a sequence past the original context: transformers takes the long factors for all of it
    long = hf_cos_sin(rotary, LONG)
    torch.testing.assert_close(table[ORIGINAL:], long[ORIGINAL:], rtol=1e-6, atol=1e-6)
    # one within it: the short factors
    short = hf_cos_sin(rotary, ORIGINAL)
    torch.testing.assert_close(table[:ORIGINAL], short, rtol=1e-6, atol=1e-6)
    assert (table[:ORIGINAL] - long[:ORIGINAL]).abs().max() > 0.1  # the two really differ
    # the frequencies and the factor, to the bit: float32 in transformers' order of operations
    init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["longrope"]
    for seq_len, factors in ((ORIGINAL, config.rope_scaling.short_factor),
                             (ORIGINAL + 1, config.rope_scaling.long_factor)):
        inv_freq, attention_factor = init(hf, seq_len=seq_len)
        assert torch.equal(ops.longrope_inv_freq(16, config.rope_theta, factors), inv_freq)
        assert ops.longrope_attention_factor(config.rope_scaling) == attention_factor


def test_a_linear_table_equals_transformers_linear_scaling(tmp_path):
    hf = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=LONG, rope_theta=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0})
    hf.save_pretrained(tmp_path)
    config = load_config(tmp_path)
    assert (config.rope_scaling.rope_type, config.rope_scaling.factor) == ("linear", 8.0)
    table = derived_params(config, "cpu")[ROPE_PARAM]
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf)
    torch.testing.assert_close(table, hf_cos_sin(rotary, LONG), rtol=1e-6, atol=1e-6)
    inv_freq, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["linear"](hf)
    assert torch.equal(ops.linear_inv_freq(16, config.rope_theta, config.rope_scaling)[0], inv_freq)
    # one eighth of the unscaled frequencies: position 8p rotates as p did
    plain = ops.rope_cos_sin(16, LONG, config.rope_theta)
    torch.testing.assert_close(table[8 * torch.arange(LONG // 8)], plain[:LONG // 8], rtol=1e-5, atol=1e-5)


def test_rope_parameters_nested_by_layer_type_give_the_full_attention_layers_scaling():
    """transformers 5 writes Gemma 3's rope_parameters per layer type: linear on the global
    layers, none on the sliding ones (whose theta is rope_local_theta, unscaled)."""
    from compiled_llm.model.families.base import rope_fields

    hf = transformers.Gemma3TextConfig(rope_scaling={"rope_type": "linear", "factor": 8.0}).to_dict()
    assert set(hf["rope_parameters"]) == {"full_attention", "sliding_attention"}
    fields = rope_fields(hf)
    assert fields["rope_theta"] == 1e6 and fields["rope_scaling"]["rope_type"] == "linear"
    assert fields["rope_scaling"]["factor"] == 8.0
    hf["rope_parameters"]["sliding_attention"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    with pytest.raises(UnsupportedArchitectureError, match="sliding-attention"):
        rope_fields(hf)


def phi3_json(**keys) -> dict:
    """A Phi-3 128k config.json at a small size, with ``keys`` for its rope fields."""
    return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 128, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": LONG, "rms_norm_eps": 1e-5, "sliding_window": LONG, **keys}


def test_an_old_su_config_and_a_transformers_5_one_read_as_the_same_longrope():
    short, long = longrope_factors()
    old = config_from_hf(phi3_json(  # Phi-3-mini-128k's first config.json
        rope_theta=10000.0, original_max_position_embeddings=ORIGINAL,
        rope_scaling={"type": "su", "short_factor": short, "long_factor": long}))
    new = config_from_hf(phi3_json(rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": ORIGINAL,
        "short_factor": short, "long_factor": long, "partial_rotary_factor": 1.0}))
    assert old == new and hash(old) == hash(new)
    scaling = new.rope_scaling
    assert (scaling.rope_type, scaling.original_max_position_embeddings, scaling.factor) == ("longrope", ORIGINAL, 4.0)
    assert scaling.short_factor == tuple(short) and scaling.long_factor == tuple(long)
    assert new.max_position_embeddings == LONG  # the long context is max_position_embeddings already


def test_an_old_su_config_json_loads_from_its_directory(tmp_path):
    """transformers 5 itself refuses to read Phi-3's first 128k config.json ("su"): the loader
    respells it first, and reads what config_from_hf reads from the raw file."""
    short, long = longrope_factors()
    raw = phi3_json(rope_theta=10000.0, original_max_position_embeddings=ORIGINAL,
                    rope_scaling={"type": "su", "short_factor": short, "long_factor": long})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    loaded, read = load_config(tmp_path), config_from_hf(raw)  # (transformers adds Phi-3's default token ids)
    assert loaded.rope_scaling == read.rope_scaling and loaded.rope_scaling.rope_type == "longrope"
    assert loaded.max_position_embeddings == read.max_position_embeddings == LONG


def test_phi3s_top_level_original_context_wins_over_the_rope_parameters_one():
    short, long = longrope_factors()
    config = config_from_hf(phi3_json(original_max_position_embeddings=ORIGINAL, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": LONG,
        "short_factor": short, "long_factor": long}))
    assert config.rope_scaling.original_max_position_embeddings == ORIGINAL  # as transformers reads it


def test_an_unsupported_type_under_either_key_is_refused_in_one_line():
    for keys in ({"rope_scaling": {"type": "dynamic", "factor": 2.0}},
                 {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}):
        with pytest.raises(UnsupportedArchitectureError) as e:
            config_from_hf(phi3_json(**keys))
        assert "'dynamic'" in str(e.value) and "longrope" in str(e.value) and "\n" not in str(e.value)


def test_a_longrope_config_survives_the_manifest_round_trip_and_bad_factors_are_named(tmp_path):
    phi3_config().save_pretrained(tmp_path)
    config = load_config(tmp_path)
    written = json.loads(json.dumps(config.to_dict()))
    assert ModelConfig.checked_from_dict(written) == config
    for field, value, named in [("long_factor", None, "rope_scaling.long_factor"),
                                ("short_factor", "1.0", "rope_scaling.short_factor"),
                                ("short_factor", [], "rope_scaling.short_factor"),
                                ("long_factor", [1.0] * 3 + [-1.0] + [1.0] * 4, "rope_scaling.long_factor[3]"),
                                ("long_factor", [1.0] * 7 + [float("nan")], "rope_scaling.long_factor[7]"),
                                ("long_factor", [1.0] * 100_000, "rope_scaling.long_factor"),
                                ("long_factor", [1.0] * 6, "rope_scaling.long_factor")]:
        bad = json.loads(json.dumps(written))
        bad["rope_scaling"][field] = value
        with pytest.raises(ValueError) as e:
            ModelConfig.checked_from_dict(bad)
        assert named in str(e.value) and "\n" not in str(e.value)
    missing = json.loads(json.dumps(written))
    del missing["rope_scaling"]["long_factor"]
    with pytest.raises(ValueError, match=r"rope_scaling\.long_factor"):
        ModelConfig.checked_from_dict(missing)


def test_an_eager_longrope_phi3_decodes_as_transformers_within_the_original_context(tmp_path):
    from compiled_llm import LLM, SamplingParams
    from helpers.greedy_oracle import hf_greedy

    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(phi3_config()).eval()
    hf.save_pretrained(tmp_path)
    # 16 + 16 tokens: transformers' last forward reaches position 30, so it keeps the short factors
    prompt = torch.randint(0, 128, (ORIGINAL // 2,), generator=torch.Generator().manual_seed(6)).tolist()
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", enforce_eager=True, block_size=8)
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 16)
    assert len(set(out.outputs[0].token_ids)) >= 5  # a varied output, not one token repeated
