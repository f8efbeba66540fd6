"""The persistent megakernel (compiled_llm/megakernel/triton_kernel.py) against the schedule's
CPU semantics (megakernel/interpreter.py) and the per-op program, through the Triton interpreter.

Not collected by itself: tests/megakernel/test_triton_kernel_interpret.py runs this file in a
child pytest with TRITON_INTERPRET=1 (helpers/interpret_child.py says why). The interpreter runs
a grid's programs one after another, so a program that waits for a later one would spin forever:
the schedules here are made for one SM (nothing waits), or are a many-SM schedule laid onto one
SM in program order (every wait is already met when it comes, and every bump is counted). One SM
alone would cut no head's context (splits = SMs // heads), so the split attention cases ask the
lowering for their splits. The
engines are the tiny presets in fp32 (hidden 64, two layers), so a step takes about a second.
"""

import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/megakernel/test_triton_kernel_interpret.py"

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from compiled_llm.engine.artifact import load_engine  # noqa: E402
from compiled_llm.engine.build import build_engine  # noqa: E402
from compiled_llm.graph.batch import ScheduledSeq, pack_batch  # noqa: E402
from compiled_llm.megakernel import encoding, scheduler, triton_kernel  # noqa: E402
from compiled_llm.megakernel.check import check_schedule  # noqa: E402
from compiled_llm.megakernel.interpreter import interpret  # noqa: E402
from compiled_llm.megakernel.lowering import lower_decode  # noqa: E402
from compiled_llm.model.spec import PackedBatch, kv_cache_shape  # noqa: E402

PRESETS = ["tiny-qwen2", "tiny-qwen3", "tiny-llama", "tiny-mistral"]
BLOCK_SIZE = 16
TOL = dict(rtol=1e-5, atol=1e-5)
SLOW = pytest.mark.slow

_ENGINES: dict = {}


def engine_of(preset: str, tmp_path_factory):
    if preset not in _ENGINES:
        d = tmp_path_factory.mktemp(preset) / "engine"
        build_engine(preset, d, dtype="float32", device="cpu", progress=False)
        _ENGINES[preset] = load_engine(d)
    return _ENGINES[preset]


def schedule_for(engine, num_sms: int, splits: int | None = None):
    shapes = {n: tuple(t.shape) for n, t in engine.params.items()}
    made = scheduler.schedule(lower_decode(engine.program.module.gm, shapes, num_sms, splits),
                              scheduler.Machine(num_sms))
    check_schedule(made)
    return made


def on_one_sm(s):
    """Schedule ``s`` with every instruction on one SM in program order, waits and bumps kept."""
    return dataclasses.replace(s, num_sms=1, sms=(tuple(range(len(s.instructions))),))


def decode_batch(rows: int):
    """``rows`` sequences at contexts of 70, 61, ... 7 tokens (the first past a block boundary
    and past tiny-mistral's 48-token window), each decoding its next token."""
    seqs = [ScheduledSeq([3 + 11 * i], 69 - 9 * i, list(range(6 * i, 6 * i + 6))) for i in range(rows)]
    return pack_batch(seqs, BLOCK_SIZE)


def with_padding_row(b: PackedBatch) -> PackedBatch:
    """``b`` with a CUDA graph bucket's padding row: token 0, seq_len 0, slot -1."""
    S = b.seq_lens.shape[0]
    return PackedBatch(
        token_ids=torch.cat([b.token_ids, b.token_ids.new_zeros(1)]),
        positions=torch.cat([b.positions, b.positions.new_zeros(1)]),
        query_start_loc=torch.cat([b.query_start_loc, b.query_start_loc.new_tensor([S + 1])]),
        seq_lens=torch.cat([b.seq_lens, b.seq_lens.new_zeros(1)]),
        block_tables=torch.cat([b.block_tables, b.block_tables.new_zeros(1, b.block_tables.shape[1])]),
        slot_mapping=torch.cat([b.slot_mapping, b.slot_mapping.new_full((1,), -1)]))


def filled_cache(engine):
    torch.manual_seed(0)
    return torch.randn(kv_cache_shape(engine.config, 64, BLOCK_SIZE), dtype=engine.dtype)


def run_kernel(s, engine, batch, cache, sizes=None):
    """(logits, tokens, counters) of one step of schedule ``s`` run by the Triton kernel
    (``sizes``: compile-time sizes other than the launch's own)."""
    buffers = encoding.activation_buffers(s, engine.dtype, "cpu")
    enc = encoding.encode(s, engine.params, buffers, engine.dtype, "cpu")
    counters = torch.zeros(max(1, s.num_counters), dtype=torch.int32)
    triton_kernel.launch(enc, counters, s.num_sms, batch.token_ids, batch.positions, batch.slot_mapping,
                         batch.seq_lens, batch.block_tables, cache, sizes=sizes)
    rows = batch.seq_lens.shape[0]
    return buffers[s.logits][:rows], buffers[s.tokens][:rows, 0], counters


def check_step(engine, s, batch, sizes=None):
    """The kernel's logits, KV cache and tokens equal the interpreter's and the per-op
    program's."""
    cache = filled_cache(engine)
    kernel_cache, interp_cache, program_cache = cache.clone(), cache.clone(), cache.clone()
    logits, tokens, counters = run_kernel(s, engine, batch, kernel_cache, sizes)
    want_logits, want_tokens = interpret(s, engine.params, batch, interp_cache)
    program_logits = engine.program(engine.params, batch, program_cache)
    torch.testing.assert_close(logits, want_logits, **TOL)
    torch.testing.assert_close(logits, program_logits, **TOL)
    torch.testing.assert_close(kernel_cache, interp_cache, **TOL)
    torch.testing.assert_close(kernel_cache, program_cache, **TOL)
    assert not torch.equal(kernel_cache, cache)  # the step's keys and values were written
    assert tokens.tolist() == want_tokens.tolist() == program_logits.argmax(dim=-1).tolist()
    return counters


@pytest.mark.parametrize("rows", [1, 8, pytest.param(3, marks=SLOW), pytest.param(6, marks=SLOW)])
@pytest.mark.parametrize("preset", PRESETS)
def test_the_kernel_computes_what_the_interpreter_and_the_program_compute(preset, rows, tmp_path_factory):
    engine = engine_of(preset, tmp_path_factory)
    batch = decode_batch(rows)
    if preset == "tiny-mistral":
        assert max(batch.seq_lens.tolist()) > engine.config.sliding_window
    assert max(batch.seq_lens.tolist()) > BLOCK_SIZE
    check_step(engine, schedule_for(engine, 1), batch)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-llama"])
def test_streaming_in_many_small_chunks_computes_what_one_chunk_computes(preset, rows, tmp_path_factory):
    """The tiny models' rows fit one K chunk at the launch's sizes; at 16 columns a K chunk and
    16 keys an attention step, every weight stream crosses K chunks and column chunks (the
    pipeline's next chunk of the same rows, and the next pass's first), and attention's
    keys, values and block-table entries run ahead over several steps."""
    engine = engine_of(preset, tmp_path_factory)
    check_step(engine, schedule_for(engine, 1), decode_batch(rows), sizes=dict(BLOCK_K=16, BLOCK_KH=16, BLOCK_L=16))


@pytest.mark.parametrize("rows", [1, 5])
def test_unaligned_weights_stream_element_by_element_and_compute_the_same(rows, tmp_path_factory):
    """A model whose weights are not 16-byte aligned runs the element-load form (no alignment
    hints, one element a thread's vector): it must compute what the vector form computes."""
    engine = engine_of("tiny-qwen3", tmp_path_factory)
    check_step(engine, schedule_for(engine, 1), decode_batch(rows), sizes=dict(ALIGNED=False, VEC=1, BLOCK_K=32,
                                                                               BLOCK_KL=32, BLOCK_KH=16))


def test_an_instruction_waiting_for_more_than_8_counters_polls_them_in_groups(tmp_path_factory):
    """A wait list longer than one poll (8 counters) is polled 8 at a time: the argmax here also
    waits for every counter the step bumps, at the value it ends at, and still runs."""
    engine = engine_of("tiny-qwen3", tmp_path_factory)
    s = on_one_sm(schedule_for(engine, 5))
    bumpers = [0] * s.num_counters
    for ins in s.instructions:
        for c in ins.bumps:
            bumpers[c] += 1
    assert s.num_counters > 8
    last = len(s.instructions) - 1
    assert s.ops[s.instructions[last].op].kind == "argmax"
    all_waits = tuple((c, n) for c, n in enumerate(bumpers) if n and c not in s.instructions[last].bumps)
    assert len(all_waits) > 8
    waited = dataclasses.replace(s.instructions[last], waits=all_waits)
    s = dataclasses.replace(s, instructions=s.instructions[:last] + (waited,))
    check_step(engine, s, decode_batch(2))


@pytest.mark.parametrize("preset, splits", [("tiny-qwen2", 3), ("tiny-mistral", 3), ("tiny-qwen3", 8)])
def test_split_attention_computes_what_the_interpreter_and_the_program_compute(preset, splits, tmp_path_factory):
    """Each head's context cut into ``splits``, 16 keys a kernel step: splits of several steps
    (70 keys in 3: 32, 32 and 6, the keys, values and block-table entries running ahead across
    a split's steps), a window's splits (tiny-mistral: the last 48 keys of 70, 16 each), and
    empty splits (a 16-token context in 8 splits of 16)."""
    engine = engine_of(preset, tmp_path_factory)
    s = schedule_for(engine, 1, splits)
    attention = next(op for op in s.ops if op.kind == "attention")
    assert attention.attrs["splits"] == splits and attention.tiles == splits * engine.config.num_heads
    check_step(engine, s, decode_batch(7), sizes=dict(BLOCK_L=16))


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-mistral"])
def test_waits_and_bumps_of_a_many_sm_schedule_run_and_every_counter_ends_at_its_bumpers(preset, tmp_path_factory):
    engine = engine_of(preset, tmp_path_factory)
    s = schedule_for(engine, 12)  # three splits a head: each combine waits for its head's
    assert next(op for op in s.ops if op.kind == "attention").attrs["splits"] == 3
    assert s.num_counters > 0 and any(ins.waits for ins in s.instructions)
    counters = check_step(engine, on_one_sm(s), decode_batch(4))
    bumpers = [0] * s.num_counters
    for ins in s.instructions:
        for c in ins.bumps:
            bumpers[c] += 1
    assert counters.tolist() == bumpers
    for ins in s.instructions:  # every wait's value is what its counter reaches
        assert all(v <= bumpers[c] for c, v in ins.waits)


@pytest.mark.parametrize("splits", [1, 8])
def test_a_padding_row_attends_to_nothing_and_writes_nowhere(splits, tmp_path_factory):
    """Its seq_len is 0: every split of it is empty, and the combine writes 0."""
    engine = engine_of("tiny-llama", tmp_path_factory)
    s = schedule_for(engine, 1, splits)
    batch = with_padding_row(decode_batch(3))
    cache = filled_cache(engine)
    kernel_cache, interp_cache = cache.clone(), cache.clone()
    logits, tokens, _ = run_kernel(s, engine, batch, kernel_cache)
    want_logits, want_tokens = interpret(s, engine.params, batch, interp_cache)
    torch.testing.assert_close(logits, want_logits, **TOL)
    torch.testing.assert_close(kernel_cache, interp_cache, **TOL)
    assert tokens.tolist() == want_tokens.tolist()
    real = engine.program(engine.params, decode_batch(3), cache.clone())
    torch.testing.assert_close(logits[:3], real, **TOL)
