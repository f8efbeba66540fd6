"""``PrefixAwareRequestRouter``: Ray Serve's request router for the engine replicas, choosing by
``PrefixAffinity`` (Ray Serve's public, alpha ``RequestRouter`` API, ``ray.serve.request_router``).

It runs in the process that holds the engines' handle (the ingress replica), so the memory of
which replica was sent which prefix lives there. The prompt comes from the request the ingress
forwards (its ``routing_prompt``); the load is this router's count of requests sent to a replica
and not yet completed, counted when chosen (requests that arrive together see each other). The preferred replica comes first; the others follow, least loaded
first, for when it is full (``max_ongoing_requests``) or has died.

A Ray file: imported only by Ray Serve (by name, from the deployment's config) and ``app``.
"""

from __future__ import annotations

import collections
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from compiled_llm.serve.ray_serve.prefix_routing import PrefixAffinity, PrefixRoutingConfig

ROUTING_PROMPT = "routing_prompt"  # the key of a forwarded request that carries its prompt


def routing_prompt(pending_request: PendingRequest | None) -> Any:
    if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], dict):
        return None
    return pending_request.args[0].get(ROUTING_PROMPT)


class PrefixAwareRequestRouter(RequestRouter):
    def initialize_state(self, **kwargs):
        self.affinity = PrefixAffinity(PrefixRoutingConfig(**kwargs))
        self.in_flight: collections.Counter[ReplicaID] = collections.Counter()
        self._routed: dict[str, ReplicaID] = {}  # internal request id -> the replica it is counted on

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        request_id = None if pending_request is None else pending_request.metadata.internal_request_id
        self._release(request_id)  # an earlier try of this request, which found its choice full
        prompt = routing_prompt(pending_request)
        chosen = self.affinity.choose(prompt, list(by_id), self.in_flight.__getitem__)
        # counted now, not once routed: requests that arrive together are chosen one after
        # another before any is routed, and must see each other's load and prefixes
        self._count(request_id, chosen, prompt)
        rest = sorted((r for r in candidate_replicas if r.replica_id != chosen), key=lambda r: self.in_flight[r.replica_id])
        return [[by_id[chosen]], rest]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request_id = pending_request.metadata.internal_request_id
        if self._routed.get(request_id) != replica_id:  # its choice was full: it went to another
            self._release(request_id)
            self._count(request_id, replica_id, routing_prompt(pending_request))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._release(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id)
        self.in_flight.pop(replica_id, None)

    def _count(self, request_id: str | None, replica_id: ReplicaID, prompt) -> None:
        self.affinity.record(prompt, replica_id)
        if request_id is not None:
            self._routed[request_id] = replica_id
            self.in_flight[replica_id] += 1

    def _release(self, request_id: str | None) -> None:
        replica_id = self._routed.pop(request_id, None) if request_id is not None else None
        if replica_id is not None and self.in_flight[replica_id] > 0:
            self.in_flight[replica_id] -= 1
