"""One structured sequence's place in its grammar: which tokens may come next (its row of the
step's bitmask) and the tokens it has taken. It follows the sequence's output tokens one by one
(``accept``), checks a speculative draft without keeping it (``allowed_prefix``), and is dropped
when the sequence finishes (``release``). A preempted sequence keeps its matcher: recomputing
its KV changes none of its tokens.

A matcher may start ``dormant``: the output is free, and nothing is checked, until it has taken
that token (a reasoning model's end of thinking: the grammar constrains the answer after the
thinking, not the thinking).

It also guesses how its next token is best sampled (``masks_first``): masked before sampling
where few tokens are allowed (a JSON structure's next brace, comma or key: filling that mask
costs a few microseconds, and an unmasked draw would mostly be refused), checked after
sampling where most are (inside a JSON string: the mask costs hundreds of microseconds there,
and a draw is rarely refused). Each filled mask tells which its state is, and a token holding a
double quote may end a JSON string: the token after it is masked first."""

from __future__ import annotations

import concurrent.futures
from typing import Callable, Sequence

import torch

# A state allowing more than this share of the vocabulary is sampled first and checked after
WIDE_MASK_SHARE = 0.5


class GrammarMatcher:
    def __init__(self, compiled: concurrent.futures.Future, on_release: Callable[[], None] | None = None,
                 dormant_until: int | None = None, quote_ids: Callable[[], frozenset[int]] | None = None):
        self._compiled = compiled
        self._quote_ids = quote_ids
        self._on_release = on_release
        self.dormant_until = dormant_until  # None: constraining
        self._special_ids: frozenset[int] = frozenset()
        self.quote_ids: frozenset[int] = frozenset()  # tokens holding a double quote
        self._matcher = None  # an xgrammar GrammarMatcher, made at first use
        self.released = False
        self.masks_first = True  # see the module's doc; the first token is masked

    def saw_mask(self, allowed: int, vocab_size: int) -> None:
        """Its mask was filled and allows ``allowed`` of ``vocab_size`` tokens: the next
        token's state is likely as wide (the grammar's states come in runs)."""
        self.masks_first = allowed <= WIDE_MASK_SHARE * vocab_size

    @property
    def ready(self) -> bool:
        """Its grammar is compiled (or failed to compile: ``error`` says)."""
        return self._compiled.done()

    @property
    def error(self) -> BaseException | None:
        return self._compiled.exception() if self._compiled.done() else None

    @property
    def future(self) -> concurrent.futures.Future:
        return self._compiled

    @property
    def matcher(self):
        """The xgrammar GrammarMatcher (the grammar must be compiled)."""
        if self._matcher is None:
            assert not self.released, "a released grammar matcher is used"
            import xgrammar as xgr  # loaded with the grammar compiler, never by an engine without one

            compiled = self._compiled.result()
            self._matcher = xgr.GrammarMatcher(compiled)
            # tokens that are no text (specials, ids past the tokenizer): never allowed, refused
            # here without asking xgrammar, which warns on stderr for each
            self._special_ids = frozenset(compiled.tokenizer_info.special_token_ids)
            if self._quote_ids is not None:
                self.quote_ids = self._quote_ids()
        return self._matcher

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids that are no text (specials, ids past the tokenizer's): never allowed."""
        self.matcher  # noqa: B018 (made with them)
        return self._special_ids

    def accept(self, token: int) -> bool:
        """Take the sequence's next token; False if the grammar does not allow it."""
        if self.dormant_until is not None:
            if int(token) == self.dormant_until:
                self.dormant_until = None
            return True
        ok = int(token) not in self.special_ids and self.matcher.accept_token(int(token))
        if ok:
            self._took(int(token))
        return ok

    def _took(self, token: int) -> None:
        """A token it accepted: one holding a quote may end a JSON string (module doc)."""
        if token in self.quote_ids:
            self.masks_first = True

    @property
    def constrains(self) -> bool:
        """Whether its next token is constrained: not dormant, released or terminated."""
        return self.dormant_until is None and not self.released and not self.is_terminated

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and has taken a stop token: nothing may follow."""
        return self._matcher is not None and self._matcher.is_terminated()

    def fill_after(self, draft: Sequence[int], bitmask: torch.Tensor, first_row: int) -> None:
        """Rows first_row .. first_row + len(draft): the tokens allowed next, then after each
        token of ``draft`` (which the grammar must allow: see ``allowed_prefix``), leaving the
        matcher where it was. Rows after a token that ends the grammar (a stop token) are left
        as they are: nothing follows it."""
        m = self.matcher
        m.fill_next_token_bitmask(bitmask, first_row)
        taken = 0
        for j, token in enumerate(draft):
            if not m.accept_token(int(token)):
                m.rollback(taken)
                raise ValueError(f"draft token {token} is not allowed by the grammar")
            taken += 1
            if m.is_terminated():
                break
            m.fill_next_token_bitmask(bitmask, first_row + j + 1)
        if taken:
            m.rollback(taken)

    def allowed_prefix(self, draft: Sequence[int]) -> list[int]:
        """The longest prefix of ``draft`` the grammar allows from here (the matcher is left
        where it was)."""
        if self.dormant_until is not None:  # free until the waking token, which ends the draft
            return list(draft[:draft.index(self.dormant_until)] if self.dormant_until in draft else draft)
        m = self.matcher
        kept = 0
        for token in draft:
            if m.is_terminated() or int(token) in self.special_ids or not m.accept_token(int(token)):
                break
            kept += 1
            if m.is_terminated():  # a stop token: the draft ends with it
                break
        if kept:
            m.rollback(kept)
        return list(draft[:kept])

    def release(self) -> None:
        if not self.released and self._on_release is not None:
            self._on_release()
        self._matcher = None
        self.released = True


def accept_tokens(grammars: Sequence[GrammarMatcher], tokens: Sequence[int]) -> list[bool]:
    """``grammars[i].accept(tokens[i])`` for all of them in one call into xgrammar (a step's
    rows: a Python call per row would cost more than the checks)."""
    import xgrammar as xgr

    out = [True] * len(grammars)
    live, matchers, live_tokens = [], [], []
    for i, (g, token) in enumerate(zip(grammars, tokens)):
        token = int(token)
        if g.dormant_until is not None:
            g.accept(token)
            continue
        matcher = g.matcher
        if token in g.special_ids:  # refused without xgrammar's warning
            out[i] = False
        else:
            live.append(i)
            matchers.append(matcher)
            live_tokens.append(token)
    if live:
        for i, token, ok in zip(live, live_tokens, xgr.BatchGrammarMatcher.batch_accept_token(matchers, live_tokens)):
            if ok:
                grammars[i]._took(token)
            else:
                out[i] = False
    return out
