"""The serving workload's ``prefix_repetition`` dataset (vLLM's ``--dataset-name prefix_repetition``),
which ``routing_comparison.py`` serves to compare data-parallel routings.

The dataset: ``num_prefixes`` shared prefixes of ``prefix_len`` random token ids (system prompts),
each followed in ``num_requests / num_prefixes`` requests (its users) by ``suffix_len`` ids of the
request's own, all the requests in a seeded random order, each asking for ``output_len`` tokens
(``ignore_eos``). A request whose prefix is in its engine's prefix cache prefills only its suffix.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from compiled_llm.errors import InvalidOptionError

DATASETS = ("random", "prefix_repetition")
USERS_PER_PREFIX = 16  # requests per prefix when --num-requests is not given: 32 prefixes x 16, 512
TOKEN_IDS = 10_001  # ids drawn in 0..10000, as the throughput workload's (folded into a smaller vocabulary)


@dataclass(frozen=True)
class PrefixRepetition:
    """The dataset's shape, vLLM's ``--prefix-repetition-*`` options (its defaults are 256, 256,
    10 and 128 tokens; these make the shared prefix most of a prompt, as a long system prompt is)."""

    prefix_len: int = 1024
    suffix_len: int = 64
    num_prefixes: int = 32
    output_len: int = 128

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidOptionError(f"prefix_repetition_{f.name} must be an integer >= 1, got {value!r}")

    def users(self, num_requests: int) -> int:
        """Requests per prefix: ``num_requests`` must be a whole number of them."""
        if num_requests < self.num_prefixes or num_requests % self.num_prefixes:
            raise InvalidOptionError(
                f"num_requests {num_requests} must be a multiple of prefix_repetition_num_prefixes "
                f"{self.num_prefixes} (each prefix is shared by num_requests / num_prefixes requests)")
        return num_requests // self.num_prefixes

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + self.suffix_len


def prefix_repetition_prompts(num_requests: int, shape: PrefixRepetition, vocab_size: int,
                              seed: int = 0) -> list[list[int]]:
    """The dataset's prompts (module docstring), as token ids below ``min(vocab_size, 10001)``."""
    users = shape.users(num_requests)
    rng = random.Random(seed)
    ids = min(vocab_size, TOKEN_IDS)

    def draw(n: int) -> list[int]:
        return [rng.randrange(ids) for _ in range(n)]

    prefixes = [draw(shape.prefix_len) for _ in range(shape.num_prefixes)]
    prompts = [prefix + draw(shape.suffix_len) for prefix in prefixes for _ in range(users)]
    rng.shuffle(prompts)
    return prompts
