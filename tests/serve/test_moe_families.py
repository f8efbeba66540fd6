"""Qwen3-MoE and Mixtral checkpoints written by transformers build into engines whose greedy
output is transformers' own: batched, chunked, preempted and prefix-cached, on one rank and on
two (gloo)."""

from __future__ import annotations

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.engine.build import build_engine
from helpers.greedy_oracle import hf_greedy, lively_checkpoint


# two ranks split each expert's columns (and the attention's heads), all-reducing the mixture
@pytest.mark.parametrize("family,tensor_parallel_size", [("qwen3_moe", 1), ("mixtral", 1), ("qwen3_moe", 2)])
def test_a_built_mixture_of_experts_decodes_as_transformers(tmp_path, family, tensor_parallel_size):
    hf = lively_checkpoint(family, tmp_path / "checkpoint")
    build_engine(str(tmp_path / "checkpoint"), tmp_path / "engine", dtype="float32", device="cpu", progress=False,
                 tensor_parallel_size=tensor_parallel_size)
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 256, (20,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 17, 40, 9, 60, 1)]
    llm = LLM(str(tmp_path / "engine"), block_size=8, max_num_batched_tokens=32, enable_prefix_caching=True,
              num_blocks=14)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 16)
        assert len({t for o in outs for t in o.outputs[0].token_ids}) >= 8  # varied outputs
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.stats.hit_tokens > 0
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()


@pytest.mark.parametrize("change, field", [
    (dict(num_experts=0), "num_experts"), (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(moe_layers=[5]), "moe_layers"), (dict(moe_layers=[1, 1]), "moe_layers"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size"), (dict(moe_layers=[], num_experts=4), "num_experts"),
    (dict(num_experts=1024, num_layers=64, moe_layers=list(range(64))), "has 1024 experts"),
])
def test_a_manifest_whose_experts_do_not_add_up_is_refused_naming_the_field(change, field):
    from compiled_llm.model.config import ModelConfig
    from compiled_llm.model.presets import preset_config

    written = preset_config("tiny-qwen3-moe").to_dict()
    assert ModelConfig.checked_from_dict(dict(written)) == preset_config("tiny-qwen3-moe")
    with pytest.raises(ValueError, match=f"model_config {field}"):
        ModelConfig.checked_from_dict({**written, **change})


def _rewrite_checkpoint(d, edit):
    from safetensors.torch import load_file, save_file
    path = d / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"),
     "missing tensor 'model.layers.1.mlp.experts.3.up_proj.weight'"),
    (lambda t: t.update({"model.layers.1.mlp.experts.0.down_proj.weight": torch.zeros(3, 3)}),
     "'model.layers.1.mlp.experts.0.down_proj.weight' has shape \\(3, 3\\)"),
    (lambda t: t["model.layers.1.mlp.experts.2.gate_proj.weight"].fill_(float("nan")),
     "'model.layers.1.mlp.experts.2.gate_proj.weight' .* NaN"),
])
def test_a_checkpoint_with_a_bad_expert_tensor_is_refused_naming_it(tmp_path, edit, message):
    from compiled_llm.errors import WeightLoadError
    from compiled_llm.model.config import load_config
    from compiled_llm.model.weights import load_params
    from helpers.hf_checkpoints import make_checkpoint

    make_checkpoint("qwen3_moe", tmp_path)
    _rewrite_checkpoint(tmp_path, edit)
    with pytest.raises(WeightLoadError, match=message):
        load_params(load_config(tmp_path), tmp_path)
