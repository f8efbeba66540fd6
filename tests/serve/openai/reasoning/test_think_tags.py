"""The <think> split, finished and streamed: hand-written outputs, cut into deltas at every
place (tags split across deltas included), must stream exactly the finished split."""

from __future__ import annotations

import itertools

import pytest

from compiled_llm.errors import InvalidOptionError
from compiled_llm.serve.openai.reasoning.chat import ChatReasoning
from compiled_llm.serve.openai.reasoning.parsers import PARSERS, prompt_opens_think
from compiled_llm.serve.openai.reasoning.think_tags import ThinkStream, split_reasoning
from compiled_llm.serve.server_config import REASONING_PARSERS, ServerConfig

# (output, starts in reasoning) -> (reasoning, content)
CASES = [
    ("<think>\nweigh it</think>\n\nThe answer.", False, ("\nweigh it", "\n\nThe answer.")),
    ("<think>weigh it</think>The answer.", True, ("weigh it", "The answer.")),
    ("weigh it</think>The answer.", True, ("weigh it", "The answer.")),  # the prompt opened it
    ("weigh it</think>", True, ("weigh it", None)),
    ("<think></think>answer", False, ("", "answer")),
    ("<think>still weighing", False, ("still weighing", None)),  # never closed: all reasoning
    ("still weighing </thi", True, ("still weighing </thi", None)),  # cut inside the close tag
    ("plain answer", False, (None, "plain answer")),  # enable_thinking false
    ("plain </think> answer", False, (None, "plain </think> answer")),  # outside a block: literal
    ("<thin", False, (None, "<thin")),
    ("<thin", True, ("<thin", None)),
    ("a</think>b</think>c", True, ("a", "b</think>c")),  # only the first close tag ends the block
    ("", False, (None, None)),
    ("", True, ("", None)),
]


@pytest.mark.parametrize("text, opened, expected", CASES)
def test_a_finished_output_splits_at_the_first_close_tag(text, opened, expected):
    assert split_reasoning(text, opened) == expected


def streamed(deltas: list[str], opened: bool) -> tuple[str, str]:
    stream = ThinkStream(opened)
    parts = [stream.feed(d) for d in deltas] + [stream.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


def cuts(text: str, pieces: int):
    """Every way to cut ``text`` into ``pieces`` deltas (empty ones included)."""
    for points in itertools.combinations_with_replacement(range(len(text) + 1), pieces - 1):
        bounds = (0, *points, len(text))
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("text, opened, expected", CASES)
def test_every_cut_into_deltas_streams_the_finished_split(text, opened, expected):
    reasoning, content = expected
    for pieces in (1, 2, 3):
        for deltas in cuts(text, pieces):
            assert streamed(deltas, opened) == (reasoning or "", content or ""), deltas


def test_one_character_at_a_time_holds_back_only_a_tags_beginning():
    stream = ThinkStream(False)
    out = [stream.feed(ch) for ch in "<think>ab</think>cd"]
    assert out[:7] == [("", "")] * 7  # the open tag
    assert out[7:9] == [("a", ""), ("b", "")]
    assert out[9:17] == [("", "")] * 8  # the close tag
    assert out[17:] == [("", "c"), ("", "d")]
    assert stream.finish() == ("", "")


def test_qwen3_reasons_only_when_the_output_or_the_prompt_opens_the_block():
    qwen3, r1 = PARSERS["qwen3"], PARSERS["deepseek_r1"]
    assert qwen3.split("x</think>y", "<|im_start|>assistant\n<think>\n") == ("x", "y")
    assert qwen3.split("x</think>y", "<|im_start|>assistant\n<think>\n\n</think>\n\n") == (None, "x</think>y")
    assert qwen3.split("x</think>y", "<|im_start|>assistant\n") == (None, "x</think>y")
    assert r1.split("x</think>y", "<|Assistant|>") == ("x", "y")  # R1 always starts in the block
    assert r1.split("<think>x", "") == ("x", None)
    assert prompt_opens_think("<think>\n") and not prompt_opens_think("<think>\n</think>\n")


def test_each_choice_streams_on_its_own_and_empty_deltas_are_left_out():
    chat = ChatReasoning(PARSERS["deepseek_r1"], "")
    assert chat.delta(0, "a</thi", False) == {"reasoning_content": "a"}
    assert chat.delta(1, "b", False) == {"reasoning_content": "b"}
    assert chat.delta(0, "nk>", False) == {}
    assert chat.delta(0, "ok", True) == {"content": "ok"}
    assert chat.delta(1, "</th", True) == {"reasoning_content": "</th"}  # finished inside the tag
    assert chat.split("a</think>") == ("a", "")


def test_the_server_option_names_the_parsers_there_are():
    assert set(REASONING_PARSERS) == set(PARSERS)
    assert ServerConfig(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(InvalidOptionError, match="unknown reasoning parser 'qwen'; choose one of: deepseek_r1, qwen3"):
        ServerConfig(reasoning_parser="qwen")
