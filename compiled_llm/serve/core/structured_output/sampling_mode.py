"""How a step's structured rows are sampled: checked after sampling (the fast way) or masked
before it (``ModelRunner._sample`` tells the two apart)."""

from __future__ import annotations

from typing import Iterable

from compiled_llm.serve.core.sequence import Sequence


def checks_grammar_after(seqs: Iterable[Sequence]) -> bool:
    """Whether the structured rows among ``seqs`` may sample unmasked and have their tokens
    checked by their grammars afterwards: none asks for log-probabilities (they must be the
    masked distribution's), penalties (their token history is written on the device as it is
    sampled) or truncation (top-k, top-p and min-p of the masked distribution keep other tokens
    than those of the unmasked one). Greedy and temperature sampling, with seeds, logit_bias
    and stop tokens, give the same outputs either way."""
    for seq in seqs:
        if seq.grammar is None:
            continue
        p = seq.params
        if (p.logprobs is not None or p.has_penalties or p.top_k not in (-1, 0) or p.top_p < 1.0
                or p.min_p > 0.0):
            return False
    return True
