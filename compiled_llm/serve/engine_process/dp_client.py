"""The front end's handle on N engine cores serving one model (``--data-parallel-size N``), as
one: the same messages as ``EngineCoreClient``'s, so ``AsyncEngine`` and the HTTP server work
over either. vLLM's DP load-balancing client plays this part.

- ``("add", entries, stream)`` is split by replica: each request goes where the router
  (``dp_router``) expects its prefix to be cached, else to the least loaded replica (or, under
  ``--load-balance-method round_robin``, to each replica in turn);
- ``("abort", ids)`` goes to the replicas that hold them;
- every ``("step", ...)`` message of replica i is handed on with i appended (the ``engine``
  label of the metrics), after the router has booked the requests that finished; so is every
  ``("called", ...)`` answer (``LLM``'s calls go to every live replica: ``("call", ...)`` is
  sent to each, as ``("shutdown",)`` is).

A replica that dies takes only its own requests down: those that have sent nothing back yet
start again on a live replica (no client has seen a token of them), once (a request that took
a second replica down with it may be what kills them), the others fail with an ``EngineError``
naming the replica, and the router stops sending to it. Requests are checked against the most
restrictive replica's limits (replicas size their KV caches from their own free memory), so a
request one replica accepts is one every replica can take. Only when the last
replica has died does the front end hear ``("lost", reason)``, as from a single engine core,
and the server stop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from typing import Callable, Sequence

from compiled_llm.serve.engine_process.dp_router import ReplicaRouter, RouterConfig, make_router
from compiled_llm.serve.engine_process.engine_core_client import EngineCoreClient, StartingEngine, wait_all
from compiled_llm.serve.engine_process.engine_messages import EngineSnapshot
from compiled_llm.serve.llm_engine import LLMEngine

logger = logging.getLogger("compiled_llm.serve.engine_process.dp_client")


@dataclasses.dataclass(eq=False)
class _Routed:
    """A request on a replica, with what it takes to send it again elsewhere."""

    replica: int
    entry: tuple  # (request_id, prompt text, prompt ids, SamplingParams), as AsyncEngine sent it
    stream: bool
    load: int  # tokens booked on the replica's load
    answered: bool = False  # an output has come back: a client may have seen it, so it is not retried
    aborted: bool = False  # the caller has gone: never started again elsewhere
    attempts: int = 1  # replicas it was sent to: one that died with it may have been killed by it


def request_load(prompt_ids: Sequence[int], params) -> int:
    """The tokens a request may hold in its replica's batch: its prompt and every completion's
    most tokens."""
    return len(prompt_ids) + params.max_tokens * params.n


class DataParallelClient:
    """See the module docstring. ``replicas`` are started ``EngineCoreClient``s of one engine;
    ``router`` routes between them, else the one ``load_balance_method`` names."""

    def __init__(self, replicas: Sequence[EngineCoreClient], router: ReplicaRouter | None = None,
                 load_balance_method: str = "prefix_aware"):
        if not replicas:
            raise ValueError("a data-parallel client needs at least one replica")
        self.replicas = list(replicas)
        smallest = min(self.replicas, key=lambda r: (r.info.num_blocks, r.info.max_num_seqs, r.info.max_step_tokens))
        self.info, self.tokenizer, self.validator = smallest.info, smallest.tokenizer, smallest.validator
        self.router = router or make_router(load_balance_method, len(self.replicas),
                                            RouterConfig(block_size=smallest.info.block_size))
        self.failures: dict[int, str] = {}  # replica -> why it stopped
        self._snapshots = [r.start_snapshot for r in self.replicas]  # each replica's latest
        self._requests: dict[str, _Routed] = {}
        self._on_message: Callable[[tuple], None] | None = None

    @classmethod
    def start_processes(cls, loads: Sequence[Callable[[], LLMEngine]],
                        load_balance_method: str = "prefix_aware") -> "DataParallelClient":
        """One engine process per ``loads[i]``, loading at the same time; once all are ready, the
        client over them, routing by ``load_balance_method`` (``wait_all``: the first that cannot
        start, or an interrupt, stops all the others at once, and its reason is raised, naming the
        replica)."""
        return cls(wait_all([StartingEngine(load) for load in loads]), load_balance_method=load_balance_method)

    @classmethod
    def in_threads(cls, engines: Sequence[LLMEngine], router: ReplicaRouter | None = None,
                   load_balance_method: str = "prefix_aware") -> "DataParallelClient":
        """Replicas over engines loaded in this process, each stepped by a thread (tests)."""
        return cls([EngineCoreClient.in_thread(e) for e in engines], router, load_balance_method)

    # ---- what the server asks -------------------------------------------------------------------

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def live_replicas(self) -> list[int]:
        return self.router.live_replicas

    @property
    def start_snapshots(self) -> list[EngineSnapshot]:
        return [r.start_snapshot for r in self.replicas]

    @property
    def alive(self) -> bool:
        return any(r.alive for r in self.replicas)

    # ---- the event loop ---------------------------------------------------------------------------

    def start(self, on_message: Callable[[tuple], None]) -> None:
        self._on_message = on_message
        for i, replica in enumerate(self.replicas):
            replica.start(functools.partial(self._replica_message, i))

    def send(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, entries, stream = message
            by_replica: dict[int, list] = {}
            for entry in entries:
                _, _, ids, params = entry
                load = request_load(ids, params)
                replica = self.router.route(ids, load)
                self._requests[entry[0]] = _Routed(replica, entry, stream, load)
                by_replica.setdefault(replica, []).append(entry)
            for replica, batch in by_replica.items():
                self.replicas[replica].send(("add", batch, stream))
        elif kind == "abort":
            by_replica = {}
            for rid in message[1]:
                routed = self._requests.get(rid)
                if routed is not None:
                    routed.aborted = True
                    by_replica.setdefault(routed.replica, []).append(rid)
            for replica, ids in by_replica.items():
                self.replicas[replica].send(("abort", ids))
        else:
            for replica in self.replicas:
                replica.send(message)

    async def close(self, timeout: float = 30.0) -> None:
        """Stop every replica (at the same time), none left behind."""
        await _close_all(self.replicas, timeout)

    # ---- the replicas' messages -------------------------------------------------------------------

    def _replica_message(self, replica: int, message: tuple) -> None:
        if message[0] == "step":
            _, outputs, errors, scheduled, snapshot = message
            for encoded in outputs:
                routed = self._requests.get(encoded[0])
                if routed is not None:
                    routed.answered = True
                    if encoded[1]:  # finished
                        self._done(encoded[0])
            for rid, _, _ in errors:
                self._done(rid)
            self._snapshots[replica] = snapshot
            self._on_message(("step", outputs, errors, scheduled, snapshot, replica))
        elif message[0] == "called":
            self._on_message((*message, replica))
        elif message[0] == "lost":
            self._replica_lost(replica, message[1])

    def _done(self, request_id: str) -> None:
        routed = self._requests.pop(request_id, None)
        if routed is not None:
            self.router.finished(routed.replica, routed.load)

    def _replica_lost(self, replica: int, reason: str) -> None:
        self.failures[replica] = reason
        self.router.mark_dead(replica)
        orphans = [r for r in self._requests.values() if r.replica == replica]
        live = self.router.live_replicas
        if not live:
            logger.error("data-parallel replica %d: %s; no replica is left", replica, reason)
            self._on_message(("lost", reason if self.num_replicas == 1 else
                              f"every data-parallel replica stopped (the last, replica {replica}: {reason})"))
            return
        retried = [r for r in orphans if not (r.answered or r.aborted or r.attempts > 1)]
        failed = [r for r in orphans if r not in retried]
        logger.error("data-parallel replica %d: %s; %d replicas left, %d of its requests failed, %d started again "
                     "elsewhere", replica, reason, len(live), len(failed), len(retried))
        message = f"data-parallel replica {replica} stopped: {reason}"
        errors = []
        for r in failed:
            del self._requests[r.entry[0]]
            errors.append((r.entry[0], "engine", message))
        for r in retried:
            del self._requests[r.entry[0]]
            self.send(("add", [r.entry], r.stream))
            self._requests[r.entry[0]].attempts = r.attempts + 1
        # its gauges drop to nothing; its counters keep what it counted
        gone = self._snapshots[replica]._replace(running=0, waiting=0, kv_cache_usage=0.0)
        self._on_message(("step", [], errors, [], gone, replica))


async def _close_all(replicas: Sequence[EngineCoreClient], timeout: float = 30.0) -> None:
    await asyncio.gather(*(r.close(timeout) for r in replicas))
