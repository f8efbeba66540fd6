"""Sampling defaults from a checkpoint's generation_config.json, as vLLM's
``--generation-config auto``: the fields the file sets among temperature, top_p, top_k, min_p,
repetition_penalty and max_new_tokens (as max_tokens), whatever its do_sample says, become
``LLM.get_default_sampling_params()``, which every request without a SamplingParams uses. An
engine carries them, and the file's EOS ids, in its manifest, so it runs without the checkpoint;
a bad value is left out with a warning naming it; an engine from before them loads without."""

import dataclasses
import json
import logging
import math
import shutil

import pytest
import transformers

from compiled_llm import LLM, SamplingParams
from compiled_llm.engine import artifact
from compiled_llm.engine.build import build_engine
from compiled_llm.errors import EngineError, InvalidRequestError
from compiled_llm.model.sources import checked_generation_default
from helpers.greedy_oracle import hf_greedy, lively_checkpoint
from helpers.hf_checkpoints import make_checkpoint

# What a model creator might recommend, written by transformers' own GenerationConfig.
RECOMMENDED = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
               "repetition_penalty": 1.1, "max_new_tokens": 24}
# The same under SamplingParams' names.
DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_tokens": 24}
GENERATION_EOS = [5, 7]
PROMPT = [3, 17, 42, 8, 99]


def build(source, out):
    return build_engine(str(source), out, dtype="float32", device="cpu", progress=False)


@pytest.fixture(scope="module")
def recommended_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("recommended") / "checkpoint"
    make_checkpoint("qwen2", path)
    transformers.GenerationConfig(**RECOMMENDED, eos_token_id=GENERATION_EOS).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def recommended_engine(recommended_checkpoint, tmp_path_factory):
    """Built from a copy of the checkpoint that is deleted afterwards: nothing the engine
    knows can come from the checkpoint at load time."""
    root = tmp_path_factory.mktemp("recommended_engine")
    copy = shutil.copytree(recommended_checkpoint, root / "checkpoint")
    build(copy, root / "engine")
    shutil.rmtree(copy)
    return root / "engine"


def write_generation_config(path, text: str) -> None:
    (path / "generation_config.json").write_text(text)


# --- the engine carries them ---------------------------------------------------------------------


def test_engine_manifest_holds_the_generation_config(recommended_engine):
    manifest = artifact.read_manifest(recommended_engine)
    assert manifest["generation_config"] == {"defaults": DEFAULTS, "eos_token_ids": GENERATION_EOS}


def test_llm_on_the_engine_defaults_to_the_checkpoint_values(recommended_engine):
    llm = LLM(str(recommended_engine), device="cpu")
    assert llm.model.generation_defaults == DEFAULTS
    params = llm.get_default_sampling_params()
    assert {name: getattr(params, name) for name in DEFAULTS} == DEFAULTS
    # every field the file does not set keeps vLLM's default
    plain = SamplingParams()
    assert dataclasses.replace(params, **{name: getattr(plain, name) for name in DEFAULTS}) == plain
    assert set(GENERATION_EOS) <= set(llm.model.eos_token_ids)


def test_eager_source_reads_the_same_defaults(recommended_checkpoint):
    llm = LLM(str(recommended_checkpoint), device="cpu", enforce_eager=True)
    assert llm.model.generation_defaults == DEFAULTS
    assert set(GENERATION_EOS) <= set(llm.model.eos_token_ids)


def test_presets_have_no_generation_defaults(tiny_engine):
    assert artifact.read_manifest(tiny_engine)["generation_config"] == {"defaults": {}, "eos_token_ids": []}
    assert LLM(str(tiny_engine), device="cpu").get_default_sampling_params() == SamplingParams()


# --- requests without SamplingParams use them ----------------------------------------------------


@pytest.fixture(scope="module")
def greedy_by_default(tmp_path_factory):
    """A checkpoint whose generation_config.json asks for greedy 5-token answers; do_sample
    false does not stop vLLM from taking its values, nor us."""
    path = tmp_path_factory.mktemp("greedy_by_default")
    hf = lively_checkpoint("qwen2", path)
    write_generation_config(path, json.dumps({"do_sample": False, "temperature": 0.0, "max_new_tokens": 5}))
    return LLM(str(path), device="cpu", enforce_eager=True), hf


def test_generate_without_sampling_params_uses_the_defaults(greedy_by_default):
    llm, hf = greedy_by_default
    assert llm.get_default_sampling_params().temperature == 0.0
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], use_tqdm=False)
    assert out.token_ids == hf_greedy(hf, PROMPT, 5) and out.finish_reason == "length"


def test_stream_without_sampling_params_uses_the_defaults(greedy_by_default):
    llm, hf = greedy_by_default
    stream = llm.stream({"prompt_token_ids": PROMPT})
    list(stream)
    assert stream.output.token_ids == hf_greedy(hf, PROMPT, 5)


def test_explicit_sampling_params_are_used_as_given(greedy_by_default):
    llm, hf = greedy_by_default
    (greedy,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=9), use_tqdm=False)
    assert greedy.token_ids == hf_greedy(hf, PROMPT, 9)
    (plain,) = llm.generate([PROMPT], SamplingParams(), use_tqdm=False)  # vLLM's 16 tokens, not the file's 5
    assert len(plain.token_ids) == SamplingParams().max_tokens


def test_a_list_of_sampling_params_takes_the_defaults_where_it_holds_none(greedy_by_default):
    llm, hf = greedy_by_default
    outs = llm.generate([PROMPT, PROMPT], [None, SamplingParams(temperature=0.0, max_tokens=3)], use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, PROMPT, 5), hf_greedy(hf, PROMPT, 3)]


# --- bad values ----------------------------------------------------------------------------------


def test_bad_values_are_left_out_with_a_warning_naming_them(tmp_path, caplog):
    make_checkpoint("qwen2", tmp_path / "checkpoint")
    bad = {"temperature": float("nan"), "top_p": "0.9", "top_k": 2.5, "repetition_penalty": 0, "max_new_tokens": 0}
    write_generation_config(tmp_path / "checkpoint", json.dumps({**bad, "min_p": 0.1}))
    with caplog.at_level(logging.WARNING, logger="compiled_llm.model.sources"):
        manifest = build(tmp_path / "checkpoint", tmp_path / "engine")
    assert manifest["generation_config"]["defaults"] == {"min_p": 0.1}
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    for key in bad:
        assert f"ignoring {key}=" in warned
    assert LLM(str(tmp_path / "engine"), device="cpu").get_default_sampling_params().min_p == 0.1


def test_an_unreadable_generation_config_is_a_warning_not_a_failure(tmp_path, caplog):
    make_checkpoint("qwen2", tmp_path)
    write_generation_config(tmp_path, '{"temperature": 0.7,')
    with caplog.at_level(logging.WARNING, logger="compiled_llm.model.sources"):
        llm = LLM(str(tmp_path), device="cpu", enforce_eager=True)
    assert llm.model.generation_defaults == {}
    assert any("generation_config.json is not readable JSON" in r.getMessage() for r in caplog.records)


# The values that decide each field's range, and a few that are not numbers at all.
CANDIDATES = [-2, -1, 0, 1, 2, 20, 0.0, 0.05, 0.5, 1.0, 1.5, -0.5, 20.0, 2.5, float("nan"), float("inf"),
              True, "0.5", [1]]


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_accepted_defaults_are_exactly_the_values_sampling_params_takes(name):
    for value in CANDIDATES:
        try:
            checked = checked_generation_default(name, value)
        except ValueError:
            with pytest.raises(InvalidRequestError):
                SamplingParams(**{name: value})
        else:
            assert getattr(SamplingParams(**{name: checked}), name) == checked
            assert checked == value and not math.isnan(checked)


# --- engines from before, and manifests that are not what a build writes -------------------------


def test_engine_without_generation_config_entry_loads_with_no_defaults(tiny_engine_copy):
    path = tiny_engine_copy / artifact.MANIFEST
    manifest = json.loads(path.read_text())
    del manifest["generation_config"]
    path.write_text(json.dumps(manifest))
    llm = LLM(str(tiny_engine_copy), device="cpu")
    assert llm.model.generation_defaults == {}
    assert llm.get_default_sampling_params() == SamplingParams()
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("entry", [
    {"defaults": {"temperature": -1.0}, "eos_token_ids": []},  # a value SamplingParams refuses
    {"defaults": {"seed": 3}, "eos_token_ids": []},  # not a generation default
    {"defaults": {"top_k": 20.0}, "eos_token_ids": []},  # a build stores integers as integers
    {"defaults": {"temperature": True}, "eos_token_ids": []},
    {"defaults": {}, "eos_token_ids": ["7"]},
    {"defaults": {}},
    {"defaults": {}, "eos_token_ids": [], "chat_template": "{{ x }}"},
    ["temperature", 0.7],
])
def test_malformed_generation_config_entry_is_refused(tiny_engine_copy, entry):
    path = tiny_engine_copy / artifact.MANIFEST
    manifest = json.loads(path.read_text())
    manifest["generation_config"] = entry
    path.write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match="malformed 'generation_config'"):
        LLM(str(tiny_engine_copy), device="cpu")
