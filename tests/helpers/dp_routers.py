"""The baseline prefix-aware routing is measured against: live replicas in turn."""

from __future__ import annotations

from typing import Sequence

from compiled_llm.serve.engine_process.dp_router import PrefixAwareRouter, RouterConfig


class RoundRobinRouter(PrefixAwareRouter):
    """Live replicas in turn, blind to prefixes."""

    def __init__(self, num_replicas: int, config: RouterConfig):
        super().__init__(num_replicas, config)
        self._next = 0

    def choose(self, prompt_ids: Sequence[int], hashes: Sequence[int] | None = None) -> int:
        live = self.live_replicas
        if not live:
            raise RuntimeError("no live replica to route to")
        replica = next((i for i in live if i >= self._next), live[0])
        self._next = replica + 1
        return replica
