"""Data-parallel replicas as Ray actors: ``serve --data-parallel-size N --distributed-executor-backend
ray``. Each replica's engine core runs in a Ray actor, anywhere on the cluster, and talks to the
front end over TCP; the front end (``DataParallelClient``, its router, its retries on a dead
replica, ``/health``) is the one that serves local replicas, over clients of this module.

Placement: a replica is one placement group per pipeline stage, one bundle per tensor-parallel
rank (``GPU: 1`` on GPUs, ``CPU: 1`` on a CPU), each packed strictly onto one node; the engine
core actor (the engine's rank 0) holds bundle 0 of stage 0's, and its executor puts the other
ranks in the rest (``ray_executor.place_ranks_in``). The front end makes and removes the groups:
Ray keeps an actor's own groups until its job ends, so a killed replica's would stay reserved.
On GPUs Ray gives each actor its GPU (``CUDA_VISIBLE_DEVICES``); the engine directory must be at
the same path on every node that runs a replica (as the model path is for vLLM).

Connection: the front end listens on an ephemeral port of its node's IP (the one Ray reports),
one listener per replica (``ReplicaListener``); the actor connects and first sends a random
token that the front end gave it. The front end reads nothing else (no pickle) from a
connection before it has the token, and takes one connection per replica. From then on the
socket (``TCP_NODELAY`` at both ends) is the replica's ``MessageChannel`` at both ends, the
messages those of an engine process's pipes (``run_engine_process`` runs in the actor as in a
spawned process).

Settings: an actor takes the front end's log level and engine cache (``replica_settings``), as a
spawned engine process inherits them, and nothing else of its environment: an actor's creation
arguments are kept in Ray's GCS, so the server's API key must not be among them. On a CPU a
replica runs torch on as many threads as its bundle has CPUs (``replica_cpu_placement``), as
Ray gives its other ranks: the cluster, not the front end's machine, says what it may use.

Lifetime: the actor serves until the front end says shutdown or goes away (the socket closes),
or its engine's ranks fail; then its call returns and the front end kills it and removes its
groups. A replica whose socket closes, or whose actor dies (Ray says so even when no FIN arrives,
say its node is gone), is lost to the ``DataParallelClient`` as a dead engine process is. The
actors end with the front end, however it ends: Ray ends the actors a driver owns with it.

Ray is imported inside functions only: it is an optional extra (``compiled_llm[ray]``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import secrets
import socket
import sys
import threading
import time
from typing import Callable, Mapping, Sequence

import torch

from compiled_llm.cache_dir import CACHE_DIR_ENV
from compiled_llm.errors import CompiledLLMError, EngineError, InvalidOptionError, first_line
from compiled_llm.serve.engine_process.dp_client import DataParallelClient
from compiled_llm.serve.engine_process.dp_placement import ReplicaPlacement
from compiled_llm.serve.engine_process.engine_core import run_engine_process
from compiled_llm.serve.engine_process.engine_core_client import EngineCoreClient, wait_all
from compiled_llm.serve.engine_process.message_channel import MessageChannel
from compiled_llm.serve.executor.ray_executor import (PLACEMENT_TIMEOUT_S, import_ray, place_ranks_in,
                                                      rank_bundles)
from compiled_llm.serve.llm_engine import LLMEngine

logger = logging.getLogger("compiled_llm.serve.engine_process.ray_replicas")

# The front end's environment variables a replica takes: the CLI's log level and the engine
# cache's directory. Only these (never the API key): they travel in the actor's creation
# arguments, which Ray's GCS keeps where anyone who reaches the cluster can read them.
REPLICA_SETTINGS = ("COMPILED_LLM_LOGGING_LEVEL", CACHE_DIR_ENV)
TOKEN_BYTES = 32
CONNECT_TIMEOUT_S = 60.0  # an actor that has started reaches the front end within this, or never
_TOKEN_WAIT_S = 5.0  # a connection that has not sent its token by then is not the replica
_MAX_UNPROVEN = 8  # connections waiting to send a token: a flood drops the oldest, not the replica's
_END_WAIT_S = 2.0  # how long a lost replica's actor may take to be seen dead, for its reason


def replica_bundles(tensor_parallel_size: int, pipeline_parallel_size: int, device_type: str) -> list[list[dict]]:
    """A replica's placement groups' bundles: one group per pipeline stage, one bundle per
    tensor-parallel rank (the engine core actor takes the first group's first)."""
    return [rank_bundles(tensor_parallel_size, torch.device(device_type)) for _ in range(pipeline_parallel_size)]


def replica_device_type(device: str, cluster_gpus: float) -> str:
    """``cuda`` or ``cpu``: what a replica's bundles hold. ``auto`` asks the cluster, not this
    node (the front end's node may have no GPU while the others do)."""
    if device == "auto":
        return "cuda" if cluster_gpus > 0 else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


def replica_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` (the front end's environment) that a replica's actor sets."""
    return {name: environ[name] for name in REPLICA_SETTINGS if name in environ}


def replica_cpu_placement(device_type: str, assigned: Mapping[str, float]) -> ReplicaPlacement | None:
    """A replica actor's share of its node (``assigned``: the resources Ray gave it): on a CPU one
    torch thread per CPU of its bundle, so that the replicas and ranks Ray packs on a node do not
    each spin a thread per core; on GPUs nothing (Ray shows the actor its GPU)."""
    if device_type != "cpu":
        return None
    return ReplicaPlacement(cpu_threads=max(1, int(assigned.get("CPU", 1))))


def connect_to_front_end(address: tuple[str, int], token: bytes) -> int:
    """The actor's end: connect, prove to be the replica, and hand over the socket's descriptor
    (non-blocking). ``TCP_NODELAY``: the messages are small and each one waited for (a step's
    tokens); Nagle's algorithm would hold one back while an earlier one is unacknowledged."""
    with socket.create_connection(address, timeout=CONNECT_TIMEOUT_S) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(token)
        sock.setblocking(False)
        return sock.detach()


@dataclasses.dataclass(eq=False)
class _Unproven:
    """A connection to a replica's listener that has not sent the whole token yet."""

    conn: socket.socket
    peer: tuple
    drop_by: float  # time.monotonic()
    got: bytes = b""


class ReplicaListener:
    """The front end's end of one replica's connection: a listener on an ephemeral port of
    ``node_ip`` that takes the first connection to send ``token`` and drops any other. ``accept``
    never blocks: a connection's token is read as it arrives, over calls, so a stray connection
    that sends nothing holds nothing up (it is dropped after ``_TOKEN_WAIT_S``)."""

    def __init__(self, node_ip: str, token: bytes, index: int):
        self._token = token
        self._index = index
        family = socket.AF_INET6 if ":" in node_ip else socket.AF_INET
        self._sock = socket.create_server((node_ip, 0), family=family, backlog=8)
        self._sock.setblocking(False)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._unproven: list[_Unproven] = []

    def fileno(self) -> int:
        return self._sock.fileno()

    def accept(self) -> int | None:
        """The replica's connection, once it has sent the token: its descriptor (non-blocking,
        ``TCP_NODELAY``, now the caller's; the listener is closed). None until then."""
        while True:
            try:
                conn, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            conn.setblocking(False)
            self._unproven.append(_Unproven(conn, peer, time.monotonic() + _TOKEN_WAIT_S))
            if len(self._unproven) > _MAX_UNPROVEN:
                self._drop(self._unproven[0])
        for pending in list(self._unproven):
            try:
                chunk = pending.conn.recv(TOKEN_BYTES - len(pending.got))
            except (BlockingIOError, InterruptedError):
                if time.monotonic() > pending.drop_by:
                    self._drop(pending)
                continue
            except OSError:
                chunk = b""
            pending.got += chunk
            if not chunk or (len(pending.got) == TOKEN_BYTES and not hmac.compare_digest(pending.got, self._token)):
                self._drop(pending)
            elif len(pending.got) == TOKEN_BYTES:
                self._unproven.remove(pending)
                pending.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                fd = pending.conn.detach()
                self.close()
                return fd
        return None

    def _drop(self, pending: _Unproven) -> None:
        self._unproven.remove(pending)
        pending.conn.close()
        logger.warning("data-parallel replica %d: dropped a connection from %s that is not the replica",
                       self._index, pending.peer)

    def close(self) -> None:
        self._sock.close()
        for pending in self._unproven:
            pending.conn.close()
        self._unproven.clear()


class EngineCoreActor:
    """A replica's engine core inside a Ray actor (``ray.remote`` wraps it when replicas start,
    so this module imports without Ray)."""

    def __init__(self, sys_path: list[str], settings: dict[str, str]):
        # ``load`` arrives pickled by name: find it where the front end does
        sys.path.extend(p for p in sys_path if p not in sys.path)
        # the front end's log level and engine cache (``replica_settings``), as a spawned engine inherits them
        os.environ.update(settings)

    def pid(self) -> int:
        return os.getpid()

    def serve(self, load: Callable[[], LLMEngine], address: tuple[str, int], token: bytes, groups: list,
              device_type: str) -> None:
        """Connect to the front end, load the engine (its ranks in ``groups``, on ``device_type``)
        and serve it until the front end says shutdown or goes away, or the engine's ranks fail."""
        import ray

        placement = replica_cpu_placement(device_type, ray.get_runtime_context().get_assigned_resources())
        if placement is not None:
            placement.apply()
        place_ranks_in(groups)
        fd = connect_to_front_end(address, token)
        engines: list[LLMEngine] = []

        def loaded() -> LLMEngine:
            engines.append(load())
            return engines[0]

        try:
            run_engine_process(loaded, fd, fd)
        finally:
            os.close(fd)  # the front end sees the replica go before its ranks are stopped
            if engines:
                engines[0].shutdown()


class RayReplica:
    """One replica's Ray objects: its actor, the call that serves (it ends when the engine core
    does), its placement groups. ``release`` kills the actor and removes the groups (again:
    harmless)."""

    def __init__(self, ray, index: int, actor, serving, pid_ref, groups: list):
        self._ray = ray
        self.index = index
        self.actor = actor
        self.serving = serving
        self._pid_ref = pid_ref
        self.groups = groups
        self._released = False

    def pid(self) -> int | None:
        try:
            return self._ray.get(self._pid_ref, timeout=0.5)
        except Exception:  # noqa: BLE001 - never started, or gone before it said
            return None

    def ended(self, timeout_s: float = 0.0) -> bool:
        done, _ = self._ray.wait([self.serving], timeout=timeout_s)
        return bool(done)

    def end_reason(self, timeout_s: float = _END_WAIT_S) -> str:
        """Why the replica's engine core is gone, in one line (waiting ``timeout_s`` for Ray to
        see its actor end)."""
        pid = self.pid()
        actor = f"the engine actor{f' (pid {pid})' if pid is not None else ''}"
        if not self.ended(timeout_s):
            return f"{actor} closed its connection"
        exceptions = self._ray.exceptions
        try:
            self._ray.get(self.serving)
        except exceptions.RayTaskError as e:
            cause = e.cause if e.cause is not None else e
            return f"{actor} failed: {type(cause).__name__}: {first_line(cause, 300)}"
        except exceptions.RayActorError as e:
            return f"{actor} died: {first_line(e, 300)}"
        except Exception as e:  # noqa: BLE001 - one line, whatever Ray says
            return f"{actor} ended: {type(e).__name__}: {first_line(e, 300)}"
        return f"{actor}'s engine core stopped"

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        release_ray_objects(self._ray, self.actor, self.groups)


def release_ray_objects(ray, actor, groups: list) -> None:
    """Kill ``actor`` (None: none was made) and remove ``groups``; what is already gone is passed over."""
    from ray.util.placement_group import remove_placement_group

    if actor is not None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    for group in groups:
        try:
            remove_placement_group(group)
        except Exception:  # noqa: BLE001 - already removed
            pass


class RayEngineCoreClient(EngineCoreClient):
    """``EngineCoreClient`` over a replica's socket: the same messages; the replica is lost when
    the socket closes or Ray sees its actor end, and ``close`` ends the actor and its groups."""

    def __init__(self, channel: MessageChannel, info, tokenizer, snapshot, replica: RayReplica):
        super().__init__(channel, info, tokenizer, snapshot)
        self.replica = replica
        self._closing = False

    @property
    def alive(self) -> bool:
        return not self._lost and not self.replica.ended()

    def start(self, on_message: Callable[[tuple], None]) -> None:
        super().start(on_message)
        threading.Thread(target=self._watch_actor, name=f"compiled_llm-replica{self.replica.index}-watch",
                         daemon=True).start()

    def _watch_actor(self) -> None:
        """An actor gone without closing its socket (a node lost): end the connection, so that
        the event loop sees the replica lost as it would a closed socket."""
        while not self._closing:
            try:
                if self.replica.ended(timeout_s=1.0):
                    break
            except Exception:  # noqa: BLE001 - Ray shut down under us: the server is ending
                return
        if not self._closing:
            try:
                self._aio.call_soon_threadsafe(self._actor_ended)
            except RuntimeError:  # its event loop closed meanwhile: nobody is left to tell
                pass

    def _actor_ended(self) -> None:
        if self._lost:
            return
        conn = socket.socket(fileno=self.channel.read_fd)
        try:
            conn.shutdown(socket.SHUT_RDWR)  # the next read sees the end of the connection
        except OSError:
            pass
        finally:
            conn.detach()
        self._readable()

    def _exit_reason(self) -> str:
        # off the loop (``_report_lost``): the actor closes its socket before it stops its engine,
        # so Ray takes a while to see it end
        reason = self.replica.end_reason()
        self.replica.release()  # its resources go back to the cluster now, not at shutdown
        return reason

    async def close(self, timeout: float = 30.0) -> None:
        self._closing = True
        deadline = time.monotonic() + timeout
        await super().close(timeout)  # says shutdown; the actor's call returns once its engine stops
        await asyncio.to_thread(self.replica.ended, max(deadline - time.monotonic(), 0.1))
        self.replica.release()


class StartingRayReplica:
    """A replica placed, its actor started and loading: ``poll`` (never blocks for long) until
    it has connected and said ready, or ``stop`` it."""

    def __init__(self, ray, index: int, load: Callable[[], LLMEngine], bundles: list[list[dict]], node_ip: str):
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self.index = index
        self.channel: MessageChannel | None = None
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._listener = ReplicaListener(node_ip, self._token, index)
        self._placed = False
        self._place_by = time.monotonic() + PLACEMENT_TIMEOUT_S
        self._bundles = bundles
        groups: list = []
        actor = None
        try:  # what is made before a failure (or an interrupt) here is nobody else's to stop
            for stage, b in enumerate(bundles):
                groups.append(placement_group(b, strategy="STRICT_PACK", name=f"compiled_llm-dp{index}-stage{stage}"))
            self._ready_refs = [g.ready() for g in groups]
            gpu = "GPU" in bundles[0][0]
            actor = ray.remote(EngineCoreActor).options(
                num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0, max_restarts=0, max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(groups[0], placement_group_bundle_index=0),
            ).remote(list(sys.path), replica_settings(os.environ))
            pid_ref = actor.pid.remote()
            serving = actor.serve.remote(load, self._listener.address, self._token, groups,
                                         "cuda" if gpu else "cpu")
        except BaseException:
            self._listener.close()
            release_ray_objects(ray, actor, groups)
            raise
        self.replica = RayReplica(ray, index, actor, serving, pid_ref, groups)

    def fileno(self) -> int:
        """What to wait on for the next step: the listener, then the connection."""
        return self.channel.read_fd if self.channel is not None else self._listener.fileno()

    def poll(self) -> RayEngineCoreClient | None:
        """The client once the replica is ready, None while it is placed or loads;
        CompiledLLMError (it could not load) or EngineError (it could not be placed, or its actor
        ended), the replica stopped, if it cannot be."""
        if self.channel is None:
            self._check_placed()
            self._accept()
            if self.channel is None:
                if self.replica.ended():
                    raise self._stopped(EngineError(f"the engine could not start: {self.replica.end_reason(0.0)}"))
                return None
        messages = self.channel.receive()
        if not messages:
            if self.channel.closed:
                raise self._stopped(EngineError(f"the engine could not start: {self.replica.end_reason()}"))
            return None
        message = messages[0]
        if message[0] == "failed":
            raise self._stopped(CompiledLLMError(f"the engine could not start: {message[1]}"))
        _, info, tokenizer, snapshot = message
        return RayEngineCoreClient(self.channel, info, tokenizer, snapshot, self.replica)

    def _check_placed(self) -> None:
        if self._placed:
            return
        done, _ = self._ray.wait(self._ready_refs, num_returns=len(self._ready_refs), timeout=0)
        if len(done) == len(self._ready_refs):
            self._placed = True
        elif time.monotonic() > self._place_by:
            unit = "GPU" if "GPU" in self._bundles[0][0] else "CPU"
            tp, pp = len(self._bundles[0]), len(self._bundles)
            shape = f"{tp} {unit}" if pp == 1 else f"{pp} pipeline stages of {tp} {unit}, each stage on one node"
            raise self._stopped(EngineError(
                f"the Ray cluster could not place the replica ({shape}) within {PLACEMENT_TIMEOUT_S:.0f} s; it has "
                f"{self._ray.available_resources().get(unit, 0):g} {unit} free in all"))

    def _accept(self) -> None:
        fd = self._listener.accept()
        if fd is not None:
            self.channel = MessageChannel(fd, fd)

    def _stopped(self, error: Exception) -> Exception:
        self.stop()
        return error

    def stop(self) -> None:
        self._listener.close()
        if self.channel is not None:
            self.channel.close()
        self.replica.release()


def start_ray_replicas(loads: Sequence[Callable[[], LLMEngine]], tensor_parallel_size: int,
                       pipeline_parallel_size: int, device: str,
                       load_balance_method: str = "prefix_aware") -> DataParallelClient:
    """One Ray actor per ``loads[i]``, each placed and loading at the same time; once all are
    ready, the data-parallel client over them, routing by ``load_balance_method``. The first that cannot start, or an interrupt,
    stops all the others at once, and its reason is raised, naming the replica. This process
    joins the Ray cluster (``ray.init()``: ``ray start``'s on this machine, or ``$RAY_ADDRESS``;
    a local one when there is none)."""
    ray = import_ray()
    if not ray.is_initialized():
        try:
            ray.init(logging_level=logging.WARNING)
        except Exception as e:  # noqa: BLE001 - a bad $RAY_ADDRESS, a cluster that is gone: one line
            raise EngineError(f"could not join the Ray cluster for the data-parallel replicas: {first_line(e)}") from None
    device_type = replica_device_type(device, ray.cluster_resources().get("GPU", 0))
    if device_type == "cuda" and device != "auto" and not ray.cluster_resources().get("GPU", 0):
        raise InvalidOptionError(f"--device {device}: the Ray cluster has no GPU")
    bundles = replica_bundles(tensor_parallel_size, pipeline_parallel_size, device_type)
    node_ip = ray.util.get_node_ip_address()
    starting: list[StartingRayReplica] = []
    try:
        for i, load in enumerate(loads):
            starting.append(StartingRayReplica(ray, i, load, bundles, node_ip))
    except BaseException:
        for engine in starting:
            engine.stop()
        raise
    # every half second: a connection's token may arrive after the poll that accepted it
    ready = wait_all(starting, poll_s=0.5)
    logger.info("%d data-parallel replicas run as Ray actors, each %d pipeline stage(s) x %d tensor-parallel "
                "rank(s) on %s", len(loads), pipeline_parallel_size, tensor_parallel_size, device_type)
    return DataParallelClient(ready, load_balance_method=load_balance_method)

