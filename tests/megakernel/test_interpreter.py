"""Interpreting a decode step's megakernel schedule computes what the post-pass program computes,
for every family the instruction set covers, on transformers-written checkpoints: the same logits,
the same keys and values written into the cache, and the greedy token of each row, whatever
legal order the SMs run in and however many SMs the schedule was made for (and so however many
splits each head's context is cut into)."""

from __future__ import annotations

import pytest
import torch

from compiled_llm.engine.artifact import load_engine
from compiled_llm.engine.build import build_engine
from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.graph.ops import paged_attention_read_ref
from compiled_llm.megakernel import scheduler
from compiled_llm.megakernel.check import ScheduleError, check_schedule
from compiled_llm.megakernel.interpreter import attention_combine_ref, attention_partial_ref, interpret
from compiled_llm.megakernel.lowering import NotCovered, lower_decode
from compiled_llm.model.spec import kv_cache_shape
from helpers.greedy_oracle import lively_checkpoint

COVERED = ["qwen2", "qwen3", "llama", "mistral", "phi3"]
BLOCK_SIZE = 16


@pytest.fixture(scope="module", params=COVERED)
def engine(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    lively_checkpoint(request.param, d / "checkpoint")
    build_engine(str(d / "checkpoint"), d / "engine", dtype="float32", device="cpu", progress=False)
    return load_engine(d / "engine")


def schedule_for(engine, num_sms: int):
    shapes = {n: tuple(t.shape) for n, t in engine.params.items()}
    made = scheduler.schedule(lower_decode(engine.program.module.gm, shapes, num_sms), scheduler.Machine(num_sms))
    check_schedule(made)
    return made


def decode_batch(rows: int):
    """``rows`` sequences at different lengths, each decoding its next token (contexts up to 80
    tokens: past a block boundary, and past tiny-mistral's 48-token window)."""
    seqs = [ScheduledSeq([3 + 11 * i], 9 + 9 * i, list(range(6 * i, 6 * i + 6))) for i in range(rows)]
    return pack_batch(seqs, BLOCK_SIZE)


def filled_cache(engine):
    torch.manual_seed(0)
    return torch.randn(kv_cache_shape(engine.config, 64, BLOCK_SIZE), dtype=engine.dtype)


@pytest.mark.parametrize("num_sms", [1, 5, 8, 132])  # the tiny models' 4 heads: 1, 1, 2 and 8 splits
@pytest.mark.parametrize("rows", [1, 8])
def test_interpreting_the_schedule_equals_the_program(engine, num_sms, rows):
    made = schedule_for(engine, num_sms)
    splits = next(op for op in made.ops if op.kind == "attention").attrs["splits"]
    assert splits == min(8, max(1, num_sms // engine.config.num_heads))
    batch, cache = decode_batch(rows), filled_cache(engine)
    program_cache = cache.clone()
    expected = engine.program(engine.params, batch, program_cache)
    for seed in (None, 1, 2):
        run_cache = cache.clone()
        logits, tokens = interpret(made, engine.params, batch, run_cache, order_seed=seed)
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(run_cache, program_cache, rtol=1e-5, atol=1e-5)
        assert tokens.tolist() == expected.argmax(dim=-1).tolist()


def test_a_window_the_context_outruns_is_attended_as_the_program_does(tmp_path):
    build_engine("tiny-mistral", tmp_path / "engine", dtype="float32", device="cpu", progress=False)
    engine = load_engine(tmp_path / "engine")
    made = schedule_for(engine, 12)  # three splits of the window
    batch, cache = decode_batch(8), filled_cache(engine)
    assert max(batch.seq_lens.tolist()) > engine.config.sliding_window
    expected = engine.program(engine.params, batch, cache.clone())
    logits, _ = interpret(made, engine.params, batch, cache.clone())
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 2, 3, 8])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (20, 0.0), (0, 5.0)])
def test_a_heads_split_partials_combine_to_its_unsplit_attention(splits, window, softcap):
    """Each split's (m, l, acc), combined, is paged_attention_read_ref's output for the head:
    at contexts shorter than ``splits`` chunks of 16 (empty splits), past a window, with
    softcapped scores, and for a CUDA-graph padding row (seq_len 0), whose output is 0."""
    torch.manual_seed(0)
    hd, block_size = 16, 16
    lens = [1, 5, 17, 33, 70, 0]
    rows = len(lens)
    cache = torch.randn(2, 5 * rows, block_size, 1, hd)  # one KV head
    block_tables = torch.randperm(5 * rows).reshape(rows, 5).int()  # 5 blocks hold 70 keys
    q = torch.randn(rows, hd)
    seq_lens = torch.tensor(lens)
    expected = paged_attention_read_ref(q[:, None], cache, torch.arange(rows + 1), seq_lens, block_tables, 0.25,
                                        window, softcap)[:, 0]
    partials = torch.stack([attention_partial_ref(q, cache[..., 0, :], seq_lens, block_tables, 0.25, window, softcap,
                                                  splits, c) for c in range(splits)], dim=1)
    got = attention_combine_ref(partials, q.dtype)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert not got[-1].any()
    if splits > 1:  # 5 keys fill the first split; the others are empty: m = -1e30, l = 0, acc = 0
        assert (partials[1, 1:, 0] == -1e30).all() and not partials[1, 1:, 1:].any()


def test_every_wait_the_scheduler_leaves_is_needed(engine):
    """Dropping any one wait of any instruction is a hazard: the check names it, and an
    interpreter order that runs the reader early stops at the unwritten read (two splits a head:
    the combines' waits on their splits are among them)."""
    made = schedule_for(engine, 8)
    batch, cache = decode_batch(2), filled_cache(engine)
    waits = [(i, w) for i, ins in enumerate(made.instructions) for w in range(len(ins.waits))]
    assert len(waits) > 2 * engine.config.num_layers
    caught_running = 0
    for i, w in waits:
        broken = made.without_wait(i, w)
        with pytest.raises(ScheduleError, match="without waiting for it"):
            check_schedule(broken)
        for seed in range(4):
            try:
                interpret(broken, engine.params, batch, cache.clone(), order_seed=seed)
            except ScheduleError as e:
                assert "the schedule lacks a dependency" in str(e)
                caught_running += 1
                break
    assert caught_running > len(waits) // 2


def test_a_prefill_step_is_not_a_decode_step_the_schedule_runs(engine):
    made = schedule_for(engine, 4)
    prefill = pack_batch([ScheduledSeq([1, 2, 3], 0, [0])], BLOCK_SIZE)
    with pytest.raises(ValueError, match="decode steps of 1..8 sequences"):
        interpret(made, engine.params, prefill, filled_cache(engine))
    too_many = pack_batch([ScheduledSeq([1], 3, [i]) for i in range(9)], BLOCK_SIZE)
    with pytest.raises(ValueError, match="decode steps of 1..8 sequences"):
        interpret(made, engine.params, too_many, filled_cache(engine))


@pytest.mark.parametrize("family", ["gpt2", "qwen3_moe", "gemma2"])
def test_a_program_with_an_op_the_instruction_set_lacks_is_refused_in_one_line(family, tmp_path):
    lively_checkpoint(family, tmp_path / "checkpoint")
    build_engine(str(tmp_path / "checkpoint"), tmp_path / "engine", dtype="float32", device="cpu", progress=False)
    engine = load_engine(tmp_path / "engine")
    shapes = {n: tuple(t.shape) for n, t in engine.params.items()}
    with pytest.raises(NotCovered) as e:
        lower_decode(engine.program.module.gm, shapes, 8)
    assert "\n" not in str(e.value) and "--decode-backend per-op" in str(e.value)
