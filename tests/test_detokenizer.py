"""Incremental detokenization and stop strings over a BPE whose tokens span several characters:
a stop string that starts inside one token and ends inside another cuts the text exactly where
it starts, and streamed deltas add up to the final text without ever showing part of a stop."""

from __future__ import annotations

import pytest

from compiled_llm.serve.detokenizer import IncrementalDetokenizer
from compiled_llm.model.tokenizer import load_tokenizer
from test_tokenizer import train_hf_tokenizer

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
