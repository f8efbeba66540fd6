"""One LLM, many callers: threads, interleaved streams, atomic submissions and failed steps.

Every expectation is what a fresh engine gives for the same requests, on the lively checkpoint
(greedy outputs that vary token to token), so a token routed to the wrong caller, a lost stream
delta or a poisoned prefix cache changes what is compared.
"""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest

from compiled_llm import LLM, SamplingParams
from compiled_llm.errors import InvalidRequestError
from compiled_llm.engine.loader import load_model

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SMALL = dict(max_num_seqs=8, max_num_batched_tokens=48, num_blocks=64, block_size=8)


@pytest.fixture(scope="module")
def loaded(lively_bpe_engine):
    return load_model(str(lively_bpe_engine), device="cpu")


def id_prompts(loaded, n, seed, length=(4, 40)):
    rng = random.Random(seed)
    vocab = loaded.config.vocab_size
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(*length))]} for _ in range(n)]


def alone(loaded, prompts, params=GREEDY):
    """What a fresh engine gives, one request at a time."""
    llm = LLM.from_loaded(loaded)
    return [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]


def same(outs, refs):
    return [(o.token_ids, o.text, o.finish_reason) for o in outs] == [(r.token_ids, r.text, r.finish_reason) for r in refs]


def assert_clean(llm):
    bm = llm.engine.block_manager
    assert not llm.engine.scheduler.has_unfinished()
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_two_threads_calling_generate_get_their_own_full_outputs(loaded):
    llm = LLM.from_loaded(loaded, **SMALL)
    batches = [id_prompts(loaded, 20, seed=s) for s in (1, 2)]
    expected = [alone(loaded, b) for b in batches]
    got: dict[int, list] = {}
    errors = []

    def call(i):
        try:
            for _ in range(2):  # twice: the second call overlaps the other thread's first
                got.setdefault(i, []).append(llm.generate(batches[i], GREEDY, use_tqdm=False))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for i in (0, 1):
        assert all(same(outs, expected[i]) for outs in got[i])
    assert_clean(llm)
    # nothing is left poisoned: the next call gives what a fresh engine gives
    assert same(llm.generate(batches[0], GREEDY, use_tqdm=False), expected[0])


def test_two_threads_streaming_at_once(loaded):
    llm = LLM.from_loaded(loaded, **SMALL)
    prompts = id_prompts(loaded, 6, seed=3)
    expected = alone(loaded, prompts)
    texts: dict[int, str] = {}

    def read(i):
        texts[i] = "".join(llm.stream(prompts[i], GREEDY))

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert [texts[i] for i in range(len(prompts))] == [e.text for e in expected]
    assert_clean(llm)


def test_interleaved_streams_each_get_every_token(loaded):
    llm = LLM.from_loaded(loaded, **SMALL)
    prompts = id_prompts(loaded, 3, seed=4)
    expected = alone(loaded, prompts)
    streams = [llm.stream(p, GREEDY) for p in prompts]
    texts = ["", "", ""]
    live = [0, 1, 2]
    while live:  # one delta from each in turn
        for i in list(live):
            try:
                texts[i] += next(streams[i])
            except StopIteration:
                live.remove(i)
    assert texts == [e.text for e in expected]
    assert [s.output.token_ids for s in streams] == [e.token_ids for e in expected]
    assert all(s.output.finish_reason == "length" for s in streams)
    assert_clean(llm)


def test_generate_while_a_stream_is_paused_leaves_the_stream_whole(loaded):
    llm = LLM.from_loaded(loaded, **SMALL)
    paused, others = id_prompts(loaded, 1, seed=5), id_prompts(loaded, 8, seed=6)
    expected = alone(loaded, paused + others)
    stream = llm.stream(paused[0], GREEDY)
    first = next(stream)
    assert same(llm.generate(others, GREEDY, use_tqdm=False), expected[1:])
    assert first + "".join(stream) == expected[0].text
    assert stream.output.token_ids == expected[0].token_ids
    assert_clean(llm)


def test_closing_a_stream_early_frees_its_blocks_and_others_carry_on(loaded):
    llm = LLM.from_loaded(loaded, **SMALL)
    prompts = id_prompts(loaded, 2, seed=7)
    expected = alone(loaded, prompts)
    dropped, kept = llm.stream(prompts[0], GREEDY), llm.stream(prompts[1], GREEDY)
    next(dropped)
    dropped.close()
    assert list(dropped) == []
    assert "".join(kept) == expected[1].text
    assert_clean(llm)


def test_a_batch_with_one_bad_request_queues_none_of_it(loaded):
    llm = LLM.from_loaded(loaded, **SMALL)
    prompts = id_prompts(loaded, 3, seed=8)
    bad = dataclasses.replace(GREEDY)
    object.__setattr__(bad, "seed", 2**80)  # past SamplingParams' own check: the engine checks again
    with pytest.raises(InvalidRequestError, match="seed"):
        llm.generate(prompts, [GREEDY, GREEDY, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate(prompts[0], GREEDY, use_tqdm=False)
    assert same([out], alone(loaded, prompts[:1]))


class PlantedFault(RuntimeError):
    pass


def fail_on_call(llm, n):
    """Make the n-th program call from now raise before it computes anything."""
    runner = llm.engine.runner
    program, calls = runner.program, [0]

    def faulty(*args):
        calls[0] += 1
        if calls[0] == n:
            raise PlantedFault("planted fault")
        return program(*args)

    runner.program = faulty


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_failed_step_frees_its_blocks_and_caches_no_unwritten_prefix(loaded, async_scheduling):
    # prompts of 3 full blocks; the fault hits while they are being prefilled, so their blocks
    # hold KV that was never written, and none of it may be found in the prefix cache later
    llm = LLM.from_loaded(loaded, **dict(SMALL, async_scheduling=async_scheduling))
    prompts = id_prompts(loaded, 4, seed=9, length=(24, 24))
    expected = alone(loaded, prompts)
    fail_on_call(llm, 2)
    with pytest.raises(PlantedFault):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_clean(llm)
    assert same(llm.generate(prompts, GREEDY, use_tqdm=False), expected)


def test_a_fault_mid_decode_fails_only_the_step_it_hit(loaded):
    llm = LLM.from_loaded(loaded, **SMALL)
    prompts = id_prompts(loaded, 2, seed=10)
    expected = alone(loaded, prompts)
    stream = llm.stream(prompts[0], GREEDY)
    next(stream)
    fail_on_call(llm, 3)
    with pytest.raises(PlantedFault):
        "".join(stream)
    assert_clean(llm)
    assert same(llm.generate(prompts, GREEDY, use_tqdm=False), expected)


def test_a_failure_before_any_request_is_in_flight_fails_the_waiting_calls(loaded, monkeypatch):
    llm = LLM.from_loaded(loaded, **SMALL)
    prompts = id_prompts(loaded, 3, seed=11)
    expected = alone(loaded, prompts)
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def broken():
        monkeypatch.setattr(scheduler, "schedule", schedule)  # fails once
        raise PlantedFault("planted scheduling fault")

    monkeypatch.setattr(scheduler, "schedule", broken)
    with pytest.raises(PlantedFault):  # an error, not a wait that never ends
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_clean(llm)
    assert same(llm.generate(prompts, GREEDY, use_tqdm=False), expected)


def test_a_fault_after_some_rows_finished_fails_the_call_cleanly(loaded, monkeypatch):
    # two requests finish in the same step and building the second's output raises: the first's
    # output was made but never delivered, so it too must end with the error, not a lost wait
    llm = LLM.from_loaded(loaded, **SMALL)
    prompts = id_prompts(loaded, 2, seed=12, length=(6, 6))  # both prefilled in one step
    engine = llm.engine
    make_output, calls = engine._output, [0]

    def faulty(*args):
        calls[0] += 1
        if calls[0] == 2:
            raise PlantedFault("planted output fault")
        return make_output(*args)

    monkeypatch.setattr(engine, "_output", faulty)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    # two callers' submissions, entering the engine together
    queues = [q for p in prompts for q in llm._loop.submit([engine.validate(p, params)])]
    llm._loop.wait(lambda: all(q.ready() for q in queues))
    for q in queues:
        with pytest.raises(PlantedFault):
            q.get_nowait()
    assert_clean(llm)


def test_numpy_integers_are_ordinary_integers(loaded):
    np = pytest.importorskip("numpy")
    llm = LLM.from_loaded(loaded, **SMALL)
    prompt = {"prompt_token_ids": [np.int64(t) for t in id_prompts(loaded, 1, seed=13)[0]["prompt_token_ids"]]}
    sampled = dict(max_tokens=8, temperature=0.8, ignore_eos=True)
    a = llm.generate(prompt, SamplingParams(seed=np.int64(7), **sampled), use_tqdm=False)[0]
    b = llm.generate(prompt, SamplingParams(seed=7, **sampled), use_tqdm=False)[0]
    assert a.token_ids == b.token_ids
    assert llm.generate(prompt["prompt_token_ids"], SamplingParams(max_tokens=np.int32(2)), use_tqdm=False)[0].token_ids
