"""`compiled-llm serve --data-parallel-size 2 --distributed-executor-backend ray` on the local Ray
cluster the Ray test modules share (CPU): each replica's engine core a Ray actor talking to the
front end over TCP, its engine sharded over two tensor-parallel ranks (the lively checkpoint), so
each replica's rank 1 is a Ray actor too. One server for the module, started after the first
test; the tests run in order, the last two each kill an actor.

- A replica that cannot load stops the others and is named; no actor or placement group stays.
- A replica whose start fails partway (here its second stage's placement group) leaves neither
  its listener nor the groups made before.
- 16 concurrent requests, streamed and not, get transformers' greedy text, both replicas serve,
  /health reports both live, no engine process is spawned beside the server, and each replica
  holds a strictly packed placement group of a bundle per rank.
- Killing one replica's engine core actor (SIGKILL) under load: its running requests end with an
  error naming the replica within 30 s, its waiting ones run on the other replica, which serves
  on; the dead replica's rank actor and placement group go at once, and their processes.
- Killing the last replica's rank actor under load: its requests end with errors (the running
  ones naming the rank) within 30 s, the server exits 1 as it does when its one engine dies, and
  no actor, placement group or actor process is left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request

import pytest

ray = pytest.importorskip("ray")

import openai  # noqa: E402
from helpers.ray_cluster import alive_actors, live_placement_groups, process_gone  # noqa: E402
from helpers import replica_requests  # noqa: E402
from helpers.replica_requests import GREEDY, answer_concurrently, generated_by_engine  # noqa: E402
from helpers.server_fixtures import engine_pids, scrape, serve_process, wait_until  # noqa: E402

MODEL = "lively-tp2"
MAX_NUM_SEQS = 4
PROMPTS = ["The quick brown fox", "A compiler lowers", "Once upon a time", "Paged attention keeps"]


@pytest.fixture(scope="module")
def server(ray_cluster, lively_tp2_engine, tmp_path_factory):
    log = tmp_path_factory.mktemp("ray_dp_server") / "serve.log"
    with serve_process(lively_tp2_engine, "--data-parallel-size", "2", "--distributed-executor-backend", "ray",
                       "--served-model-name", MODEL, "--max-num-seqs", str(MAX_NUM_SEQS), log_path=log,
                       env={"RAY_ADDRESS": ray_cluster}) as s:
        yield s


def expected_text(lively_oracle, lively_hf_tokenizer, prompt: str, max_tokens: int) -> str:
    return lively_oracle(lively_hf_tokenizer(prompt)["input_ids"], max_tokens)[1]


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        assert r.status == 200
        return json.loads(r.read())


def test_a_replica_that_cannot_load_stops_the_others_and_names_itself(  # before the server starts
        ray_cluster, lively_bpe_engine, tmp_path):
    import functools

    from compiled_llm.cli.main import make_parser
    from compiled_llm.cli.serve import load_engine
    from compiled_llm.errors import CompiledLLMError
    from compiled_llm.serve.engine_process.ray_replicas import start_ray_replicas

    def loader(source):
        return functools.partial(load_engine, make_parser().parse_args(["serve", str(source), "--device", "cpu"]))

    missing = tmp_path / "not-an-engine"
    missing.mkdir()
    with pytest.raises(CompiledLLMError, match="^data-parallel replica 1 of 2: the engine could not start: .*not-an-engine"):
        start_ray_replicas([loader(lively_bpe_engine), loader(missing)], 1, 1, "cpu")
    wait_until(lambda: not alive_actors("EngineCoreActor") and not live_placement_groups(), 15.0,
               "the replicas stopped")


def test_a_replica_whose_start_fails_partway_leaves_no_listener_and_no_placement_group(  # before the server
        ray_cluster, monkeypatch):
    from compiled_llm.serve.engine_process import ray_replicas

    listeners = []

    class RecordedListener(ray_replicas.ReplicaListener):
        def __init__(self, *args):
            super().__init__(*args)
            listeners.append(self)

    monkeypatch.setattr(ray_replicas, "ReplicaListener", RecordedListener)
    stage_1_refused = [[{"CPU": 1.0}], [{}]]  # Ray refuses an empty bundle, once stage 0's group is made
    with pytest.raises(ValueError):
        ray_replicas.StartingRayReplica(ray, 0, print, stage_1_refused, "127.0.0.1")
    (listener,) = listeners
    assert listener.fileno() == -1
    wait_until(lambda: not live_placement_groups(), 15.0, "stage 0's placement group removed")


def test_concurrent_requests_get_transformers_greedy_text_from_two_actor_replicas_each_in_a_group_of_its_own(
        server, lively_hf_tokenizer, lively_oracle):
    assert health(server.url) == {"data_parallel_size": 2, "live_replicas": 2, "dead_replicas": []}
    assert engine_pids(server.process.pid) == []  # the engine cores are Ray actors, not spawned processes
    assert len(alive_actors("EngineCoreActor")) == 2 and len(alive_actors("RankActor")) == 2
    groups = {g["name"]: g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"}
    assert sorted(groups) == ["compiled_llm-dp0-stage0", "compiled_llm-dp1-stage0"]
    assert {g["strategy"] for g in groups.values()} == {"STRICT_PACK"}
    assert all(list(g["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}] for g in groups.values())

    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(16)]
    max_tokens = [8 + i % 5 for i in range(16)]
    expected = [expected_text(lively_oracle, lively_hf_tokenizer, p, n) for p, n in zip(prompts, max_tokens)]
    before = scrape(server.url, by_engine=True)
    assert answer_concurrently(server.api_url, MODEL, prompts, max_tokens) == expected
    generated = generated_by_engine(before, scrape(server.url, by_engine=True))
    assert sum(generated) == sum(max_tokens) and min(generated) > 0


def test_killing_a_replica_actor_mid_load_ends_or_retries_its_requests_and_leaves_nothing_behind(
        server, lively_hf_tokenizer, lively_oracle):
    before = {a.pid for a in alive_actors("EngineCoreActor") + alive_actors("RankActor")}
    victim = alive_actors("EngineCoreActor")[0].pid
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} again {i}" for i in range(3 * MAX_NUM_SEQS)]
    max_tokens = 60

    def one(aclient, prompt: str):
        return replica_requests.stream_outcome(aclient, MODEL, prompt, max_tokens)

    def both_full() -> bool:
        m = scrape(server.url, by_engine=True)
        return all(m[f"compiled_llm:num_requests_running{{engine={i}}}"] == MAX_NUM_SEQS for i in (0, 1))

    async def main():
        async with openai.AsyncOpenAI(base_url=server.api_url, api_key="x", max_retries=0) as aclient:
            calls = [asyncio.ensure_future(one(aclient, p)) for p in prompts]
            await asyncio.to_thread(wait_until, both_full, 60.0, "both replicas running")
            os.kill(victim, signal.SIGKILL)
            return time.monotonic(), await asyncio.gather(*calls)

    killed_at, results = asyncio.run(main())
    body = health(server.url)
    assert body["live_replicas"] == 1 and len(body["dead_replicas"]) == 1
    (dead,) = body["dead_replicas"]
    errors = [(message, at) for kind, message, at in results if kind == "error"]
    assert 1 <= len(errors) <= MAX_NUM_SEQS + 1
    for message, at in errors:
        assert message.startswith(f"data-parallel replica {dead} stopped: the engine actor (pid {victim}) died")
        assert at - killed_at < 30
    for (kind, text, _), prompt in zip(results, prompts):
        if kind == "ok":  # its waiting requests ran on the other replica, as did that one's own
            assert text == expected_text(lively_oracle, lively_hf_tokenizer, prompt, max_tokens)
    # the dead replica's rank actor went with it, and its placement group is removed
    wait_until(lambda: len(alive_actors("RankActor")) == 1 and len(live_placement_groups()) == 1, 15.0,
               "the dead replica's actors and groups gone")
    gone = before - {a.pid for a in alive_actors("EngineCoreActor") + alive_actors("RankActor")}
    assert len(gone) == 2 and all(process_gone(pid) for pid in gone)

    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, **GREEDY)
    assert out.choices[0].text == expected_text(lively_oracle, lively_hf_tokenizer, PROMPTS[0], 6)


def test_killing_the_last_replicas_rank_actor_mid_load_fails_its_requests_and_the_server_exits_leaving_nothing(
        server):
    """Runs after the test above: one replica is left."""
    assert health(server.url)["live_replicas"] == 1
    (core,), (rank,) = alive_actors("EngineCoreActor"), alive_actors("RankActor")
    pids = [core.pid, rank.pid]
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} last {i}" for i in range(2 * MAX_NUM_SEQS)]

    def one(aclient, prompt: str):
        return replica_requests.stream_outcome(aclient, MODEL, prompt, 60)

    def full() -> bool:
        m = scrape(server.url)
        return m["compiled_llm:num_requests_running"] == MAX_NUM_SEQS

    async def main():
        async with openai.AsyncOpenAI(base_url=server.api_url, api_key="x", max_retries=0) as aclient:
            calls = [asyncio.ensure_future(one(aclient, p)) for p in prompts]
            await asyncio.to_thread(wait_until, full, 60.0, "the replica running")
            os.kill(rank.pid, signal.SIGKILL)
            return time.monotonic(), await asyncio.gather(*calls)

    killed_at, results = asyncio.run(main())
    assert all(kind == "error" and at - killed_at < 30 for kind, _, at in results), results
    messages = {message for _, message, _ in results}
    # its running requests hear the rank's death, named; the waiting ones that the engine is gone
    assert any("tensor-parallel rank 1 (a Ray actor) died" in m for m in messages), messages
    assert server.process.wait(30) == 1  # no replica left: the server stops, as with one engine
    wait_until(lambda: not alive_actors("EngineCoreActor") and not alive_actors("RankActor")
               and not live_placement_groups(), 15.0, "every actor and placement group gone")
    assert all(process_gone(pid) for pid in pids)
    assert "Traceback" not in server.log(), server.log()
