"""``PrefixAffinity``: which replica a prompt goes to, so that its prefix is likely cached there.

A prompt is cut into blocks (token ids: ``block_size`` of them; text: ``text_block_chars``
characters) and each full block is hashed together with everything before it, so a block's hash
names the whole prefix up to it, as the engines' prefix caches do. Each replica remembers the
hashes of the prompts it was sent (the most recent ``max_blocks_per_replica``: a bounded memory,
as SGLang's cache-aware router keeps). A prompt goes to the replica that holds the longest run of
its leading blocks, unless that replica is busier than the least loaded one by more than
``max_imbalance`` requests; with no block matched anywhere it goes to the least loaded (of
those, the one sent the fewest prompts, so that new prefixes spread out).

Plain Python, no Ray: ``request_router.PrefixAwareRequestRouter`` adapts it to Ray Serve, and a
data-parallel router can hold one the same way (``route(prompt, replicas, load)``), the replicas
being whatever hashable ids it keys them by.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Callable, Hashable, Sequence

from compiled_llm.serve.engine_process.dp_router import PrefixMemory

Prompt = str | Sequence[int] | None


@dataclasses.dataclass(frozen=True)
class PrefixRoutingConfig:
    block_size: int = 16  # the engines' KV block size (token-id prompts)
    text_block_chars: int = 64  # text prompts: about one block of tokens
    max_blocks_per_replica: int = 1 << 16
    max_imbalance: int = 8  # in-flight requests a cached prefix may cost over the least loaded replica

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name == "max_imbalance" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"prefix routing's {f.name} must be a whole number >= {low}, got {value!r}")


class PrefixAffinity:
    def __init__(self, config: PrefixRoutingConfig = PrefixRoutingConfig()):
        self.config = config
        # per replica: the block hashes it was sent (dp_router's bounded memory, as the server's
        # data-parallel router keeps it)
        self._blocks: dict[Hashable, PrefixMemory] = {}
        self._sent: collections.Counter[Hashable] = collections.Counter()  # prompts sent, per replica

    def block_hashes(self, prompt: Prompt) -> list[int]:
        """The chained hashes of the prompt's full blocks (none for an empty or unknown prompt)."""
        if not prompt:
            return []
        size = self.config.text_block_chars if isinstance(prompt, str) else self.config.block_size
        text = isinstance(prompt, str)
        hashes, running = [], b"text" if text else b"ids"
        for start in range(0, len(prompt) - size + 1, size):
            block = prompt[start:start + size]
            data = block.encode() if text else b",".join(b"%d" % t for t in block)
            # stable across processes (str's hash() is not), so routers anywhere agree
            running = hashlib.blake2b(running + b"|" + data, digest_size=8).digest()
            hashes.append(int.from_bytes(running, "little"))
        return hashes

    def matched_blocks(self, hashes: list[int], replica: Hashable) -> int:
        """How many of the leading blocks ``replica`` was sent before."""
        held = self._blocks.get(replica)
        return held.matched_blocks(hashes) if held is not None else 0

    def choose(self, prompt: Prompt, replicas: Sequence[Hashable], load: Callable[[Hashable], int] = lambda r: 0,
               hashes: list[int] | None = None) -> Hashable:
        """The replica ``prompt`` should go to (nothing is remembered: see ``record``).
        ``load(replica)``: its in-flight requests (or tokens); ties go to the earliest listed."""
        if not replicas:
            raise ValueError("no replica to route to")
        hashes = self.block_hashes(prompt) if hashes is None else hashes
        # among the least loaded, the one sent the fewest prompts: new prefixes spread out
        least = min(replicas, key=lambda r: (load(r), self._sent.get(r, 0)))
        best = max(replicas, key=lambda r: self.matched_blocks(hashes, r))
        if self.matched_blocks(hashes, best) and load(best) <= load(least) + self.config.max_imbalance:
            return best
        return least

    def record(self, prompt: Prompt, replica: Hashable, hashes: list[int] | None = None) -> None:
        """Remember that ``replica`` was sent ``prompt`` (its blocks are now cached there)."""
        self._sent[replica] += 1
        held = self._blocks.setdefault(replica, PrefixMemory(self.config.max_blocks_per_replica))
        held.remember(self.block_hashes(prompt) if hashes is None else hashes)

    def route(self, prompt: Prompt, replicas: Sequence[Hashable], load: Callable[[Hashable], int] = lambda r: 0) -> Hashable:
        """``choose``, then ``record``: the replica, remembered as holding the prompt's blocks."""
        hashes = self.block_hashes(prompt)
        replica = self.choose(prompt, replicas, load, hashes)
        self.record(prompt, replica, hashes)
        return replica

    def forget(self, replica: Hashable) -> None:
        """A replica that is gone (its cache with it)."""
        self._blocks.pop(replica, None)
        self._sent.pop(replica, None)
