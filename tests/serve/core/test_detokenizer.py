"""Incremental detokenization and stop strings over a BPE whose tokens span several characters:
a stop string that starts inside one token and ends inside another cuts the text exactly where
it starts, and streamed deltas add up to the final text without ever showing part of a stop."""

from __future__ import annotations

import pytest

from compiled_llm.serve.core.detokenizer import IncrementalDetokenizer
from compiled_llm.model.tokenizer import load_tokenizer
from helpers.trained_tokenizers import train_hf_tokenizer

TEXT = "the quick brown fox jumps over a lazy dog while the model engine compiles graphs"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("bpe")
    train_hf_tokenizer(vocab_size=200, all_bytes=False)[1].save_pretrained(out)
    return load_tokenizer(out)


def feed(tok, text: str, stop=()):
    """(final text, streamed deltas, tokens consumed) of detokenizing ``text``'s ids one by one."""
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, stop)
    deltas, used = [], 0
    for t in ids:
        used += 1
        stopped = det.add(t)
        deltas.append(det.take_delta(stopped))
        if stopped:
            return det.text, deltas, used
    det.finalize()
    deltas.append(det.take_delta(True))
    return det.text, deltas, used


def test_tokens_span_several_characters(tok):
    ids = tok.encode(TEXT)
    assert len(ids) < len(TEXT) / 3
    assert tok.decode(ids) == TEXT


def test_plain_text_streams_back_whole(tok):
    text, deltas, used = feed(tok, TEXT)
    assert text == TEXT and "".join(deltas) == TEXT and used == len(tok.encode(TEXT))


@pytest.mark.parametrize("stop", ["brown fox", "k bro", "wn f", "o", "lazy dog while", "graphs"])
def test_a_stop_string_cuts_the_text_where_it_starts(tok, stop):
    text, deltas, used = feed(tok, TEXT, [stop])
    assert text == TEXT[: TEXT.index(stop)]
    assert "".join(deltas) == text
    # it stops at the token that completes the stop string, not later
    ids = tok.encode(TEXT)
    assert stop in tok.decode(ids[:used]) and stop not in tok.decode(ids[: used - 1])


def test_a_stop_string_spanning_tokens_is_never_half_streamed(tok):
    stop = "brown fox"
    ids = tok.encode(TEXT)
    first = next(k for k in range(1, len(ids) + 1) if "brown" in tok.decode(ids[:k]))
    assert "brown fox" not in tok.decode(ids[:first])  # "brown" arrives before " fox"
    _, deltas, _ = feed(tok, TEXT, [stop])
    shown = ""
    for d in deltas:
        shown += d
        assert "brown" not in shown  # held back until it is known not to start the stop


def test_the_earliest_of_several_stops_wins(tok):
    text, _, _ = feed(tok, TEXT, ["lazy", "quick", "model"])
    assert text == "the "


# ---- a long output costs linear work ----------------------------------------------------------


class CountingStr(str):
    """Text that counts the characters every concatenation or slice of it copies (into
    ``counter[0]``), and whose slices and sums are CountingStr again."""

    counter = [0]

    def __add__(self, other):
        return self._counted(str.__add__(self, other))

    def __radd__(self, other):
        return self._counted(str.__add__(other, self))

    def __getitem__(self, key):
        return self._counted(str.__getitem__(self, key))

    @classmethod
    def _counted(cls, s: str) -> "CountingStr":
        cls.counter[0] += len(s)
        return cls(s)


class WordTokenizer:
    """Token i decodes to a word of 3-7 characters; every decode is a CountingStr."""

    WORDS = [("w%d" % i).ljust(3 + i % 5, "x") + " " for i in range(500)]

    def decode(self, ids, skip_special_tokens=True):
        return CountingStr("".join(self.WORDS[i] for i in ids))


@pytest.mark.parametrize("stop", [(), ("w77xxx w3",)])
def test_a_100k_token_output_copies_characters_in_linear_proportion_to_its_length(stop):
    """Each token appends its piece, searches stop strings in the tail and streams the new
    text; the whole text is joined once, when read. (Appending to one string would copy the
    text so far at every token: ~10^10 characters here.)"""
    CountingStr.counter[0] = 0
    det = IncrementalDetokenizer(WordTokenizer(), stop)
    ids = [(i * 7919) % 500 for i in range(100_000)]
    streamed = []
    for t in ids:
        assert not det.add(t)
        streamed.append(det.take_delta(False))
    det.finalize()
    streamed.append(det.take_delta(True))
    text = det.text
    assert text == "".join(WordTokenizer.WORDS[i] for i in ids) == "".join(streamed)
    assert len(text) > 600_000
    # each character is copied a few times (its piece, the stop-string tail it is part of, its
    # streamed delta), never once per later token
    assert CountingStr.counter[0] <= 10 * len(text)  # concatenations and slices
    assert det.pieces.chars_joined <= 3 * len(text)  # joins of pieces


def test_a_stop_string_across_many_small_pieces_cuts_and_streams_exactly():
    det = IncrementalDetokenizer(WordTokenizer(), ["w3xxxx w4xxxxx w5x"], include_stop=True)
    shown = ""
    for t in range(10):
        stopped = det.add(t)
        shown += det.take_delta(stopped)
        if stopped:
            break
    assert stopped and t == 5
    assert det.text == shown == "".join(WordTokenizer.WORDS[:3]) + "w3xxxx w4xxxxx w5x"


def test_text_pieces_read_like_the_string_they_spell_and_snapshots_keep_their_moment():
    import random

    from compiled_llm.serve.core.text_pieces import TextPieces

    rng = random.Random(4)
    pieces, model, snapshots = TextPieces(), "", []
    for _ in range(400):
        op = rng.random()
        if op < 0.6:
            piece = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 6)))
            pieces.append(piece)
            model += piece
        elif op < 0.7:
            n = rng.randint(0, len(model))
            pieces.truncate(n)
            model = model[:n]
        elif op < 0.75:
            assert pieces.value() == model
        else:
            snapshots.append((pieces.snapshot(), model))
        start = rng.randint(0, len(model))
        end = rng.randint(start, len(model))
        assert len(pieces) == len(model) and pieces.slice(start, end) == model[start:end]
    pieces.replace("new")
    assert pieces.value() == "new"
    assert all(str(snap) == text for snap, text in snapshots)
