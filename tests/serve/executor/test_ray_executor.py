"""Tensor and pipeline parallelism with ``--distributed-executor-backend ray`` on the local Ray
cluster the Ray test modules share (CPU, gloo, two ranks: this process and one Ray actor).

- A TP=2 engine whose other rank is a Ray actor generates what transformers generates, through
  ``LLM`` and through ``compiled-llm serve``; its ranks sit in one strictly packed placement
  group, one bundle per rank, on this node, and shutdown leaves no actor and no group behind.
- ``run_on_ranks`` reaches the actor's rank, and a function that raises there fails the engine
  naming the rank.
- A rank actor killed mid-generation fails the running generate, and every later one, with an
  ``EngineError`` naming the rank within 30 s; nothing is left behind, and the cluster runs a
  new engine afterwards: a PP=2 one whose second stage is a Ray actor, which generates what
  transformers generates, each stage's ranks in a strictly packed placement group of their own
  (stage 0's on this node).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

ray = pytest.importorskip("ray")

import openai  # noqa: E402
from helpers.rank_kill import kill_mid_generate  # noqa: E402
from helpers.lively import build_lively_engine, greedy_continuation  # noqa: E402
from helpers.ray_cluster import alive_actors, live_placement_groups, process_gone  # noqa: E402
from helpers.server_fixtures import serve_process  # noqa: E402

from compiled_llm import LLM, SamplingParams  # noqa: E402
from compiled_llm.engine.artifact import load_engine  # noqa: E402
from compiled_llm.errors import EngineError  # noqa: E402
from compiled_llm.serve.executor.ray_executor import RayExecutor  # noqa: E402

PROMPTS = [[5, 17, 33], [100, 2, 9, 41, 7, 7, 12, 60], list(range(20, 42))]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tp2(lively_tp2_engine, lively_bpe_checkpoint):
    """(engine directory, transformers model): the lively checkpoint sharded over two ranks."""
    return lively_tp2_engine, lively_bpe_checkpoint[1]


@pytest.fixture(scope="module")
def pp2_engine(lively_bpe_checkpoint, tmp_path_factory):
    """The lively checkpoint built into two pipeline stages (a layer each)."""
    return build_lively_engine(lively_bpe_checkpoint[0], tmp_path_factory.mktemp("ray-pp2") / "engine",
                               pipeline_parallel_size=2)


@pytest.fixture(scope="module")
def wants(tp2):
    _, hf = tp2
    out = [greedy_continuation(hf, p, MAX_TOKENS) for p in PROMPTS]
    assert min(w.min_margin for w in out) > 1e-4, "the oracle's greedy choices must not be near ties"
    return [list(w.token_ids) for w in out]


def assert_nothing_left():
    assert alive_actors("RankActor") == []
    assert live_placement_groups() == []


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def test_tp2_over_a_ray_actor_generates_what_transformers_does_and_leaves_nothing_behind(ray_cluster, tp2, wants):
    llm = LLM(str(tp2[0]), device="cpu", distributed_executor_backend="ray", max_num_batched_tokens=16)
    try:
        executor = llm.engine.executor
        assert isinstance(executor, RayExecutor)
        (group,) = live_placement_groups()
        (ours,) = executor._groups
        table = ray.util.placement_group_table(ours)
        assert table["placement_group_id"] == group.placement_group_id
        assert table["strategy"] == "STRICT_PACK"
        assert [b["CPU"] for b in table["bundles"].values()] == [1, 1]  # one bundle per rank
        (actor,) = alive_actors("RankActor")
        assert actor.node_id == ray.get_runtime_context().get_node_id()  # beside rank 0
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == wants
        ((_, pid),) = executor.run_on_ranks(rank_and_pid)
    finally:
        llm.shutdown()
    assert_nothing_left()
    assert process_gone(pid)  # the actor's process, not only the actor


# sent to the actor's rank by name (run_on_ranks)
def rank_and_pid(model, state):
    return model.tp_rank, os.getpid()


def stage_and_pid(model, state):
    return model.pp_rank, os.getpid()


def refuse(model, state):
    raise ValueError(f"rank {model.tp_rank} refuses")


def test_a_function_runs_on_the_actors_rank_and_one_that_raises_fails_naming_the_rank(ray_cluster, tp2):
    engine = load_engine(tp2[0])
    executor = RayExecutor(engine.engine_dir, engine.tp_size, engine.device)
    try:
        ((rank, pid),) = executor.run_on_ranks(rank_and_pid)
        assert rank == 1 and pid != os.getpid()
        with pytest.raises(EngineError, match=r"^tensor-parallel rank 1 failed: ValueError: rank 1 refuses$"):
            executor.run_on_ranks(refuse)
        with pytest.raises(EngineError, match=r"^tensor-parallel rank 1 failed"):
            executor.send("synchronize")  # and every later call
    finally:
        executor.shutdown()
    assert_nothing_left()
    assert not torch.distributed.is_initialized()  # the failed ranks' gloo group ended with them


def test_a_rank_error_the_monitor_has_not_recorded_yet_still_fails_the_call_naming_the_rank(ray_cluster, tp2,
                                                                                           monkeypatch):
    # the monitor thread takes a finished call before recording its error; the caller, reading the
    # same call's result in that moment, sees the error first
    engine = load_engine(tp2[0])
    executor = RayExecutor(engine.engine_dir, engine.tp_size, engine.device)
    try:
        monkeypatch.setattr(executor, "_settle", lambda timeout_s=0.0: None)  # the monitor never gets there
        with pytest.raises(EngineError, match=r"^tensor-parallel rank 1 failed: ValueError: rank 1 refuses$"):
            executor.run_on_ranks(refuse)
        with pytest.raises(EngineError, match=r"^tensor-parallel rank 1 failed"):
            executor.send("synchronize")
    finally:
        executor.shutdown()
    assert_nothing_left()


def test_serve_with_the_ray_backend_answers_openai_requests_as_transformers(ray_cluster, tp2, wants):
    with serve_process(tp2[0], "--distributed-executor-backend", "ray", env={"RAY_ADDRESS": ray_cluster}) as server:
        client = openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0)
        for prompt, want in zip(PROMPTS, wants):
            out = client.completions.create(model=str(tp2[0]), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
            assert out.choices[0].token_ids == want, server.log()[-3000:]
        assert "Ray actors" in server.log()
    deadline = time.monotonic() + 30  # the engine process's actor goes with it
    while alive_actors("RankActor") or live_placement_groups():
        assert time.monotonic() < deadline, (alive_actors("RankActor"), live_placement_groups())
        time.sleep(0.2)


def test_a_killed_rank_actor_fails_generate_naming_the_rank_within_30_s_then_a_pp2_engine_runs_as_transformers(
        ray_cluster, tp2, wants, pp2_engine):
    llm = LLM(str(tp2[0]), device="cpu", distributed_executor_backend="ray", max_num_seqs=4)
    try:
        ((_, pid),) = llm.engine.executor.run_on_ranks(rank_and_pid)
        error = kill_mid_generate(llm, pid, max_tokens=400)
        assert str(error).startswith("tensor-parallel rank 1 (a Ray actor) died") and "\n" not in str(error)
    finally:
        llm.shutdown()
    assert_nothing_left()
    assert process_gone(pid)
    assert not torch.distributed.is_initialized()
    # the cluster, and this process, run an engine again: a pipelined one, stage 1 an actor
    pp2 = LLM(str(pp2_engine), device="cpu", distributed_executor_backend="ray", max_num_batched_tokens=16)
    try:
        executor = pp2.engine.executor
        tables = [ray.util.placement_group_table(g) for g in executor._groups]
        assert [t["strategy"] for t in tables] == ["STRICT_PACK", "STRICT_PACK"]
        node_ip = ray.util.get_node_ip_address()
        assert [list(t["bundles"].values()) for t in tables] == [[{"CPU": 1, f"node:{node_ip}": 0.001}], [{"CPU": 1}]]
        outs = pp2.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == wants
        ((stage, pid),) = executor.run_on_ranks(stage_and_pid)
        assert stage == 1
    finally:
        pp2.shutdown()
    assert_nothing_left()
    assert process_gone(pid)
