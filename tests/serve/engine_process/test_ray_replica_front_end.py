"""The parts of the Ray data-parallel replicas (``ray_replicas``) that run without a Ray cluster:

- a replica actor takes the front end's log level and engine cache, never its API key (an
  actor's creation arguments are kept in Ray's GCS);
- on a CPU a replica runs as many torch threads as its bundle has CPUs, whatever the front end's
  machine has; ``serve``'s Ray replicas are placed by the cluster, never by the front end's cores;
- the replica's connection: a stray connection that sends nothing holds up neither the startup
  polls nor the replica's own connection; one with a wrong token is dropped; both ends set
  TCP_NODELAY;
- a replica whose socket closes is reported lost off the event loop: the wait for Ray to say
  how its actor ended does not stall the loop (the other replicas' streams, /health).
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time

from compiled_llm.cache_dir import CACHE_DIR_ENV
from compiled_llm.cli.main import LOGGING_LEVEL_VAR, make_parser
from compiled_llm.serve.engine_process.dp_placement import ReplicaPlacement
from compiled_llm.serve.engine_process.engine_messages import EngineInfo, EngineSnapshot
from compiled_llm.serve.engine_process.message_channel import MessageChannel
from compiled_llm.serve.engine_process.ray_replicas import (TOKEN_BYTES, RayEngineCoreClient, ReplicaListener,
                                                            connect_to_front_end, replica_cpu_placement,
                                                            replica_settings)
from compiled_llm.serve.server_config import API_KEY_VAR

INFO = EngineInfo(name="m", vocab_size=100, max_model_len=256, block_size=4, num_blocks=64, max_num_seqs=8,
                  generation_defaults={}, device="cpu")
IDLE = EngineSnapshot(0, 0, 0.0, 0, 0, 0, 0, 0)


def test_a_replica_actor_gets_the_log_level_and_engine_cache_but_never_the_api_key():
    environ = {LOGGING_LEVEL_VAR: "DEBUG", CACHE_DIR_ENV: "/models/cache", API_KEY_VAR: "sk-secret",
               "COMPILED_LLM_SOMETHING_ELSE": "x", "HOME": "/root"}
    assert replica_settings(environ) == {LOGGING_LEVEL_VAR: "DEBUG", CACHE_DIR_ENV: "/models/cache"}
    assert replica_settings({API_KEY_VAR: "sk-secret"}) == {}


def test_a_cpu_replica_runs_a_torch_thread_per_cpu_of_its_bundle_and_a_gpu_replica_is_left_to_ray():
    assert replica_cpu_placement("cpu", {"CPU": 1.0}) == ReplicaPlacement(cpu_threads=1)
    assert replica_cpu_placement("cpu", {"CPU": 4.0, "memory": 1e9}) == ReplicaPlacement(cpu_threads=4)
    assert replica_cpu_placement("cpu", {"CPU": 0.5}) == ReplicaPlacement(cpu_threads=1)
    assert replica_cpu_placement("cuda", {"GPU": 1.0}) is None


def test_serves_ray_replicas_are_placed_by_the_cluster_not_by_the_front_ends_cores():
    from compiled_llm.cli.engine_args import build_config
    from compiled_llm.cli.serve import load_engine, replica_loads

    def loads(*flags):
        args = make_parser().parse_args(["serve", "tiny-qwen2", "--data-parallel-size", "2", *flags])
        return replica_loads(args, build_config(args, for_source=True))

    for device in ("cpu", "auto"):
        ray_loads = loads("--device", device, "--distributed-executor-backend", "ray")
        assert len(ray_loads) == 2
        for load in ray_loads:  # no placement of the front end's: the actor takes its bundle's
            assert load.func is load_engine and len(load.args) == 1 and not load.keywords
    # the mp backend's replicas share this machine's cores
    (placement,) = {load.args[1] for load in loads("--device", "cpu")}
    assert isinstance(placement, ReplicaPlacement) and placement.cpu_threads >= 1


def poll_until(listener: ReplicaListener, within_s: float) -> int | None:
    deadline = time.monotonic() + within_s
    while (fd := listener.accept()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return fd


def test_a_stray_silent_connection_holds_up_neither_the_polls_nor_the_replicas_connection():
    token = secrets.token_bytes(TOKEN_BYTES)
    listener = ReplicaListener("127.0.0.1", token, 0)
    silent = socket.create_connection(listener.address)
    wrong = socket.create_connection(listener.address)
    wrong.sendall(b"x" * TOKEN_BYTES)
    silent.settimeout(5.0)
    wrong.settimeout(5.0)
    try:
        t0 = time.monotonic()
        assert listener.accept() is None
        assert time.monotonic() - t0 < 0.5  # it did not wait for the silent one's token
        assert wrong.recv(1) == b""  # dropped: it is not the replica
        replica = {}
        actor = threading.Thread(target=lambda: replica.update(fd=connect_to_front_end(listener.address, token)))
        actor.start()
        fd = poll_until(listener, 10.0)
        actor.join()
        assert fd is not None
        with socket.socket(fileno=fd) as front, socket.socket(fileno=replica["fd"]) as back:
            assert front.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            assert back.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            assert listener.fileno() == -1  # one connection per replica: the listener is closed
            back.setblocking(True)
            front.sendall(b"ok")
            assert back.recv(2) == b"ok"
        assert silent.recv(1) == b""  # the stray one is closed with the listener
    finally:
        listener.close()
        silent.close()
        wrong.close()


class SlowToEndReplica:
    """A ``RayReplica`` whose actor Ray takes ``END_WAIT_S`` to see dead (the actor closes its
    socket before it stops its engine)."""

    END_WAIT_S = 0.8

    def __init__(self):
        self.index = 3
        self.released = threading.Event()

    def ended(self, timeout_s: float = 0.0) -> bool:
        return self.released.wait(timeout_s)

    def end_reason(self) -> str:
        time.sleep(self.END_WAIT_S)
        return "the engine actor (pid 4242) died: killed"

    def release(self) -> None:
        self.released.set()


def test_a_lost_replicas_reason_is_worked_out_off_the_event_loop_which_serves_on_meanwhile():
    front, actor_end = socket.socketpair()
    replica = SlowToEndReplica()
    fd = front.detach()
    client = RayEngineCoreClient(MessageChannel(fd, fd), INFO, None, IDLE, replica)

    async def main() -> tuple[list, float, float]:
        heard: list[tuple] = []
        client.start(heard.append)
        actor_end.close()
        t0, longest_tick = time.monotonic(), 0.0
        while not heard:
            tick = time.monotonic()
            await asyncio.sleep(0.01)
            longest_tick = max(longest_tick, time.monotonic() - tick)
        return heard, longest_tick, time.monotonic() - t0

    heard, longest_tick, took = asyncio.run(main())
    assert heard == [("lost", "the engine actor (pid 4242) died: killed")]
    assert took >= SlowToEndReplica.END_WAIT_S and longest_tick < SlowToEndReplica.END_WAIT_S / 2
    assert replica.released.is_set()  # its actor and groups go back to the cluster at once
    client.channel.close()
