"""Which data-parallel replica a request goes to: the one most likely to hold its prompt's prefix
in its KV cache, unless that one is much busier than the least loaded (SGLang's cache-aware
router, in the front end's process; ``dp_client`` asks it).

Each replica's prefix cache is a guess made from what it was sent: the chained hashes of a
prompt's first full KV blocks (as the engine's block manager hashes them, each block's hash
covering its whole prefix, so matching hash i means matching blocks 0..i), remembered per
replica in a bounded LRU. The engines evict blocks the router does not hear about; a stale guess
only costs one prefill that a perfect guess would have saved.

A request goes to the replica with the longest remembered prefix when that prefix covers at
least ``cache_threshold`` of its routed prompt (the part the hashes cover, its first
MAX_ROUTED_BLOCKS blocks: a short shared preamble, a chat template's, must not pull every
request onto one replica) and that replica is not overloaded: more requests in flight than the
least loaded replica by more than ``balance_abs_requests`` and by a factor ``balance_rel`` (as
SGLang counts them: a request's max_tokens, often the whole context left, says little of its
load). Otherwise it goes to the least loaded: the fewest tokens in flight (prompt + max_tokens x
n), what the front end sent and has not seen finish.

``RoundRobinRouter`` is the baseline it is measured against (``--load-balance-method
round_robin``: live replicas in turn, blind to prefixes); ``make_router`` builds the one a server
option names.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

# A prompt's first blocks decide its route; hashing a long prompt further costs time on the
# event loop for no better choice (two prompts that share 64 blocks share a system prompt).
MAX_ROUTED_BLOCKS = 64


def prefix_block_hashes(token_ids: Sequence[int], block_size: int,
                        max_blocks: int = MAX_ROUTED_BLOCKS) -> tuple[int, ...]:
    """The chained hashes of the first full blocks of ``token_ids`` (at most ``max_blocks``):
    hash i is hash((hash i-1, block i's tokens)), so equal hashes mean equal whole prefixes."""
    hashes, parent = [], None
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        hashes.append(parent)
    return tuple(hashes)


class PrefixMemory:
    """The block hashes one replica was sent, the ``capacity`` most recently used."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._hashes: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def matched_blocks(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes``, from the first, this replica was sent (chained: the first
        one missing ends the match)."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def remember(self, hashes: Sequence[int]) -> None:
        # deepest first, so that a chain's head is its most recent entry and the last evicted:
        # without its head a chain's deeper hashes can never match again
        for h in reversed(hashes):
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def clear(self) -> None:
        self._hashes.clear()


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """The cache-aware router's knobs (SGLang's names, in tokens where SGLang counts requests)."""

    block_size: int
    # blocks remembered per replica: 2^16 blocks of 16 tokens is 1M tokens, more KV than one
    # replica holds on most GPUs
    capacity_blocks: int = 1 << 16
    cache_threshold: float = 0.5  # the share of the routed prompt a prefix match must cover to count
    balance_abs_requests: int = 32  # a match's replica may run this many requests more ...
    balance_rel: float = 1.5  # ... or this times the least loaded's, before the match is passed over
    max_blocks: int = MAX_ROUTED_BLOCKS  # a prompt's first blocks that decide its route

    def __post_init__(self):
        if self.block_size < 1 or self.capacity_blocks < 1:
            raise ValueError(f"block_size and capacity_blocks must be >= 1, got {self.block_size}, {self.capacity_blocks}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")


def overloaded(requests: int, least: int, config: RouterConfig) -> bool:
    """A replica running ``requests`` is too busy to take a request for its cache, next to one
    running ``least``: SGLang's rule, both thresholds passed."""
    return requests - least > config.balance_abs_requests and requests > least * config.balance_rel


class ReplicaRouter:
    """What every policy keeps of the replicas: the tokens and requests in flight on each (booked
    by ``route``, taken off by ``finished``) and which are alive (``mark_dead``). A policy is its
    ``choose``."""

    def __init__(self, num_replicas: int, config: RouterConfig):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.config = config
        self.loads = [0] * num_replicas  # tokens in flight per replica
        self.requests = [0] * num_replicas  # requests in flight per replica
        self.alive = [True] * num_replicas

    @property
    def live_replicas(self) -> list[int]:
        return [i for i, up in enumerate(self.alive) if up]

    def choose(self, prompt_ids: Sequence[int]) -> int:
        """The replica for a prompt, nothing booked."""
        raise NotImplementedError

    def route(self, prompt_ids: Sequence[int], load: int) -> int:
        """``choose``, then book the request (``load`` tokens) on the replica chosen."""
        replica = self.choose(prompt_ids)
        self.loads[replica] += load
        self.requests[replica] += 1
        return replica

    def finished(self, replica: int, load: int) -> None:
        self.loads[replica] = max(self.loads[replica] - load, 0)
        self.requests[replica] = max(self.requests[replica] - 1, 0)

    def mark_dead(self, replica: int) -> None:
        self.alive[replica] = False
        self.loads[replica] = self.requests[replica] = 0

    def _live(self) -> list[int]:
        live = self.live_replicas
        if not live:
            raise RuntimeError("no live replica to route to")
        return live


class PrefixAwareRouter(ReplicaRouter):
    """See the module docstring: ``route`` also remembers the prompt's prefix on the replica
    chosen, and a dead replica forgets what it was sent."""

    def __init__(self, num_replicas: int, config: RouterConfig):
        super().__init__(num_replicas, config)
        self._memories = [PrefixMemory(config.capacity_blocks) for _ in range(num_replicas)]

    def least_loaded(self) -> int:
        """The live replica with the fewest tokens in flight; of equals, the one remembering the
        fewest prefixes, so that new prefixes spread over the replicas' caches even when the
        requests come one at a time (each finds every replica idle)."""
        return min(self._live(), key=lambda i: (self.loads[i], len(self._memories[i]), i))

    def hashes(self, prompt_ids: Sequence[int]) -> tuple[int, ...]:
        return prefix_block_hashes(prompt_ids, self.config.block_size, self.config.max_blocks)

    def choose(self, prompt_ids: Sequence[int], hashes: Sequence[int] | None = None) -> int:
        """The replica for a prompt (nothing booked; ``hashes``: its block hashes, when the
        caller has them): see the module docstring."""
        hashes = self.hashes(prompt_ids) if hashes is None else hashes
        live = self._live()
        least = self.least_loaded()
        if not hashes:
            return least
        matched = {i: self._memories[i].matched_blocks(hashes) for i in live}
        # the longest match, the less loaded of equal matches
        best = max(live, key=lambda i: (matched[i], -self.loads[i], -i))
        routed_tokens = min(len(prompt_ids), self.config.max_blocks * self.config.block_size)
        matched_tokens = matched[best] * self.config.block_size
        if matched_tokens == 0 or matched_tokens < self.config.cache_threshold * routed_tokens:
            return least
        if overloaded(self.requests[best], self.requests[least], self.config):
            return least
        return best

    def route(self, prompt_ids: Sequence[int], load: int) -> int:
        """``choose``, then book the request (``load`` tokens) and the prompt's prefix on the
        replica chosen."""
        hashes = self.hashes(prompt_ids)
        replica = self.choose(prompt_ids, hashes)
        self.loads[replica] += load
        self.requests[replica] += 1
        self._memories[replica].remember(hashes)
        return replica

    def mark_dead(self, replica: int) -> None:
        super().mark_dead(replica)
        self._memories[replica].clear()


class RoundRobinRouter(ReplicaRouter):
    """Live replicas in turn, blind to prefixes and load: the baseline prefix-aware routing is
    measured against (every replica ends up computing and caching every shared prefix)."""

    def __init__(self, num_replicas: int, config: RouterConfig):
        super().__init__(num_replicas, config)
        self._next = 0

    def choose(self, prompt_ids: Sequence[int]) -> int:
        live = self._live()
        replica = next((i for i in live if i >= self._next), live[0])
        self._next = replica + 1
        return replica


# ``--load-balance-method``'s choices, as server_config.LOAD_BALANCE_METHODS names them (it sits below)
ROUTERS: dict[str, type[ReplicaRouter]] = {"prefix_aware": PrefixAwareRouter, "round_robin": RoundRobinRouter}


def make_router(method: str, num_replicas: int, config: RouterConfig) -> ReplicaRouter:
    """The router ``--load-balance-method METHOD`` names, over ``num_replicas`` replicas."""
    if method not in ROUTERS:
        raise ValueError(f"unknown load-balance method {method!r}; choose one of: {', '.join(ROUTERS)}")
    return ROUTERS[method](num_replicas, config)
