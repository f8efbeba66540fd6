"""``PrefixAwareRequestRouter``: Ray Serve's request router for the engine replicas, choosing by
``PrefixAffinity`` (Ray Serve's public, alpha ``RequestRouter`` API, ``ray.serve.request_router``).

It runs in the process that holds the engines' handle (the ingress replica), so the memory of
which replica was sent which prefix lives there. The prompt comes from the request the ingress
forwards (its ``routing_prompt``); the load is this router's count of requests sent to a replica
and not yet completed. The preferred replica comes first; the others follow, least loaded
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
        self._routed: dict[str, ReplicaID] = {}  # internal request id -> its replica

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        chosen = self.affinity.choose(routing_prompt(pending_request), list(by_id), self.in_flight.__getitem__)
        rest = sorted((r for r in candidate_replicas if r.replica_id != chosen), key=lambda r: self.in_flight[r.replica_id])
        return [[by_id[chosen]], rest]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.affinity.record(routing_prompt(pending_request), replica_id)
        self.in_flight[replica_id] += 1
        self._routed[pending_request.metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._routed.pop(internal_request_id, None) is not None and self.in_flight[replica_id] > 0:
            self.in_flight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id)
        self.in_flight.pop(replica_id, None)
