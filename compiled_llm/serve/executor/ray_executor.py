"""``RayExecutor``: every rank but 0 as a Ray actor; this process is rank 0
(``--distributed-executor-backend ray``). The ranks are tensor-parallel ranks, or the TP ranks
of pipeline stages, stage-major (rank r is stage r // TP's rank r % TP).

Placement: one placement group per pipeline stage, one bundle per rank of the stage (``GPU: 1``
on CUDA, ``CPU: 1`` on a CPU), each packed strictly onto one node: a tensor-parallel group
all-reduces twice a layer, so it never spans a network, while stages (which pass activations
once a step) may sit on different nodes. Stage 0's group is on this process's node: bundle 0,
rank 0's, asks for a sliver of the node's own ``node:<ip>`` resource (vLLM pins its driver the
same way). The bundle of rank 0 holds no actor; it keeps its device out of the actors' hands.
A process that is itself a Ray actor in bundle 0 of groups made for its engine (a data-parallel
replica's engine core, ``serve/engine_process/ray_replicas.py``) hands them over with
``place_ranks_in``; the executor then uses those, and leaves removing them to their owner.

Start-up: this process joins the Ray cluster (``ray.init()``: the one ``ray start`` made on this
machine, or ``$RAY_ADDRESS``; a local one when there is none, ended again at shutdown), places
the groups, starts one actor per other rank, each loading its rank's weights (only its own file)
from the engine directory, which must be at the same path on every node that runs a rank (as the
model path is for vLLM). All ranks then join one torch.distributed group through a TCP store
that rank 0 hosts at the node IP Ray reports (NCCL on CUDA, gloo on a CPU), as ``multiproc``
does through a file store; each stage's collectives run over a group of its own.

Messages: every call is an actor method call. Ray runs the calls one caller makes on one actor
in the order they were made, which is the order ``send`` needs; rank 0 keeps every call's
reference until it is done, so that an error in any of them (or the actor's death) is seen.

Failure: a monitor thread waits on those references. A rank whose call raised or whose actor
died fails the engine: the other actors are killed at once, the collective rank 0 waits in fails
(gloo sees the closed connection; the group's timeout is the backstop), and every later call
raises ``EngineError`` naming the rank. Actors end with this process even when it is killed:
Ray ends the actors a driver (or actor) owns when it goes.

Ray is imported here only, inside functions: it is an optional extra (``compiled_llm[ray]``).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from compiled_llm.errors import EngineError, InvalidOptionError, first_line
from compiled_llm.serve.executor.multiproc import (COLLECTIVE_TIMEOUT_S, LOAD_TIMEOUT_S, MultiprocExecutor, backend_for,
                                                   end_group, init_group)
from compiled_llm.serve.executor.rank_failures import RankFailures, rank_name

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0  # a cluster that cannot place the groups in this long never will, unchanged
_STOP_GRACE_S = 5.0
_POLL_S = 0.05  # how often a wait for results looks for a failed rank
_RAY_MISSING = ("distributed_executor_backend 'ray' needs Ray, which is not installed: "
                "pip install 'compiled_llm[ray]' (or use the default backend, mp)")

# The placement groups this process was handed for its engine's ranks (``place_ranks_in``), or
# None: an executor makes its own.
_given_groups: list | None = None


def import_ray():
    """The ``ray`` module, or a one-line InvalidOptionError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise InvalidOptionError(_RAY_MISSING) from None
    return ray


def rank_bundles(size: int, device: torch.device, node_ip: str | None = None) -> list[dict[str, float]]:
    """One bundle per rank of a tensor-parallel group; with ``node_ip``, the first (rank 0's)
    pinned to that node (``node:<ip>`` is a resource every Ray node has one of), so that a strict
    pack puts every rank beside rank 0."""
    unit = {"GPU": 1.0} if device.type == "cuda" else {"CPU": 1.0}
    first = {**unit, f"node:{node_ip}": 0.001} if node_ip is not None else dict(unit)
    return [first] + [dict(unit) for _ in range(1, size)]


def place_ranks_in(groups: list | None) -> None:
    """Put the ranks of the engine this process starts in ``groups``: one placement group per
    pipeline stage, a bundle per tensor-parallel rank each, this process (a Ray actor) in bundle
    0 of the first. Their maker owns them: it removes them once the engine is gone, even when
    this process was killed (Ray keeps an actor's groups until its job ends). None: every
    executor makes (and removes) its own."""
    global _given_groups
    _given_groups = list(groups) if groups is not None else None


class RankActor:
    """A rank other than 0, inside a Ray actor: its ``RankWorker`` and its side of the group
    (``ray.remote`` wraps it when an executor starts, so this module imports without Ray)."""

    def __init__(self, engine_dir: str, rank: int, device_type: str, sys_path: list[str]):
        # the functions run_on_ranks sends travel by name: find them where rank 0 does
        sys.path.extend(p for p in sys_path if p not in sys.path)
        from compiled_llm.engine.artifact import load_engine
        from compiled_llm.serve.executor.rank_worker import RankWorker

        # on CUDA, Ray shows an actor only the GPU of its bundle, as cuda:0
        self.device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.rank = rank
        self.worker = RankWorker(load_engine(engine_dir, device=self.device, rank=rank))

    def placement(self) -> tuple[str, list]:
        """(this actor's node id, the GPUs Ray gave it)."""
        import ray

        return ray.get_runtime_context().get_node_id(), list(ray.get_gpu_ids())

    def join(self, size: int, init_method: str, timeout_s: float, custom_all_reduce: bool, tp_size: int) -> bool:
        return init_group(self.device, self.rank, size, init_method, timeout_s, custom_all_reduce, tp_size)

    def call(self, method: str, args: tuple) -> Any:
        return getattr(self.worker, method)(*args)

    def stop(self) -> None:
        self.worker.release_graphs()  # before the group ends: see MultiprocExecutor.before_teardown
        if dist.is_initialized():
            end_group(self.device)


class RayExecutor(RankFailures):
    def __init__(self, engine_dir: Path, size: int, device: torch.device, timeout_s: float | None = None,
                 custom_all_reduce: bool = True, tp_size: int | None = None):
        """``size`` ranks in all; ``tp_size`` per pipeline stage (None: one stage of ``size``)."""
        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._remove_placement_group = remove_placement_group
        device = torch.device(device)
        timeout_s = timeout_s or COLLECTIVE_TIMEOUT_S[backend_for(device)]
        tp_size = tp_size or size
        self.size = size
        self.tp_size = tp_size
        self._device = device
        self.custom_all_reduce = False
        self._init_failures()
        self.before_teardown: list[Callable[[], None]] = []  # as MultiprocExecutor's
        # every call not yet seen done, as (reference, rank); the monitor and check() take the done ones
        self._pending: list[tuple[Any, int]] = []
        self._pending_lock = threading.Lock()
        self._actors: list[Any] = []
        self._groups: list[Any] = []  # one placement group per pipeline stage
        self._owns_groups = _given_groups is None
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            # the cluster `ray start` made on this machine, or $RAY_ADDRESS's; else a local one
            try:
                ray.init(logging_level=logging.WARNING)
            except Exception as e:  # noqa: BLE001 - a bad $RAY_ADDRESS, a cluster that is gone: one line
                raise EngineError(f"could not join the Ray cluster for the engine's other ranks: {first_line(e)}") from None
        try:
            node_ip = ray.util.get_node_ip_address()
            self._place(placement_group, node_ip)
            remote = ray.remote(RankActor)
            for rank in range(1, size):
                stage, index = divmod(rank, tp_size)
                options = dict(num_cpus=0, num_gpus=1) if device.type == "cuda" else dict(num_cpus=1)
                self._actors.append(remote.options(
                    name=None, max_restarts=0, max_task_retries=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self._groups[stage],
                                                                         placement_group_bundle_index=index),
                    **options,
                ).remote(str(engine_dir), rank, device.type, list(sys.path)))
            # each actor loads its weights in its constructor: a failed load answers here,
            # before any rank waits in the group
            for rank, actor in enumerate(self._actors, start=1):
                self._await(actor.call.remote("synchronize", ()), rank, LOAD_TIMEOUT_S, "load")
            if device.type == "cuda":
                self._check_gpus_apart(device)
            init_method = f"tcp://{_bracketed(node_ip)}:{_free_port(node_ip)}"
            joins = [a.join.remote(size, init_method, timeout_s, custom_all_reduce, tp_size) for a in self._actors]
            self.custom_all_reduce = init_group(device, 0, size, init_method, timeout_s, custom_all_reduce, tp_size)
            for rank, ref in enumerate(joins, start=1):
                self._await(ref, rank, timeout_s, "join the group")
        except BaseException:
            self._release()
            raise
        if tp_size == size:
            log.info("tensor-parallel ranks 1..%d run as Ray actors on node %s", size - 1, node_ip)
        else:
            log.info("ranks 1..%d (%d pipeline stages x %d tensor-parallel ranks) run as Ray actors, stage 0 on "
                     "node %s", size - 1, size // tp_size, tp_size, node_ip)
        self._monitor = threading.Thread(target=self._watch, name="tp-ray-monitor", daemon=True)
        self._monitor.start()
        atexit.register(_shutdown_ref, weakref.ref(self))

    def _place(self, placement_group, node_ip: str) -> None:
        """One placement group per stage (or the groups handed to this process), all placed."""
        ray, stages, tp_size = self._ray, self.size // self.tp_size, self.tp_size
        if _given_groups is not None:
            if len(_given_groups) != stages or any(g.bundle_count != tp_size for g in _given_groups):
                raise EngineError(f"this engine runs {stages} pipeline stage(s) of {tp_size} tensor-parallel ranks, "
                                  f"but the placement groups made for it have "
                                  f"{[g.bundle_count for g in _given_groups]} bundles")
            self._groups = list(_given_groups)
        else:
            for stage in range(stages):
                bundles = rank_bundles(tp_size, self._device, node_ip if stage == 0 else None)
                self._groups.append(placement_group(bundles, strategy="STRICT_PACK",
                                                    name=f"compiled_llm-tp{tp_size}-stage{stage}"))
        deadline = time.monotonic() + PLACEMENT_TIMEOUT_S
        for stage, group in enumerate(self._groups):
            if _ready(ray, [group.ready()], max(deadline - time.monotonic(), 0.0)):
                continue
            unit = "GPU" if self._device.type == "cuda" else "CPU"
            ranks = f"{tp_size} tensor-parallel ranks ({unit}: 1 each)"
            where = (f"on this process's node ({node_ip})" if stage == 0 else "on one node")
            if stages > 1:
                ranks = f"pipeline stage {stage}'s {ranks}"
            raise EngineError(f"the Ray cluster could not place {ranks} {where} within {PLACEMENT_TIMEOUT_S:.0f} s; "
                              f"it has {ray.available_resources().get(unit, 0):g} {unit} free in all")

    def _check_gpus_apart(self, device: torch.device) -> None:
        """Rank 0 runs on the GPU it was loaded on, outside Ray's hands; bundle 0 holds one GPU
        back for it, and Ray hands the actors others, which should leave rank 0's alone. Refuse,
        rather than share a GPU between two ranks, where they do not (on rank 0's node: GPU ids
        are a node's own)."""
        ours = physical_gpu(device)
        node = self._ray.get_runtime_context().get_node_id()
        for rank, actor in enumerate(self._actors, start=1):
            their_node, gpus = self._ray.get(actor.placement.remote())
            if their_node == node and ours in [str(g) for g in gpus]:
                raise EngineError(f"Ray placed {self._name(rank)} on GPU {ours}, which rank 0 (this process) "
                                  f"runs on; give this process a GPU Ray does not hand out (CUDA_VISIBLE_DEVICES), "
                                  f"or use --distributed-executor-backend mp")

    def _name(self, rank: int) -> str:
        return rank_name(rank, self.size, self.tp_size)

    # ---- the interface (see the package docstring) ----------------------------------------------

    def send(self, method: str, *args) -> None:
        self._call(method, args)

    def ask(self, method: str, *args) -> list[Any]:
        """As ``MultiprocExecutor.ask``: ``send``, then every other rank's result, rank 1 first."""
        results = []
        for rank, ref in enumerate(self._call(method, args), start=1):
            while True:
                done, _ = self._ray.wait([ref], timeout=_POLL_S)
                if done:
                    break
                self.check()
            self._settle()
            self.check()
            try:
                results.append(self._ray.get(ref))
            except Exception as e:  # noqa: BLE001 - the monitor may hold this call and not have recorded it yet
                why = self._describe(rank, e)
                self._fail(why)
                raise EngineError(self.failure or why) from None
        return results

    # ``fn(model, state, *args)`` on every other rank, built on send and ask as the other's
    run_on_ranks = MultiprocExecutor.run_on_ranks

    def check(self, wait_s: float = 0.0) -> None:
        """Raise EngineError if a rank has failed or the engine was shut down; with ``wait_s``,
        give a rank that is ending (a collective just failed) that long to be seen."""
        self._refuse_if_shut_down()
        deadline = time.monotonic() + wait_s
        while self.failure is None:
            self._settle()
            if self.failure is not None or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        if self.failure is not None:
            raise EngineError(self.failure)

    def shutdown(self) -> None:
        failed = self._begin_stop()
        if failed is None:
            return
        if not failed and dist.is_initialized():
            # every rank tears the group down together, as multiproc's do
            stops = [a.stop.remote() for a in self._actors]
            for release in self.before_teardown:
                release()
            end_group(self._device)
            _ready(self._ray, stops, _STOP_GRACE_S)
        elif dist.is_initialized() and backend_for(self._device) == "gloo":
            dist.destroy_process_group()  # the failed ranks' group: gloo's teardown waits for no one
        self._release()

    # ---- calls ------------------------------------------------------------------------------------

    def _call(self, method: str, args: tuple) -> list[Any]:
        self.check()
        refs = [actor.call.remote(method, args) for actor in self._actors]
        with self._pending_lock:
            self._pending.extend(zip(refs, range(1, self.size)))
        return refs

    def _await(self, ref, rank: int, timeout_s: float, what: str) -> None:
        if not _ready(self._ray, [ref], timeout_s):
            raise EngineError(f"{self._name(rank)} (a Ray actor) did not {what} within {timeout_s:.0f} s")
        try:
            self._ray.get(ref)
        except Exception as e:  # noqa: BLE001 - named, one line
            raise EngineError(self._describe(rank, e)) from None

    def _settle(self, timeout_s: float = 0.0) -> None:
        """Take the calls that are done; the first that failed fails the engine."""
        with self._pending_lock:
            refs = [ref for ref, _ in self._pending]
        if not refs:
            return
        done, _ = self._ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)
        if not done:
            return
        done_ids = {ref.hex() for ref in done}
        with self._pending_lock:
            finished = [(ref, rank) for ref, rank in self._pending if ref.hex() in done_ids]
            self._pending = [(ref, rank) for ref, rank in self._pending if ref.hex() not in done_ids]
        for ref, rank in finished:
            try:
                self._ray.get(ref, timeout=1.0)
            except Exception as e:  # noqa: BLE001 - the rank's failure, named
                self._fail(self._describe(rank, e))
                return

    def _watch(self) -> None:
        while not self._stopping and self.failure is None:
            with self._pending_lock:
                idle = not self._pending
            if idle:
                time.sleep(0.2)
                continue
            self._settle(timeout_s=0.2)

    def _describe(self, rank: int, error: BaseException) -> str:
        exceptions, name = self._ray.exceptions, self._name(rank)
        if isinstance(error, exceptions.RayTaskError):
            cause = error.cause if error.cause is not None else error
            return f"{name} failed: {type(cause).__name__}: {first_line(cause, 500)}"
        if isinstance(error, exceptions.RayActorError):
            return f"{name} (a Ray actor) died: {first_line(error, 300)}"
        return f"{name} (a Ray actor) failed: {type(error).__name__}: {first_line(error, 300)}"

    # ---- the end --------------------------------------------------------------------------------

    def _stop_ranks(self) -> None:
        for actor in self._actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def _release(self) -> None:
        """Kill every actor, remove the placement groups this executor made, and leave the
        cluster if it joined it."""
        ray = self._ray
        if not ray.is_initialized():
            return
        self._stop_ranks()
        for group in self._groups if self._owns_groups else ():
            try:
                self._remove_placement_group(group)
            except Exception:  # noqa: BLE001 - removed with the cluster
                pass
        with self._pending_lock:
            self._pending = []
        if self._owns_ray:
            ray.shutdown()


def _ready(ray, refs: list, timeout_s: float) -> bool:
    """Whether every one of ``refs`` is done within ``timeout_s``."""
    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    return len(done) == len(refs)


def physical_gpu(device: torch.device) -> str:
    """The id the host (and Ray) knows ``device`` by: its index among CUDA_VISIBLE_DEVICES."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[index] if index < len(visible) else str(index)


def _free_port(ip: str) -> int:
    """A port free on ``ip`` now, for rank 0's TCP store (the store binds it a moment later)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _bracketed(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _shutdown_ref(ref) -> None:
    executor = ref()
    if executor is not None:
        executor.shutdown()
