"""On a GPU, a megakernel engine's decode steps run as one launch of the persistent kernel on
every SM, and generate what the per-op program generates: the same greedy tokens step after step
in fp32, close logits in bf16, the same through a captured CUDA graph; every counter ends at the
number of tiles that bump it; and an engine whose schedule wants more SMs than the GPU has is
refused at load."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from compiled_llm.engine.artifact import load_engine
from compiled_llm.engine.build import build_engine
from compiled_llm.errors import EngineError
from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.megakernel.program import MegakernelProgram, check_fits
from compiled_llm.model.spec import kv_cache_shape

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BLOCK_SIZE = 16
BLOCKS_PER_SEQ = 8  # contexts up to 128 tokens
TINY = ["tiny-qwen2", "tiny-qwen3", "tiny-llama", "tiny-mistral"]
# Qwen2.5-0.5B's shapes (hidden 896, 14 heads, 2 KV heads, 24 layers), random weights
LARGE = "qwen2.5-0.5b"


def sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


_ENGINES: dict = {}


def engine_of(preset: str, dtype: str, tmp_path_factory):
    key = (preset, dtype)
    if key not in _ENGINES:
        d = tmp_path_factory.mktemp(f"{preset}-{dtype}") / "engine"
        extra = {"load_format": "dummy"} if preset == LARGE else {}
        build_engine(preset, d, dtype=dtype, device="cuda", decode_backend="megakernel", progress=False, **extra)
        _ENGINES[key] = load_engine(d, device="cuda")
    return _ENGINES[key]


def filled_cache(engine):
    torch.manual_seed(0)
    shape = kv_cache_shape(engine.config, BLOCKS_PER_SEQ * 8, BLOCK_SIZE)
    return (torch.randn(shape, device="cuda") * 0.5).to(engine.dtype)


class Sequences:
    """``rows`` sequences at contexts 70, 61, ... (past a block boundary; the first past
    tiny-mistral's 48-token window), each with the same number of blocks, so that every step's
    batch has the same shapes (what a CUDA graph replays)."""

    def __init__(self, rows: int):
        self.cached = [69 - 9 * i for i in range(rows)]
        self.tokens = [3 + 11 * i for i in range(rows)]

    def batch(self):
        seqs = [ScheduledSeq([t], c, list(range(BLOCKS_PER_SEQ * i, BLOCKS_PER_SEQ * (i + 1))))
                for i, (t, c) in enumerate(zip(self.tokens, self.cached))]
        return pack_batch(seqs, BLOCK_SIZE, "cuda")

    def advance(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.cached = [c + 1 for c in self.cached]


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def bumpers(schedule) -> list[int]:
    counts = [0] * schedule.num_counters
    for ins in schedule.instructions:
        for c in ins.bumps:
            counts[c] += 1
    return counts


def run_steps(engine, rows: int, steps: int, exact: bool):
    """Decode ``steps`` steps through the megakernel and through the per-op program, each on its
    own cache. fp32 (``exact``): each path feeds its own greedy tokens and they must agree; bf16:
    both are fed the per-op tokens and the logits must be close."""
    program = engine.program
    assert isinstance(program, MegakernelProgram)
    mk_cache = filled_cache(engine)
    ref_cache = mk_cache.clone()
    seqs = Sequences(rows)
    before = program.decode_steps
    for _ in range(steps):
        batch = seqs.batch()
        logits = program(engine.params, batch, mk_cache).clone()
        ref = program.per_op(engine.params, batch, ref_cache)
        assert logits.shape == ref.shape
        if exact:
            torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
            assert logits.argmax(-1).tolist() == ref.argmax(-1).tolist()
        else:
            assert rel_err(logits, ref) < 2e-2
        seqs.advance(ref.argmax(-1).tolist())
    torch.cuda.synchronize()
    assert program.decode_steps == before + steps
    if exact:
        torch.testing.assert_close(mk_cache, ref_cache, rtol=1e-4, atol=1e-4)
    return program


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("preset", TINY)
def test_fp32_decode_steps_give_the_per_op_greedy_tokens(preset, rows, tmp_path_factory):
    engine = engine_of(preset, "float32", tmp_path_factory)
    assert engine.program.schedule.num_sms == sm_count()
    run_steps(engine, rows, steps=6, exact=True)


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("preset", TINY)
def test_bf16_decode_steps_give_logits_close_to_the_per_op_program(preset, rows, tmp_path_factory):
    run_steps(engine_of(preset, "bfloat16", tmp_path_factory), rows, steps=4, exact=False)


@pytest.mark.parametrize("rows", [1, 8])
def test_a_qwen2_5_0_5b_shaped_model_decodes_as_the_per_op_program_in_fp32(rows, tmp_path_factory):
    run_steps(engine_of(LARGE, "float32", tmp_path_factory), rows, steps=4, exact=True)


@pytest.mark.parametrize("rows", [1, 8])
def test_in_bf16_the_megakernel_is_no_further_from_fp32_than_the_per_op_program(rows, tmp_path_factory):
    """24 layers of random weights in bf16 drift from any other summation order by a few percent,
    so the bf16 megakernel is held to the per-op bf16 program's own distance from the same model
    run in fp32 (the bf16 weights, widened)."""
    bf16, fp32 = engine_of(LARGE, "bfloat16", tmp_path_factory), engine_of(LARGE, "float32", tmp_path_factory)
    widened = {n: bf16.params[n].float() for n in fp32.params}
    mk_cache = filled_cache(bf16)
    op_cache, ref_cache = mk_cache.clone(), mk_cache.float()
    seqs = Sequences(rows)
    for _ in range(4):
        batch = seqs.batch()
        mk = bf16.program(bf16.params, batch, mk_cache).clone()
        op = bf16.program.per_op(bf16.params, batch, op_cache)
        ref = fp32.program.per_op(widened, batch, ref_cache)
        assert rel_err(mk, ref) <= 2 * rel_err(op, ref) + 1e-3
        seqs.advance(ref.argmax(-1).tolist())


@pytest.mark.parametrize("preset, dtype", [("tiny-qwen3", "float32"), (LARGE, "bfloat16")])
def test_every_counter_ends_at_the_number_of_tiles_that_bump_it(preset, dtype, tmp_path_factory):
    engine = engine_of(preset, dtype, tmp_path_factory)
    program = engine.program
    for rows in (1, 8):
        program(engine.params, Sequences(rows).batch(), filled_cache(engine))
        torch.cuda.synchronize()
        assert program.device_state(engine.params, filled_cache(engine)).counters.tolist()[:program.schedule.num_counters] \
            == bumpers(program.schedule)


@pytest.mark.parametrize("preset, dtype", [("tiny-mistral", "float32"), (LARGE, "float32"), ("tiny-qwen3", "bfloat16")])
def test_a_captured_cuda_graph_replays_the_decode_steps(preset, dtype, tmp_path_factory):
    engine = engine_of(preset, dtype, tmp_path_factory)
    program, params = engine.program, engine.params
    rows = 4
    seqs = Sequences(rows)
    static = seqs.batch()
    mk_cache = filled_cache(engine)
    ref_cache = mk_cache.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles; rewrites the first step's keys and values as the replay will
        program(params, static, mk_cache)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = program(params, static, mk_cache)
    for _ in range(5):
        batch = seqs.batch()
        for dst, src in zip(static, batch):
            dst.copy_(src)
        graph.replay()
        ref = program.per_op(params, batch, ref_cache)
        if dtype == "float32":
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
            assert out.argmax(-1).tolist() == ref.argmax(-1).tolist()
        else:
            assert rel_err(out, ref) < 2e-2
        seqs.advance(ref.argmax(-1).tolist())


def test_a_schedule_for_more_sms_than_the_gpu_has_is_refused(tmp_path_factory):
    engine = engine_of("tiny-llama", "float32", tmp_path_factory)
    s = engine.program.schedule
    check_fits(s, torch.device("cuda"))
    too_wide = dataclasses.replace(s, num_sms=sm_count() + 1)
    with pytest.raises(EngineError, match=f"made for {sm_count() + 1} SMs") as e:
        check_fits(too_wide, torch.device("cuda"))
    assert "\n" not in str(e.value)


def test_a_megakernel_engine_under_llm_captures_its_decode_graphs_and_generates_the_per_op_tokens(tmp_path):
    """The runner's capture warms each bucket up with host syncs made errors: the first decode
    step, which encodes the schedule, must not synchronise, or the engine runs every step eagerly."""
    import warnings

    from compiled_llm.serve.llm import LLM
    from compiled_llm.serve.sampling_params import SamplingParams

    prompts = [[5, 9, 33, 100], [7] * 19, [200, 3, 44, 51, 60, 71, 2]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = {}
    for backend in ("per-op", "megakernel"):
        build_engine("tiny-qwen3", tmp_path / backend, dtype="float32", decode_backend=backend, progress=False)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            llm = LLM(str(tmp_path / backend))
            llm.capture_cuda_graphs()
            outputs[backend] = [list(o.outputs[0].token_ids) for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params)]
        assert not [w for w in seen if "capture failed" in str(w.message)], backend
        if backend == "megakernel":
            assert llm.model.program.decode_steps > 0
        del llm
    assert outputs["megakernel"] == outputs["per-op"]


def test_a_timed_step_computes_the_same_and_stamps_every_instruction_in_order(tmp_path_factory):
    from compiled_llm.megakernel import triton_kernel
    from compiled_llm.megakernel.timeline import measured

    engine = engine_of("tiny-qwen3", "float32", tmp_path_factory)
    program, params = engine.program, engine.params
    batch, cache = Sequences(3).batch(), filled_cache(engine)
    untimed = program(params, batch, cache.clone()).clone()
    state = program.device_state(params, cache)
    stamps = torch.zeros((len(program.schedule.instructions), 3), dtype=torch.int64, device="cuda")
    state.counters.zero_()
    timed_cache = cache.clone()
    triton_kernel.launch(state.encoded, state.counters, program.schedule.num_sms, batch.token_ids, batch.positions,
                         batch.slot_mapping, batch.seq_lens, batch.block_tables, timed_cache, stamps=stamps)
    torch.cuda.synchronize()
    assert torch.equal(state.logits[:3], untimed)
    _, spent = measured(program.schedule, stamps.cpu().tolist())  # raises on a stamp out of order
    assert spent["step"] > 0 and spent["wait"] >= 0
