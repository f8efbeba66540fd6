"""Scheduler: token budget, decodes before prefills, chunked prefill, preemption by recompute,
aborts and stop conditions."""

from compiled_llm.serve.sampling_params import SamplingParams
from compiled_llm.serve.core.block_manager import BlockManager
from compiled_llm.serve.core.scheduler import Scheduler, SchedulerConfig
from compiled_llm.serve.core.sequence import Sequence, SequenceStatus

BS = 4
EOS = 0


def make(num_blocks=64, max_num_seqs=8, budget=16, prefix_caching=True, solo=0):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=256,
                          enable_chunked_prefill=True, solo_prefill_max_tokens=solo)
    return Scheduler(cfg, BlockManager(num_blocks, BS, prefix_caching), stop_token_ids=[EOS])


_arrivals = iter(range(10**9))


def seq(n_prompt, max_tokens=8, first=1, **kw):
    a = next(_arrivals)
    return Sequence(str(a), list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens, **kw), arrival=a)


def step(sched, token=5):
    batch = sched.schedule()
    sched.update(batch, [token] * len(batch.sample_rows))
    return batch


def plan(batch):
    return [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]


def test_prefill_then_decode_one_token_per_step():
    s = make()
    a = seq(6)
    s.add(a)
    b = step(s)
    assert plan(b) == [(a.request_id, 6)] and b.sample_rows == [0]
    assert a.num_computed_tokens == 6 and a.output_token_ids == [5]
    b = step(s)
    assert plan(b) == [(a.request_id, 1)] and b.is_decode
    assert a.num_computed_tokens == 7 and a.num_tokens == 8


def test_a_decode_step_lists_its_rows_longest_context_first_and_a_step_ahead_keeps_them():
    s = make(budget=64)
    a, b, c, d = seq(3), seq(9), seq(6), seq(9)
    for x in (a, b, c, d):
        s.add(x)
    step(s)  # all four prompts in one step
    batch = step(s)
    # the decode attention kernel starts its programs row by row: the longest first, ties in
    # arrival order
    assert batch.is_decode and plan(batch) == [(b.request_id, 1), (d.request_id, 1), (c.request_id, 1),
                                               (a.request_id, 1)]
    ahead, rows = s.schedule_ahead(batch)
    assert [x.request_id for x in ahead.seqs] == [b.request_id, d.request_id, c.request_id, a.request_id]
    assert rows is None  # every row of ``batch`` feeds the step ahead, in order
    # a step with a prompt in it is not a decode step: its rows stay in scheduling order
    s.update(batch, [5] * 4)
    e = seq(5, first=100)
    s.add(e)
    mixed = s.schedule()
    assert not mixed.is_decode and plan(mixed) == [(a.request_id, 1), (b.request_id, 1), (c.request_id, 1),
                                                   (d.request_id, 1), (e.request_id, 5)]


def test_long_prompt_is_chunked_and_samples_only_at_its_end():
    s = make(budget=10)
    a = seq(25)
    s.add(a)
    chunks = []
    while not a.output_token_ids:
        b = step(s)
        chunks.append((b.num_new_tokens[0], b.sample_rows))
    assert chunks == [(10, []), (10, []), (5, [0])]


def test_decodes_are_scheduled_before_new_prefills_and_prefills_fill_the_rest():
    s = make(budget=10)
    a, b = seq(3), seq(3)
    s.add(a)
    s.add(b)
    step(s)  # both prefilled
    c = seq(30)
    s.add(c)
    batch = step(s)
    assert plan(batch) == [(a.request_id, 1), (b.request_id, 1), (c.request_id, 8)]
    # the next step: decodes still first, then c's next chunk
    batch = step(s)
    assert plan(batch) == [(a.request_id, 1), (b.request_id, 1), (c.request_id, 8)]


def test_a_trickle_of_prompts_runs_alone_ahead_of_the_decodes_when_prefill_graphs_exist():
    s = make(budget=32, solo=12)
    a, b = seq(6), seq(6, first=20)
    s.add(a)
    s.add(b)
    step(s)  # both prompts (12 tokens in all): one mixed step, nothing runs yet
    c = seq(5, first=40)
    s.add(c)
    solo = step(s)
    assert plan(solo) == [(c.request_id, 5)] and solo.sample_rows == [0]  # the decodes wait one step
    after = step(s)
    assert plan(after) == [(a.request_id, 1), (b.request_id, 1), (c.request_id, 1)] and after.is_decode
    # more waiting tokens than the limit: the usual step, decodes first and the prompts after
    d, e = seq(7, first=60), seq(7, first=80)
    s.add(d)
    s.add(e)
    mixed = step(s)
    assert plan(mixed) == [(a.request_id, 1), (b.request_id, 1), (c.request_id, 1), (d.request_id, 7),
                           (e.request_id, 7)]


def test_without_prefill_graphs_a_new_prompt_joins_the_decodes():
    s = make(budget=32)
    a = seq(6)
    s.add(a)
    step(s)
    c = seq(5, first=40)
    s.add(c)
    assert plan(step(s)) == [(a.request_id, 1), (c.request_id, 5)]


def test_max_num_seqs_caps_the_running_set():
    s = make(max_num_seqs=2, budget=100)
    seqs = [seq(3) for _ in range(3)]
    for q in seqs:
        s.add(q)
    batch = step(s)
    assert [q.request_id for q in batch.seqs] == [seqs[0].request_id, seqs[1].request_id]
    assert list(s.waiting) == [seqs[2]]


def test_preemption_frees_the_latest_and_it_recomputes_prompt_plus_output():
    # 6 blocks of 4 tokens. Two sequences of 8-token prompts take 2 blocks each; growing
    # both past 12 tokens needs 8 blocks, so the later one must be preempted.
    s = make(num_blocks=6, budget=64)
    a, b = seq(8, max_tokens=12), seq(8, max_tokens=12, first=50)
    s.add(a)
    s.add(b)
    preempted_at = None
    for i in range(40):
        batch = step(s, token=7)
        if batch.preempted and preempted_at is None:
            preempted_at = i
            assert batch.preempted == [b]
            assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
            assert s.waiting[0] is b
            assert b.num_output_tokens > 0
        if not s.has_unfinished():
            break
    assert preempted_at is not None
    assert a.finish_reason == "length" and b.finish_reason == "length"
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    assert b.metrics.num_preemptions >= 1
    assert s.bm.num_free_blocks == 6


def test_readmitted_sequence_recomputes_everything_it_had():
    s = make(num_blocks=4, budget=64, prefix_caching=False)
    a, b = seq(8, max_tokens=6), seq(8, max_tokens=6, first=40)
    s.add(a)
    s.add(b)
    step(s)  # both prefilled: 2 blocks each, pool empty
    batch = step(s)  # a needs a 3rd block for its 9th token -> b preempted
    assert batch.preempted == [b] and plan(batch) == [(a.request_id, 1)]
    tokens_b = b.num_tokens
    while b.status is SequenceStatus.WAITING:
        batch = step(s)
    idx = batch.seqs.index(b)
    assert batch.num_new_tokens[idx] == tokens_b  # prompt + the token it had generated
    assert b.prompt_token_ids == list(range(40, 48))


def test_no_new_admissions_in_a_step_that_preempted():
    s = make(num_blocks=4, budget=64, prefix_caching=False)
    a, b = seq(8, max_tokens=6), seq(8, max_tokens=6, first=40)
    s.add(a)
    s.add(b)
    step(s)
    s.add(seq(2))
    batch = step(s)
    assert batch.preempted and len(batch.seqs) == 1


def test_abort_frees_blocks_at_once():
    s = make(num_blocks=8)
    a = seq(10)
    s.add(a)
    step(s)
    assert s.bm.num_free_blocks == 5
    s.abort(a)
    assert s.bm.num_free_blocks == 8 and a.finish_reason == "abort" and not s.has_unfinished()
    w = seq(3)
    s.add(w)
    s.abort(w)  # a waiting request too
    assert not s.has_unfinished()


def test_stop_conditions():
    s = make()
    eos, stop_id, ignore, length = seq(3), seq(3, stop_token_ids=[9]), seq(3, max_tokens=2, ignore_eos=True), seq(3, max_tokens=2)
    for q in (eos, stop_id, ignore, length):
        s.add(q)
    batch = s.schedule()
    s.update(batch, [EOS, 9, EOS, 4])
    assert eos.finish_reason == "stop" and eos.output_token_ids == [EOS]
    assert stop_id.finish_reason == "stop"
    assert ignore.finish_reason is None  # ignores EOS
    assert length.finish_reason is None
    step(s, token=4)
    assert ignore.finish_reason == "length" and ignore.output_token_ids == [EOS, 4]
    assert length.finish_reason == "length" and length.output_token_ids == [4, 4]
    assert s.bm.num_free_blocks == 64


def test_prefix_cache_hits_skip_cached_tokens():
    s = make(budget=64)
    system = list(range(100, 112))  # 3 full blocks
    a = Sequence("a", system + [1, 2], SamplingParams(max_tokens=1), arrival=1000)
    s.add(a)
    step(s)
    b = Sequence("b", system + [3, 4, 5], SamplingParams(max_tokens=1), arrival=1001)
    s.add(b)
    batch = step(s)
    assert plan(batch) == [("b", 3)]
    assert b.metrics.num_cached_tokens == 12
    assert s.bm.stats.hit_tokens == 12


def test_a_request_waiting_for_its_grammar_is_passed_over_and_stops_no_step_queued_ahead():
    import concurrent.futures

    from compiled_llm.serve.core.structured_output.grammar_matcher import GrammarMatcher

    s = make(budget=64)
    a, b, c = seq(4), seq(5), seq(3)
    compiling = concurrent.futures.Future()  # never done here
    b.grammar = GrammarMatcher(compiling)
    for x in (a, b, c):
        s.add(x)
    first = s.schedule()
    assert plan(first) == [(a.request_id, 4), (c.request_id, 3)] and list(s.waiting) == [b]
    s.update(first, [5, 5])
    batch = s.schedule()
    assert batch.is_decode and s.has_schedulable()
    ahead, _ = s.schedule_ahead(batch)  # b cannot be admitted: the others run on
    assert [x.request_id for x in ahead.seqs] == [x.request_id for x in batch.seqs]
    failed = concurrent.futures.Future()
    failed.set_exception(RuntimeError("xgrammar failed"))
    b.grammar = GrammarMatcher(failed)
    assert b.waits_for_grammar  # a failed compile is never scheduled (the engine aborts it)
