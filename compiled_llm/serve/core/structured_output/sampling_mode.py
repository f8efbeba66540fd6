"""How each structured row of a step is sampled: checked after sampling (the fast way where
most tokens are allowed) or masked before it (``ModelRunner._sample`` tells the two apart)."""

from __future__ import annotations

from typing import Iterable

from compiled_llm.serve.core.sequence import Sequence


def may_check_after(seq: Sequence) -> bool:
    """Whether a structured row may sample unmasked and have its token checked by its grammar
    afterwards: it asks for no log-probabilities (they must be the masked distribution's),
    penalties (its token history is written on the device as it is sampled) or truncation
    (top-k, top-p and min-p of the masked distribution keep other tokens than those of the
    unmasked one). Greedy and temperature sampling, with seeds, logit_bias and stop tokens,
    give the same outputs either way."""
    p = seq.params
    return not (p.logprobs is not None or p.has_penalties or p.top_k not in (-1, 0) or p.top_p < 1.0
                or p.min_p > 0.0)


def masks_before_sampling(seq: Sequence) -> bool:
    """Whether a structured row is masked before it is sampled: always when checking after is
    not allowed (a dormant grammar's mask allows every token, and it may wake before the row
    samples), else where its grammar constrains the token and its state allows few tokens
    (``GrammarMatcher.masks_first``). The others are checked after sampling."""
    g = seq.grammar
    return g is not None and (not may_check_after(seq) or (g.constrains and g.masks_first))


def any_masked_before(seqs: Iterable[Sequence]) -> bool:
    """Whether a step of ``seqs`` must wait for the previous step's tokens before sampling."""
    return any(masks_before_sampling(s) for s in seqs)
