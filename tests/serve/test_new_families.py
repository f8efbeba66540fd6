"""Mistral, Phi-3, Gemma 2 and Gemma 3 (text-only and multimodal) checkpoints written by
transformers build into engines
whose greedy output is transformers' own: batched, chunked, preempted, with a shared prefix
cached, over prompts and generations longer than the sliding window."""

from __future__ import annotations

import json

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.engine.build import build_engine
from helpers.greedy_oracle import hf_greedy, lively_checkpoint

WINDOW = 24  # Mistral and Phi-3 get it on every layer; the Gemma checkpoints have it already


def windowed_checkpoint(family: str, path):
    """A lively checkpoint of ``family`` whose sliding window (WINDOW) is shorter than the
    prompts below."""
    hf = lively_checkpoint(family, path)
    if family in ("mistral", "phi3"):
        config_path = path / "config.json"
        config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "sliding_window": WINDOW}))
        hf.config.sliding_window = WINDOW
    assert hf.config.get_text_config().sliding_window == WINDOW
    return hf


@pytest.mark.parametrize("family", ["mistral", "phi3", "gemma2", "gemma3", "gemma3_multimodal"])
def test_a_built_engine_of_the_family_decodes_as_transformers(tmp_path, family):
    hf = windowed_checkpoint(family, tmp_path / "checkpoint")
    build_engine(str(tmp_path / "checkpoint"), tmp_path / "engine", dtype="float32", device="cpu", progress=False)
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 256, (20,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 17, 40, 9, 60, 1)]
    # 32-token steps chunk the longer prompts; 14 blocks of 8 hold two sequences at most
    llm = LLM(str(tmp_path / "engine"), block_size=8, max_num_batched_tokens=32, enable_prefix_caching=True,
              num_blocks=14)
    assert llm.engine.max_model_len == hf.config.get_text_config().max_position_embeddings  # the window does not cut it
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 20)
    assert len({t for o in outs for t in o.outputs[0].token_ids}) >= 8  # varied outputs
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.stats.hit_tokens > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_the_window_changes_what_a_sliding_layer_sees(tmp_path):
    """The same Gemma 2 weights without a window give other tokens past it: the agreement above
    is the window's, not a coincidence of short contexts."""
    hf = windowed_checkpoint("gemma2", tmp_path / "checkpoint")
    prompt = torch.randint(0, 256, (3 * WINDOW,), generator=torch.Generator().manual_seed(5)).tolist()
    windowed = LLM(str(tmp_path / "checkpoint"), enforce_eager=True, dtype="float32", block_size=8)
    (out,) = windowed.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 12)
    hf.config.sliding_window = 10_000
    assert hf_greedy(hf, prompt, 12) != list(out.outputs[0].token_ids)
