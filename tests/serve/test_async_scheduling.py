"""Async scheduling: the engine queues the next decode step before it reads the current step's
tokens (the device computes while the host does its bookkeeping). Outputs must be exactly those
of the synchronous engine and the reference loop, including when a sequence finishes on a token
the host has not seen yet (EOS, stop ids, stop strings, aborts): the token computed ahead for it
is dropped and its blocks still come back."""

import random

import pytest

from compiled_llm import LLM, SamplingParams
from compiled_llm.serve.reference import generate_reference


def _llm(async_scheduling: bool) -> LLM:
    # enforce_eager: the eager spec in the runtime, whose params the reference loop takes
    return LLM("tiny-qwen2", device="cpu", max_num_seqs=8, max_num_batched_tokens=64, num_blocks=64,
               async_scheduling=async_scheduling, enforce_eager=True)


@pytest.fixture(scope="module")
def pair():
    return _llm(True), _llm(False)


def _requests(vocab: int, n: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0, ignore_eos=True) for _ in range(n)]
    return prompts, params


def _run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.token_ids, o.finish_reason) for o in outs]


def test_outputs_equal_the_synchronous_engine_and_the_reference(pair):
    fast, sync = pair
    prompts, params = _requests(fast.model.config.vocab_size, 24, seed=0)
    before = fast.stats.ahead_steps
    got = _run(fast, prompts, params)
    assert got == _run(sync, prompts, params)
    m = fast.model
    refs = generate_reference(m.config, m.params, prompts, params, eos_token_ids=m.eos_token_ids)
    assert got == [(r.token_ids, r.finish_reason) for r in refs]
    assert fast.stats.ahead_steps - before > 5, "decode steps were queued ahead"
    assert sync.stats.ahead_steps == 0
    assert fast.engine.block_manager.num_free_blocks == fast.engine.num_blocks


def test_stop_on_a_token_not_yet_read_drops_the_token_computed_ahead(pair):
    fast, sync = pair
    prompts, params = _requests(fast.model.config.vocab_size, 6, seed=1)  # all admitted at once
    # seeded sampling: varied tokens (greedy tiny models repeat one), the same in both engines
    def params_with(i, stop):
        return SamplingParams(max_tokens=24, temperature=1.0, seed=i, ignore_eos=True, stop_token_ids=stop)

    free_run = _run(sync, prompts, [params_with(i, []) for i in range(len(prompts))])
    # stop each request on the first token that is new after its 3rd: a token-dependent finish
    # while the step after it is already queued
    def first_new(ids):
        return next((t for i, t in enumerate(ids) if i >= 3 and t not in ids[:i]), None)

    stop_ids = [first_new(ids) for ids, _ in free_run]
    assert sum(t is not None for t in stop_ids) >= 3
    stops = [params_with(i, [] if t is None else [t]) for i, t in enumerate(stop_ids)]
    dropped = fast.stats.dropped_ahead_tokens
    got = _run(fast, prompts, stops)
    assert got == _run(sync, prompts, stops)
    for (ids, reason), (full, _), t in zip(got, free_run, stop_ids):
        if t is not None:
            assert reason == "stop" and ids == full[: full.index(t) + 1]
    assert fast.stats.dropped_ahead_tokens > dropped
    assert fast.engine.block_manager.num_free_blocks == fast.engine.num_blocks


def test_stop_string_and_abort_while_a_step_is_queued(pair):
    fast, sync = pair
    text = "hello world, hello again"
    p = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ref = sync.generate(text, p, use_tqdm=False)[0].text
    stop = ref[3:5] if len(ref) > 6 else None
    if stop:
        ps = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop])
        assert fast.generate(text, ps, use_tqdm=False)[0].text == sync.generate(text, ps, use_tqdm=False)[0].text
    # abort one stream mid-way while another request decodes alongside it
    other = fast.engine.add_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    stream = fast.stream(text, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for i, _ in enumerate(stream):
        if i == 4:
            break
    stream.close()
    outs = []
    while fast.engine.has_unfinished_requests():
        outs += [o for o in fast.engine.step() if o.finished]
    (done,) = [o for o in outs if o.request_id == other]
    alone = sync.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert done.token_ids == alone.token_ids
    assert fast.engine.block_manager.num_free_blocks == fast.engine.num_blocks


def test_seeded_sampling_is_unchanged_by_async_scheduling(pair):
    fast, sync = pair
    prompts, _ = _requests(fast.model.config.vocab_size, 6, seed=2)
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True) for i in range(6)]
    assert _run(fast, prompts, params) == _run(sync, prompts, params)
