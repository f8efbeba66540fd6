"""The model families (``model/families/``): every family in the registry reads the checkpoint
transformers itself writes for it, config and every weight, with or without ``architectures`` in
its config.json; and a checkpoint of any other family is refused in one line that names the
supported ones. (That the weights compute transformers' logits is tests/test_spec_parity.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from compiled_llm.errors import UnsupportedArchitectureError
from compiled_llm.model.config import config_from_hf, load_config
from compiled_llm.model.families import FAMILIES, SUPPORTED_ARCHITECTURES, architecture_of, family_of
from compiled_llm.model.families.base import TensorName
from compiled_llm.model.spec import derived_params, param_shapes
from compiled_llm.model.weights import checkpoint_files, checkpoint_name, expert_rows, expert_slot, load_params
from helpers.hf_checkpoints import make_checkpoint

FAMILY_NAMES = [f.name for f in FAMILIES]


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def written(request, tmp_path_factory):
    """(family name, checkpoint directory, the transformers model that wrote it)."""
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, make_checkpoint(request.param, d)


def test_each_family_reads_the_config_transformers_writes(written):
    name, d, hf = written
    config = load_config(d)
    assert family_of(config.architecture).name == name
    assert config.architecture == type(hf).__name__
    c = hf.config.get_text_config()  # transformers' own names (GPT-2's n_embd, n_layer... answer to these too)
    assert (config.vocab_size, config.hidden_size, config.num_layers, config.num_heads, config.max_position_embeddings) == (
        c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.max_position_embeddings)
    tied = hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    assert config.tie_word_embeddings == tied
    # every matrix transformers built, counted once when shared: the head and MLP sizes, the
    # KV heads and the head_dim have to be right for the counts to agree
    # (transformers keeps a mixture's experts stacked, one 3-D tensor each for gate/up and down)
    matrices = sum(p.numel() for name, p in hf.named_parameters() if p.dim() >= 2 and not _beside_the_decoder(name))
    assert config.num_params() == matrices


def _beside_the_decoder(name: str) -> bool:
    """A multimodal checkpoint's tensors the engine drops (text in, text out)."""
    return "vision_tower" in name or "multi_modal_projector" in name


def test_a_config_that_gives_only_a_model_type_reads_the_same(written, tmp_path):
    _, d, hf = written
    for f in d.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    raw = json.loads((d / "config.json").read_text())
    del raw["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_config(tmp_path) == load_config(d)


def test_each_family_reads_every_weight_transformers_writes(written):
    _, d, _ = written
    config = load_config(d)
    family = family_of(config.architecture)
    params = load_params(config, d)
    assert set(params) == set(param_shapes(config))
    derived = derived_params(config, "cpu")
    from_checkpoint = {n for n in params if n not in derived}
    read = set()
    for file in checkpoint_files(d):
        with safe_open(str(file), framework="pt") as sf:
            for stored in sf.keys():
                if family.spec_name(stored) is None:  # read and dropped: a vision tower's
                    assert _beside_the_decoder(stored), stored
                    continue
                tensor = sf.get_tensor(stored)
                names = family.spec_params(family.spec_name(stored))
                slot = expert_slot(names[0], param_shapes(config))
                if slot is not None:  # one expert's projection: a slice of the stacked experts
                    stacked, expert, proj, _ = slot
                    assert checkpoint_name(config, names[0]) == stored
                    assert torch.equal(params[stacked][expert_rows(expert, proj, tensor.shape[0])], tensor), stored
                    read.add(stacked)
                    continue
                read.update(names)
                # the error for a missing tensor names the one transformers wrote
                assert {checkpoint_name(config, n) for n in names} == {stored}
                # each value lands in the spec once, whatever the layout (transposed, split);
                # Gemma's norms scale by 1 + w, which the loader adds
                values = torch.cat([params[n].flatten() for n in names])
                if names[0].split(".")[-2].endswith("norm"):
                    tensor = tensor + family.norm_offset
                assert torch.equal(values.sort().values, tensor.flatten().sort().values), stored
    assert read == from_checkpoint


@pytest.mark.parametrize("raw", [
    {"model_type": "olmo2"},
    {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2"},
])
def test_an_unknown_family_is_refused_in_one_line_naming_the_supported_ones(tmp_path, raw):
    (tmp_path / "config.json").write_text(json.dumps({**raw, "vocab_size": 32, "hidden_size": 8}))
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_config(tmp_path)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"unsupported architecture {(raw.get('architectures') or ['olmo2'])[0]!r}")
    for family in FAMILIES:
        assert all(a in message for a in family.architectures), family.name


def test_the_registry_names_each_model_type_and_architecture_once():
    model_types = [t for f in FAMILIES for t in f.model_types]
    assert len(model_types) == len(set(model_types))
    assert sorted(SUPPORTED_ARCHITECTURES) == sorted(a for f in FAMILIES for a in f.architectures)
    assert len(SUPPORTED_ARCHITECTURES) == len(set(SUPPORTED_ARCHITECTURES))
    for f in FAMILIES:
        for t in f.model_types:
            assert architecture_of({"model_type": t}) == f.architectures[0]


def test_a_tensor_name_reads_both_ways():
    rule = TensorName("model.layers.{layer}.mlp.{proj:gate|up}_proj.weight", "layers.{layer}.{proj}.weight")
    assert rule.to_spec("model.layers.12.mlp.up_proj.weight") == "layers.12.up.weight"
    assert rule.to_checkpoint("layers.3.gate.weight") == "model.layers.3.mlp.gate_proj.weight"
    assert rule.to_spec("model.layers.1.mlp.down_proj.weight") is None  # not an alternative
    assert rule.to_spec("model.layers.x.mlp.up_proj.weight") is None  # a layer is a number
    assert rule.to_spec("model.layers.1.mlp.up_proj.weight.extra") is None  # the whole name


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_a_window_shorter_than_the_context_slides_on_every_layer(tmp_path, family):
    """Mistral 7B v0.1 attends within 4,096 tokens of a 32k context, Phi-3 4k within 2,047: the
    context stays the model's, and every layer gets the window; a window no shorter than the
    context is full attention."""
    make_checkpoint(family, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["sliding_window"] = 48
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load_config(tmp_path)
    assert config.max_position_embeddings == raw["max_position_embeddings"]
    assert [config.layer_window(n) for n in range(config.num_layers)] == [48] * config.num_layers
    assert config.kv_window == 48
    raw["sliding_window"] = 4096  # longer than the context
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load_config(tmp_path)
    assert config.sliding_window is None and config.kv_window is None


@pytest.mark.parametrize("family,kinds", [("gemma2", ["sliding", "full"]), ("gemma3", ["sliding", "sliding", "full"])])
def test_gemma_alternates_sliding_and_global_layers(tmp_path, family, kinds):
    make_checkpoint(family, tmp_path)
    config = load_config(tmp_path)
    assert [("sliding" if config.layer_window(n) else "full") for n in range(config.num_layers)] == kinds
    assert config.kv_window is None  # a global layer reads the whole context: no block may go
    assert config.embed_scale and config.sandwich_norms and config.mlp_type == "gelu_tanh_glu"
    if family == "gemma2":
        assert (config.attn_softcap, config.final_softcap, config.rope_local_theta) == (50.0, 30.0, None)
    else:
        assert (config.attn_softcap, config.rope_local_theta, config.rope_scaling.rope_type) == (None, 10000.0, "linear")


def test_gemma_configs_transformers_did_not_complete_get_its_layer_kinds():
    """A config.json as published (no layer_types): Gemma 2 slides on every other layer from
    the first, Gemma 3 on five of six (sliding_window_pattern)."""
    base = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 8}
    gemma2 = config_from_hf({**base, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"})
    assert [gemma2.layer_window(n) for n in range(6)] == [8, 0, 8, 0, 8, 0]
    gemma3 = config_from_hf({**base, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                             "sliding_window_pattern": 3, "rope_local_base_freq": 10000.0, "rope_theta": 1e6})
    assert [gemma3.layer_window(n) for n in range(6)] == [8, 8, 0, 8, 8, 0]
    with pytest.raises(UnsupportedArchitectureError, match="activation 'relu'"):
        config_from_hf({**base, "architectures": ["Gemma2ForCausalLM"], "hidden_activation": "relu"})


def test_rotary_embeddings_over_part_of_each_head_are_refused_in_one_line(tmp_path):
    make_checkpoint("phi3", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["partial_rotary_factor"] = 0.75  # Phi-4-mini
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedArchitectureError, match="partial_rotary_factor 0.75"):
        load_config(tmp_path)
