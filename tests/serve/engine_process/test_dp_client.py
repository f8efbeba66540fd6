"""The data-parallel client over stand-in replicas (what it sends each, what it hands the front
end): requests split by the router, aborts sent where their requests are, each step tagged
with its replica, and a replica's death taking down only its own requests, started again
elsewhere when no output of theirs has been sent."""

from __future__ import annotations

import asyncio
import dataclasses

from compiled_llm.serve.engine_process.dp_client import DataParallelClient, request_load
from compiled_llm.serve.engine_process.engine_messages import EngineInfo, EngineSnapshot
from compiled_llm.serve.sampling_params import SamplingParams

BS = 4
INFO = EngineInfo(name="m", vocab_size=100, max_model_len=256, block_size=BS, num_blocks=64, max_num_seqs=8,
                  generation_defaults={}, device="cpu")
IDLE = EngineSnapshot(0, 0, 0.0, 0, 0, 0, 0, 0)


class StandInReplica:
    """An engine core client that records what it is sent; the test speaks for its engine."""

    def __init__(self):
        self.info, self.tokenizer, self.validator, self.start_snapshot = INFO, None, None, IDLE
        self.sent: list[tuple] = []
        self.alive = True
        self.closed = False
        self.on_message = None

    def start(self, on_message) -> None:
        self.on_message = on_message

    def send(self, message: tuple) -> None:
        self.sent.append(message)

    async def close(self, timeout: float = 30.0) -> None:
        self.closed = True

    def added(self) -> list[str]:
        return [entry[0] for m in self.sent if m[0] == "add" for entry in m[1]]


def started(n: int = 2):
    replicas = [StandInReplica() for _ in range(n)]
    client = DataParallelClient(replicas)
    heard: list[tuple] = []
    client.start(heard.append)
    return client, replicas, heard


def entry(rid: str, system: int, user: int, max_tokens: int = 8) -> tuple:
    ids = [10 * system + k % 10 for k in range(3 * BS)] + [90 + user]
    return (rid, None, ids, SamplingParams(max_tokens=max_tokens))


def output(rid: str, finished: bool) -> tuple:
    """An encoded output: one new token, finished or not."""
    return (rid, finished, None, None, [(0, "", [5], "length" if finished else None, None, None, None)])


def test_requests_that_share_a_prefix_go_to_one_replica_and_aborts_follow_them():
    client, replicas, _ = started()
    client.send(("add", [entry("a0", 0, 0), entry("b0", 1, 0)], True))
    client.send(("add", [entry("a1", 0, 1), entry("b1", 1, 1), entry("a2", 0, 2)], False))
    a_home = 0 if "a0" in replicas[0].added() else 1
    assert replicas[a_home].added() == ["a0", "a1", "a2"] and replicas[1 - a_home].added() == ["b0", "b1"]
    assert [m[2] for m in replicas[a_home].sent] == [True, False]  # each batch keeps its stream flag
    client.send(("abort", ["a1", "b0", "unknown"]))
    assert replicas[a_home].sent[-1] == ("abort", ["a1"]) and replicas[1 - a_home].sent[-1] == ("abort", ["b0"])


def test_each_step_is_handed_on_tagged_with_its_replica_and_finished_requests_free_their_load():
    client, replicas, heard = started()
    client.send(("add", [entry("r", 0, 0)], True))
    home = 0 if replicas[0].added() else 1
    assert client.router.loads[home] == request_load(entry("r", 0, 0)[2], SamplingParams(max_tokens=8))
    busy = IDLE._replace(running=1)
    replicas[home].on_message(("step", [output("r", False)], [], ["r"], busy))
    replicas[home].on_message(("step", [output("r", True)], [], [], IDLE))
    assert heard == [("step", [output("r", False)], [], ["r"], busy, home),
                     ("step", [output("r", True)], [], [], IDLE, home)]
    assert client.router.loads == [0, 0]


def test_a_dead_replicas_answered_requests_fail_and_the_unanswered_start_again_on_a_live_one():
    client, replicas, heard = started()
    client.send(("add", [entry("a0", 0, 0), entry("b0", 1, 0)], True))
    client.send(("add", [entry("a1", 0, 1)], True))
    doomed = 0 if "a0" in replicas[0].added() else 1
    survivor = replicas[1 - doomed]
    replicas[doomed].on_message(("step", [output("a0", False)], [], ["a0"], IDLE._replace(running=1, waiting=1)))
    replicas[doomed].on_message(("lost", "the engine process exited (exit code -9)"))

    message = "data-parallel replica %d stopped: the engine process exited (exit code -9)" % doomed
    # its gauges drop to nothing (it ran one request and had one waiting)
    assert heard[-1] == ("step", [], [("a0", "engine", message)], [], IDLE, doomed)
    assert survivor.sent[-1] == ("add", [entry("a1", 0, 1)], True)  # never answered: nothing was streamed
    assert client.live_replicas == [1 - doomed] and client.failures == {doomed: "the engine process exited (exit code -9)"}
    client.send(("add", [entry("a2", 0, 2)], True))
    assert survivor.added()[-1] == "a2" and not any(m[0] == "lost" for m in heard)


def test_only_the_last_replicas_death_is_heard_as_the_engine_lost():
    client, replicas, heard = started()
    replicas[0].on_message(("lost", "the engine process exited (exit code 1)"))
    assert heard[-1][0] == "step"
    replicas[1].on_message(("lost", "the engine process exited (exit code -9)"))
    assert heard[-1] == ("lost", "every data-parallel replica stopped (the last, replica 1: "
                                 "the engine process exited (exit code -9))")
    asyncio.run(client.close())
    assert all(r.closed for r in replicas)


def test_an_aborted_request_whose_replica_dies_ends_there_and_is_not_started_again():
    client, replicas, heard = started()
    client.send(("add", [entry("a0", 0, 0)], True))
    doomed = 0 if replicas[0].added() else 1
    client.send(("abort", ["a0"]))
    replicas[doomed].on_message(("lost", "the engine process exited (exit code -9)"))
    assert not replicas[1 - doomed].added()
    assert [rid for rid, _, _ in heard[-1][2]] == ["a0"]  # its consumer is told, so nothing waits on it
    assert client.router.requests == [0, 0]


def test_a_request_is_started_again_once_and_fails_if_its_second_replica_dies_too():
    """A request whose prefill kills its engine (the OOM killer, a crash) must not take every
    replica down in turn."""
    client, replicas, heard = started(3)
    client.send(("add", [entry("a0", 0, 0)], True))
    first = next(i for i, r in enumerate(replicas) if r.added())
    replicas[first].on_message(("lost", "the engine process exited (exit code -9)"))
    second = next(i for i, r in enumerate(replicas) if i != first and r.added())
    replicas[second].on_message(("lost", "the engine process exited (exit code -9)"))
    third = next(i for i in range(3) if i not in (first, second))
    assert not replicas[third].added()
    assert [rid for rid, kind, _ in heard[-1][2]] == ["a0"]


def test_requests_are_checked_against_the_smallest_replica():
    """Replicas size their KV caches from their own free memory: the front end accepts only what
    every replica can hold."""
    replicas = [StandInReplica() for _ in range(2)]
    replicas[1].info = dataclasses.replace(INFO, num_blocks=16)
    replicas[1].validator = "the smaller replica's validator"
    client = DataParallelClient(replicas)
    assert client.info.num_blocks == 16 and client.validator == "the smaller replica's validator"
