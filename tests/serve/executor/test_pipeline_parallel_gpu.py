"""Pipeline parallelism on two GPUs (NCCL): skipped unless two are visible.

A PP=2 engine of a transformers-written checkpoint (float32, four layers split 2 + 2) generates
the same greedy tokens as its PP=1 engine:
- with CUDA graphs: each stage replays its decode micro-batches' graphs, activations and logits
  sent between them without headers (``serve/worker/pipeline_lanes.py``); graphs are captured on
  first use, on rank 0 as on stage 1;
- with every decode step cut into as many micro-batches as the lanes hold (lane 1's own graphs);
- with every graph captured before the first step (what a build's warm-up and benchmarks do);
- eagerly (``enforce_eager``), on the same lanes.
Every rank is asked for its graphs (a rank whose capture fails runs eagerly, only warning in its
own log): each captured its lanes' graphs and none failed. What each rank's lanes hold was held
back when the KV cache was sized. Each engine then shuts down in under 30 s (its graphs go
before NCCL's teardown).

Run on a machine with two GPUs:  python -m pytest -q -s tests/serve/executor/test_pipeline_parallel_gpu.py
(-s prints each run's decode speed).
"""

from __future__ import annotations

import time

import pytest
import torch
from helpers.parallel_checkpoints import FAMILIES

from compiled_llm import LLM, SamplingParams
from compiled_llm.serve.worker import pipeline_lanes

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

LAYERS = 4


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The PP=1 and PP=2 engines of one Qwen2 checkpoint written by transformers (float32: the
    stages' arithmetic is the unsplit engine's, so greedy choices cannot flip on rounding)."""
    from compiled_llm.engine.build import build_engine

    source = tmp_path_factory.mktemp("pp-gpu-checkpoint")
    torch.manual_seed(0)
    FAMILIES["qwen2"](layers=LAYERS).save_pretrained(source)
    out = {}
    for size in (1, 2):
        out[size] = tmp_path_factory.mktemp(f"pp{size}") / "engine"
        build_engine(str(source), out[size], dtype="float32", device="cuda", pipeline_parallel_size=size,
                     progress=False)
    return out


def requests(vocab_size: int, n: int = 24, seed: int = 0):
    """``n`` prompts of mixed lengths and lengths of output: decode batches shrink through many
    buckets as requests finish."""
    import random

    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(vocab_size) for _ in range(rng.randint(3, 120))]} for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(8, 40), temperature=0.0, ignore_eos=True, detokenize=False)
              for _ in range(n)]
    return prompts, params


def run(engine, capture_first: bool = False, **options):
    """(tokens, graphs captured on rank 0, every rank's ``RankGraphs``) of one engine over
    ``requests``; what each rank's lanes hold must have been held back when the KV cache was
    sized, and the engine must then shut down in under 30 s."""
    llm = LLM(str(engine), gpu_memory_utilization=0.3, **options)
    try:
        if capture_first:
            assert llm.engine.capture_cuda_graphs()
        prompts, params = requests(llm.engine.model.config.vocab_size)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        st = llm.stats
        print(f"\n  {engine.parent.name} {options or ''} capture_first={capture_first}: wall {time.perf_counter() - t0:.2f} s, "
              f"decode {st.decode_tokens / max(st.decode_s, 1e-9):,.0f} tok/s, {st.graphs_captured} graphs")
        ranks = llm.engine.rank_graphs()
        held_back = st.memory["reserved_gib"] * 2**30
        for rank, report in enumerate(ranks):
            assert report.lane_bytes <= held_back, f"rank {rank}'s lanes hold more than the KV sizing held back"
        result = [o.outputs[0].token_ids for o in outs], st.graphs_captured, ranks
    finally:
        t0 = time.monotonic()
        llm.shutdown()
    assert time.monotonic() - t0 < 30, "shutdown hung"
    return result


@pytest.fixture(scope="module")
def want(engines):
    tokens, graphs, _ = run(engines[1])
    assert graphs > 0
    return tokens


def test_pp2_with_cuda_graphs_generates_what_pp1_does(engines, want):
    got, graphs, ranks = run(engines[2])
    assert got == want
    assert graphs > 0 and len(ranks) == 2
    for rank, report in enumerate(ranks):
        assert report.lanes and report.lane_bytes > 0, f"rank {rank} decoded on lanes"
        assert not any(g.failed for g in report.lanes), f"a capture failed on rank {rank} (see its warning)"
        assert report.lanes[0].captured, f"rank {rank} replayed lane 0's graphs"


def test_pp2_cutting_every_decode_step_into_micro_batches_generates_what_pp1_does(engines, want, monkeypatch):
    """Rank 0 plans each step: as many micro-batches as the lanes hold (a tiny model's cost
    keeps its steps whole), which stage 1 follows."""
    monkeypatch.setattr(pipeline_lanes, "decode_micro_batches", lambda most, *costs: most)
    got, graphs, ranks = run(engines[2])
    assert got == want
    for rank, report in enumerate(ranks):
        assert not any(g.failed for g in report.lanes), f"a capture failed on rank {rank} (see its warning)"
        assert report.lanes[1].captured, f"lane 1 replayed graphs of its own on rank {rank}"


def test_pp2_capturing_every_graph_first_generates_what_pp1_does(engines, want):
    got, graphs, ranks = run(engines[2], capture_first=True)
    assert got == want
    for rank, report in enumerate(ranks):
        assert [g.captured for g in report.lanes] == [g.buckets for g in report.lanes], f"rank {rank}"
    assert graphs == sum(len(g.buckets) for g in ranks[0].lanes)


def test_pp2_eager_generates_what_pp1_does(engines, want):
    got, graphs, ranks = run(engines[2], enforce_eager=True)
    assert got == want
    assert graphs == 0
    for report in ranks:  # decode steps still run headerless, on the lanes
        assert len(report.lanes) == 2 and not any(g.captured for g in report.lanes)
