"""Mistral and Phi-3 checkpoints written by transformers build into engines whose greedy output
is transformers' own, batched, with chunked prefill and a shared prefix cached."""

from __future__ import annotations

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.engine.build import build_engine
from helpers.greedy_oracle import hf_greedy, lively_checkpoint


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_a_built_engine_of_the_family_decodes_as_transformers(tmp_path, family):
    hf = lively_checkpoint(family, tmp_path / "checkpoint")
    build_engine(str(tmp_path / "checkpoint"), tmp_path / "engine", dtype="float32", device="cpu", progress=False)
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 256, (24,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 17, 40)]
    llm = LLM(str(tmp_path / "engine"), block_size=8, max_num_batched_tokens=32, enable_prefix_caching=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 16)
    assert len({t for o in outs for t in o.outputs[0].token_ids}) >= 8  # varied outputs


def test_a_window_shorter_than_the_context_runs_exactly_to_the_window(tmp_path):
    """Mistral 7B v0.1's sliding window, at a small size: the engine's context is cut to the
    window, within which its greedy output is transformers' own (with the window)."""
    import json

    hf = lively_checkpoint("mistral", tmp_path / "checkpoint")
    config_path = tmp_path / "checkpoint" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "sliding_window": 48}))
    hf.config.sliding_window = 48
    build_engine(str(tmp_path / "checkpoint"), tmp_path / "engine", dtype="float32", device="cpu", progress=False)
    prompt = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(4)).tolist()
    llm = LLM(str(tmp_path / "engine"), block_size=8)
    assert llm.engine.max_model_len == 48
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 16)
