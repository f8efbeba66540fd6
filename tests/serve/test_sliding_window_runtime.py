"""A Mistral engine whose sliding window is shorter than its context serves sequences that
outrun the window in a KV cache too small to hold their whole contexts: each gives back its
blocks behind the window, and greedy output stays transformers' own (with the window), with
chunked prefill, steps queued ahead, prefix caching of contexts whose heads were given back,
and n-gram speculative decoding. On a GPU the same runs through the Triton kernels and the
decode CUDA graphs, whose block tables hold the given-back entries they must not read."""

from __future__ import annotations

import json

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.engine.build import build_engine
from compiled_llm.errors import InvalidRequestError
from compiled_llm.serve.core.block_manager import window_blocks
from helpers.greedy_oracle import hf_greedy, lively_checkpoint

WINDOW = 40
BS = 16
BUDGET = 32
PROMPT, OUTPUT = 80, 40
# three sequences at once, each in at most a prefill chunk's window of blocks: fewer than their
# 120-token contexts kept whole would take (3 x 8)
NUM_BLOCKS = 3 * window_blocks(WINDOW, BS, BUDGET)

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers model, checkpoint dir) of a tiny Mistral with a 40-token window."""
    root = tmp_path_factory.mktemp("windowed_mistral")
    hf = lively_checkpoint("mistral", root / "checkpoint")
    config_path = root / "checkpoint" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "sliding_window": WINDOW}))
    hf.config.sliding_window = WINDOW
    return hf, root / "checkpoint"


@pytest.fixture(scope="module", params=DEVICES)
def engine(request, checkpoint, tmp_path_factory):
    """(device, engine dir) built from ``checkpoint``."""
    out = tmp_path_factory.mktemp(f"engine_{request.param}") / "engine"
    build_engine(str(checkpoint[1]), out, dtype="float32", device=request.param, progress=False)
    return request.param, out


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(0, 256, (8,), generator=gen).tolist()
    return [head + torch.randint(0, 256, (length - 8,), generator=gen).tolist() for _ in range(n)]


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_max": 2, "prompt_lookup_min": 1}],
                         ids=["plain", "ngram"])
def test_sequences_outrunning_the_window_give_back_blocks_and_decode_as_transformers(checkpoint, engine, speculative):
    hf, _ = checkpoint
    device, path = engine
    options = dict(gpu_memory_utilization=0.3) if device == "cuda" else {}
    llm = LLM(str(path), device=device, block_size=BS, max_num_batched_tokens=BUDGET, num_blocks=NUM_BLOCKS,
              enable_prefix_caching=True, speculative_config=speculative, **options)
    assert llm.engine.max_model_len > WINDOW and llm.engine.block_manager.sliding_window == WINDOW
    first = prompts(3, PROMPT, seed=5)
    outs = llm.generate(first, SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(first, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, OUTPUT)
    # contexts seen before, a token further: their heads were given back (maybe evicted), the
    # blocks of their windows are still cached
    hits_before = llm.engine.prefix_cache_stats().hit_tokens
    again = [p + list(o.outputs[0].token_ids[:20]) + [7] for p, o in zip(first, outs)]
    outs = llm.generate(again, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(again, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 12)
    assert llm.engine.prefix_cache_stats().hit_tokens > hits_before
    assert llm.engine.scheduler.num_preemptions == 0
    assert llm.engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_a_request_longer_than_the_cache_is_accepted_when_its_window_fits(checkpoint, tmp_path):
    """Every layer slides, so a sequence holds a window's blocks and a step's, not its whole
    context: a request of more tokens than the cache holds is served (the engine and the
    server's front end agree), and one whose first step alone does not fit is refused."""
    hf, source = checkpoint
    path = tmp_path / "engine"
    build_engine(str(source), path, dtype="float32", device="cpu", progress=False)
    blocks = window_blocks(WINDOW, BS, BUDGET)  # one sequence's most: 6 blocks of 16 = 96 tokens
    llm = LLM(str(path), block_size=BS, max_num_batched_tokens=BUDGET, num_blocks=blocks)
    prompt = prompts(1, PROMPT, seed=9)[0]
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True),
                          use_tqdm=False)
    assert PROMPT + OUTPUT > blocks * BS
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, OUTPUT)
    from compiled_llm.serve.engine_process.engine_messages import EngineInfo

    front = EngineInfo.of(llm.engine)
    assert (front.kv_window, front.max_step_tokens) == (WINDOW, BUDGET)
    small = LLM(str(path), block_size=BS, max_num_batched_tokens=BUDGET, num_blocks=blocks - 1)
    with pytest.raises(InvalidRequestError, match="KV-cache blocks"):
        small.generate([prompt], SamplingParams(max_tokens=OUTPUT), use_tqdm=False)
