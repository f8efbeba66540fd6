"""Weight-only quantization (``build --quantization int8|int4``): the schemes' encodings, and
``quantize_weights``' rewrite, which must leave a program that computes exactly what the fp32
model computes with the dequantized weights (the quantization error is the only difference)."""

import dataclasses

import pytest
import torch

from compiled_llm.engine.build import build_engine, lower
from compiled_llm.errors import CompiledLLMError
from compiled_llm.graph.export import FlatProgram, param_placeholder_names
from compiled_llm.graph.quantized_ops import dequantize, int4_group_size, quantize
from compiled_llm.model.spec import forward
from compiled_llm.model.presets import PRESET_NAMES, preset_config
from compiled_llm.model.weights import random_params
from compiled_llm.passes import default_pass_names

from helpers.program_inputs import FAMILIES, mixed_batch

SCHEMES = ["int8", "int4"]


# ---- the encodings --------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_dequantized_weight_is_within_half_a_step_of_the_original(scheme):
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    q, scale, zero = quantize(w, scheme)
    back = dequantize(q, scale, zero, torch.float32)
    if scheme == "int8":
        assert q.dtype == torch.int8 and q.shape == (48, 256) and scale.shape == (48,) and zero is None
        step = scale[:, None]
    else:
        assert q.dtype == torch.uint8 and q.shape == (48, 128) and scale.shape == zero.shape == (48, 2)
        step = scale.repeat_interleave(128, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-7).all()
    assert (back - w).abs().max() < 0.02  # and the steps are small for weights of this size


@pytest.mark.parametrize("kind", ["all positive", "all negative", "constant", "tiny groups"])
def test_int4_keeps_the_range_of_groups_not_centred_on_zero(kind):
    gen = torch.Generator().manual_seed(1)
    w = {
        "all positive": torch.randn(4, 256, generator=gen) * 0.1 + 1.0,
        "all negative": torch.randn(4, 256, generator=gen) * 0.1 - 1.0,
        "constant": torch.full((2, 128), 0.5),
        "tiny groups": torch.randn(4, 6, generator=gen),  # K = 6: groups of 2, often of one sign
    }[kind]
    q, scale, zero = quantize(w, "int4")
    back = dequantize(q, scale, zero, torch.float32)
    step = scale.repeat_interleave(w.shape[1] // scale.shape[1], dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()


def test_int4_packs_the_even_k_into_the_low_nibble():
    w = torch.tensor([[0.0, 1.5, 0.7, 0.3]])  # min 0, max 1.5: zero 0, scale 0.1, codes 0, 15, 7, 3
    q, scale, zero = quantize(w, "int4")
    assert zero.item() == 0 and scale.item() == pytest.approx(0.1)
    assert q.tolist() == [[0 | 15 << 4, 7 | 3 << 4]]


def test_int4_groups_shrink_to_divide_k():
    assert [int4_group_size(k) for k in (4096, 896, 96, 6)] == [128, 128, 32, 2]
    with pytest.raises(ValueError, match="even K"):
        int4_group_size(7)


# ---- the pass -------------------------------------------------------------------------------------


def _dequantized_reference(config, params, scheme):
    """The fp32 model with every linear weight replaced by its quantize -> dequantize round trip
    (a tied lm_head too, while the embedding lookup keeps the original table)."""
    ref = dict(params)
    for name, w in params.items():
        linear = w.dim() == 2 and name.startswith("layers.") or name == "lm_head.weight"
        if linear:
            ref[name] = dequantize(*quantize(w, scheme), torch.float32)
    if config.tie_word_embeddings:
        config = dataclasses.replace(config, tie_word_embeddings=False)
        ref["lm_head.weight"] = dequantize(*quantize(params["embed.weight"], scheme), torch.float32)
    return config, ref


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_program_equals_the_model_with_dequantized_weights(family, scheme):
    config = preset_config(family)
    params = random_params(config, seed=3)
    lowered = lower(config, params, default_pass_names(), "cpu", torch.float32, quantization=scheme)
    quantize_matches = {r.name: r.matches for r in lowered.results}["quantize_weights"]
    assert quantize_matches == 3 * config.num_layers + 1  # q/k/v, o, the MLP per layer; the lm_head
    assert all(not n.startswith("layers.") or n.endswith((".qweight", ".scale", ".zero", "norm.weight", ".bias"))
               for n in lowered.params)  # no unquantized linear weight is stored

    batch, kv = mixed_batch(config, seed=5)
    got = FlatProgram(lowered.gm, param_placeholder_names(lowered.gm))(lowered.params, *batch, kv.clone())
    ref_config, ref_params = _dequantized_reference(config, params, scheme)
    want = forward(ref_config, ref_params, batch, kv.clone())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())

    # and the quantization itself changed the logits (the test would not notice a no-op pass)
    plain = forward(config, params, batch, kv.clone())
    assert not torch.allclose(got, plain, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_decode_kernels_stream_every_weight_the_pass_quantizes(family, scheme):
    """A quantized engine's decode steps never dequantize for the weights' encoding: the Triton
    kernels take every (qweight, scale, zero) the pass stores (their providers also check the
    step's size: prefill sizes dequantize and run cuBLAS)."""
    pytest.importorskip("triton")
    from compiled_llm.kernels.triton_gemv import streams_quantized

    config = preset_config(family)
    lowered = lower(config, random_params(config, seed=3), default_pass_names(), "cpu", torch.float32,
                    quantization=scheme)
    p = lowered.params
    weights = [n.removesuffix(".qweight") for n in p if n.endswith(".qweight")]
    assert weights and all(streams_quantized(p[f"{w}.qweight"], p[f"{w}.scale"], p.get(f"{w}.zero")) for w in weights)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_the_int4_decode_kernels_tile_the_groups_of_every_preset(name):
    """Every linear's K (hidden, heads x head_dim, intermediate) of the presets quantizes to int4
    groups the INT4 kernels tile (shapes only: meta tensors)."""
    pytest.importorskip("triton")
    from compiled_llm.kernels.triton_gemv import streams_quantized

    c = preset_config(name)
    for k in {c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size}:
        groups = k // int4_group_size(k)
        q = torch.empty(1, k // 2, dtype=torch.uint8, device="meta")
        scale = zero = torch.empty(1, groups, device="meta")
        assert streams_quantized(q, scale, zero), k


def test_build_records_the_scheme_and_stores_smaller_weights(tmp_path):
    plain = build_engine("tiny-llama", tmp_path / "plain", device="cpu", progress=False)
    int8 = build_engine("tiny-llama", tmp_path / "int8", device="cpu", progress=False, quantization="int8")
    assert plain["build_options"]["quantization"] is None and int8["build_options"]["quantization"] == "int8"
    assert "linear_wq" in int8["kernels"] and "fused_rms_norm_glu_mlp_wq" in int8["kernels"]
    size = {d: (tmp_path / d / "weights.safetensors").stat().st_size for d in ("plain", "int8")}
    assert size["int8"] < 0.5 * size["plain"]  # fp32 linears become int8 (the embedding stays)


def test_an_unknown_scheme_is_refused_in_one_line(tmp_path):
    with pytest.raises(CompiledLLMError, match="unknown quantization 'int3'; the choices are: int8, int4"):
        build_engine("tiny-llama", tmp_path / "e", device="cpu", progress=False, quantization="int3")
    assert not (tmp_path / "e").exists()


def test_compare_checks_a_quantized_engine_against_its_dequantized_weights(tmp_path):
    from compiled_llm.engine.compare import compare_engine

    build_engine("tiny-qwen3", tmp_path / "e", device="cpu", progress=False, quantization="int4")
    lines = []
    verdict, culprit = compare_engine(tmp_path / "e", num_prompts=2, max_tokens=8, out=lines.append)
    assert verdict.ok and culprit is None and verdict.rel_delta <= 1e-4
    assert lines[-1].startswith("PASS: vs spec on its int4-dequantized weights")
    error = next(line for line in lines if line.startswith("int4 quantization error vs the unquantized model"))
    assert "max|Δlogit| 0.000e+00" not in error  # the quantization did change the logits


def test_quantization_without_its_pass_is_refused(tmp_path):
    """Otherwise the manifest would name a scheme the weights do not have."""
    with pytest.raises(CompiledLLMError, match="needs the quantize_weights pass, which is disabled"):
        build_engine("tiny-llama", tmp_path / "e", device="cpu", progress=False, quantization="int8",
                     disabled_passes=["quantize_weights"])


def test_llm_builds_a_source_quantized_into_a_cache_entry_of_its_own(tmp_path, monkeypatch):
    from compiled_llm import LLM, SamplingParams
    from compiled_llm.engine.artifact import read_manifest
    from compiled_llm.engine.cache import engine_path

    monkeypatch.setenv("COMPILED_LLM_CACHE_DIR", str(tmp_path / "cache"))
    plain = engine_path("tiny-qwen2", device="cpu")
    int8 = engine_path("tiny-qwen2", device="cpu", quantization="int8")
    assert len({plain, int8, engine_path("tiny-qwen2", device="cpu", quantization="int4")}) == 3

    llm = LLM("tiny-qwen2", device="cpu", quantization="int8")
    assert read_manifest(int8)["build_options"]["quantization"] == "int8" and not plain.exists()
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    # the engine directory itself, asked for with another scheme, is refused in one line
    with pytest.raises(CompiledLLMError, match="was built with quantization int8, not int4"):
        LLM(str(int8), device="cpu", quantization="int4")
    with pytest.raises(CompiledLLMError, match="needs the compiled path"):
        LLM("tiny-qwen2", device="cpu", quantization="int8", enforce_eager=True)
