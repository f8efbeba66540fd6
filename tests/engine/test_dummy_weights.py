"""--load-format dummy: an engine that stores no weight matrices and makes them, random, at load
(vLLM's dummy format: speed at real shapes without a checkpoint's disk)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from compiled_llm import LLM, SamplingParams
from compiled_llm.engine.build import build_engine
from compiled_llm.engine.build_config import BuildConfig
from compiled_llm.errors import EngineError, InvalidOptionError
from compiled_llm.model.spec import is_derived


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    d = tmp_path_factory.mktemp("dummy")
    for fmt in ("auto", "dummy"):
        build_engine("tiny-qwen3-moe", d / fmt, dtype="float32", device="cpu", progress=False, load_format=fmt)
    return d


def test_a_dummy_engine_stores_no_matrix_but_the_derived_tables(engines):
    with safe_open(str(engines / "dummy" / "weights.safetensors"), framework="pt") as f:
        stored = {n: f.get_slice(n).get_shape() for n in f.keys()}
    assert stored and all(len(shape) < 2 or is_derived(name) for name, shape in stored.items())
    assert any(name.endswith("norm.weight") for name in stored)


def test_a_dummy_engine_loads_every_weight_at_the_real_shapes_and_generates_the_same_each_load(engines):
    real = LLM(str(engines / "auto"))
    shapes = {n: (t.shape, t.dtype) for n, t in real.model.params.items()}
    real.shutdown()
    prompt = {"prompt_token_ids": [5, 9, 2, 7, 1]}
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = []
    for _ in range(2):
        llm = LLM(str(engines / "dummy"))
        try:
            assert {n: (t.shape, t.dtype) for n, t in llm.model.params.items()} == shapes
            experts = llm.model.params["layers.1.experts.gate_up.weight"]
            assert abs(experts.std().item() - 0.02) < 0.002  # initialised as transformers' linears
            outs.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
        finally:
            llm.shutdown()
    assert outs[0] == outs[1] and len(outs[0]) == 8


def test_dummy_weights_cannot_be_quantized_and_an_unknown_format_is_named():
    with pytest.raises(InvalidOptionError, match="load_format dummy stores no weights to quantize"):
        BuildConfig(load_format="dummy", quantization="int8")
    with pytest.raises(InvalidOptionError, match="unknown load_format 'pt'; the choices are: auto, dummy"):
        BuildConfig(load_format="pt")


def test_the_build_command_takes_load_format():
    from compiled_llm.cli.main import make_parser

    args = make_parser().parse_args(["build", "tiny-qwen2", "-o", "/tmp/x", "--load-format", "dummy"])
    assert args.load_format == "dummy"


def test_a_dummy_engine_counts_the_weights_its_load_makes(engines):
    from compiled_llm.engine.artifact import loaded_weight_bytes

    # the kernel warm-up sizes its processes by this: what a load holds, not the file's size
    llm = LLM(str(engines / "dummy"))
    held = sum(t.numel() * t.element_size() for t in llm.model.params.values())
    llm.shutdown()
    assert loaded_weight_bytes(engines / "dummy") == held == loaded_weight_bytes(engines / "auto")
    assert held > 4 * (engines / "dummy" / "weights.safetensors").stat().st_size


def _edited_copy(src, dst, edit):
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    edit(manifest)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_a_dummy_engine_whose_config_was_edited_is_refused_naming_the_matrix(engines, tmp_path):
    def smaller_experts(m):
        m["model_config"]["moe_intermediate_size"] = 32

    engine = _edited_copy(engines / "dummy", tmp_path / "e", smaller_experts)
    with pytest.raises(EngineError, match="records the matrix 'layers.1.experts.down.weight' as .*64, 48.*"
                                          "the model config implies .*64, 32"):
        LLM(str(engine))


def test_an_engine_whose_load_format_was_flipped_to_dummy_is_refused(engines, tmp_path):
    def dummy(m):
        m["build_options"]["load_format"] = "dummy"

    engine = _edited_copy(engines / "auto", tmp_path / "e", dummy)
    with pytest.raises(EngineError, match="holds the matrix .* that a dummy engine makes at load"):
        LLM(str(engine))


def test_a_dummy_engine_shards_over_two_ranks_each_making_its_own_slices(tmp_path):
    build_engine("tiny-qwen3-moe", tmp_path / "tp2", dtype="float32", device="cpu", progress=False,
                 load_format="dummy", tensor_parallel_size=2)
    llm = LLM(str(tmp_path / "tp2"))
    try:
        experts = llm.model.params["layers.1.experts.down.weight"]
        assert experts.shape[-1] == llm.model.config.moe_intermediate_size  # rank 0's half of the columns
        out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=6, temperature=0.0,
                                                                           ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 6
    finally:
        llm.shutdown()


def test_a_dummy_matrix_depends_on_its_name_alone_so_every_pipeline_stage_makes_the_unsplit_models_layers():
    from compiled_llm.engine import dummy_weights

    expected = {"layers.0.w": ("float32", (4, 3)), "layers.1.w": ("float32", (4, 3))}
    alone = dummy_weights.make(["layers.1.w"], expected, torch.device("cpu"))
    after_another = dummy_weights.make(["layers.0.w", "layers.1.w"], expected, torch.device("cpu"))
    assert torch.equal(alone["layers.1.w"], after_another["layers.1.w"])
    assert not torch.equal(after_another["layers.0.w"], after_another["layers.1.w"])
    assert abs(float(after_another["layers.0.w"].std()) - dummy_weights.STD) < 0.015
