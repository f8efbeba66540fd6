"""`serve --reasoning-parser qwen3` end to end: a lively checkpoint whose transformers-written
tokenizer has <think> and </think> as tokens and a Qwen3-thinking chat template (the generation
prompt opens the block unless ``enable_thinking`` is false), served in this process and asked
with the openai client. The model's greedy reply, known from transformers, contains </think>."""

from __future__ import annotations

import openai
import pytest

from helpers.lively import greedy_continuation, make_lively_checkpoint
from helpers.trained_tokenizers import train_hf_tokenizer

THINK_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} {{ message['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant "
    "{% if enable_thinking is defined and not enable_thinking %}<think> </think> {% else %}<think>{% endif %}"
    "{% endif %}"
)
USERS = ["the quick brown fox", "a lazy dog", "the model engine", "fused kernels", "paged caches",
         "tokens fast on every device", "the fox runs", "graphs into kernels"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def think_checkpoint(tmp_path_factory):
    _, tok = train_hf_tokenizer(vocab_size=200, chat_template=THINK_TEMPLATE, all_bytes=False)
    tok.add_tokens(["<think>", "</think>"])  # added, not special: decoded text keeps them, as Qwen3's
    out = tmp_path_factory.mktemp("think") / "checkpoint"
    return out, make_lively_checkpoint(out, seed=1, tokenizer=tok), tok


@pytest.fixture(scope="module")
def engine(think_checkpoint, tmp_path_factory):
    from compiled_llm.engine.build import build_engine
    from compiled_llm.serve.llm import LLM

    out = tmp_path_factory.mktemp("think_engine") / "engine"
    build_engine(str(think_checkpoint[0]), out, dtype="float32", device="cpu", progress=False)
    return LLM(str(out), device="cpu").engine


def served(engine, **config):
    from starlette.testclient import TestClient

    from compiled_llm.serve.engine_process.engine_core_client import EngineCoreClient
    from compiled_llm.serve.openai.api_server import build_app
    from compiled_llm.serve.server_config import ServerConfig

    app = build_app(EngineCoreClient.in_thread(engine), ServerConfig(**config), model_name="think")
    return TestClient(app, raise_server_exceptions=False)


def greedy_text(think_checkpoint, user: str, **template_kwargs) -> tuple[list[int], str]:
    _, model, tok = think_checkpoint
    text = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False,
                                   **template_kwargs)
    ids = tok.encode(text, add_special_tokens=False)
    tokens = greedy_continuation(model, list(ids), MAX_TOKENS).token_ids
    return list(ids), tok.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def thinking_user(think_checkpoint):
    """A user message whose greedy reply (the block opened by the prompt) closes it midway."""
    for user in USERS:
        _, text = greedy_text(think_checkpoint, user)
        reasoning, closed, answer = text.partition("</think>")
        if closed and reasoning and answer:  # reasoning, the close tag, then an answer
            return user, text
    pytest.fail("no greedy reply of the think checkpoint has reasoning, </think> and an answer")


def ask(client, user: str, **extra):
    return client.chat.completions.create(
        model="think", messages=[{"role": "user", "content": user}], max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True, **extra})


def test_the_think_block_is_reasoning_content_and_the_rest_content(engine, thinking_user):
    user, text = thinking_user
    reasoning, answer = text.split("</think>", 1)
    with served(engine, reasoning_parser="qwen3") as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        reply = ask(client, user, n=2)
        for choice in reply.choices:  # each choice split on its own
            assert choice.message.reasoning_content == reasoning
            assert choice.message.content == (answer or None)
        assert reply.usage.completion_tokens == 2 * MAX_TOKENS

        chunks = list(client.chat.completions.create(
            model="think", messages=[{"role": "user", "content": user}], max_tokens=MAX_TOKENS, temperature=0.0,
            stream=True, extra_body={"ignore_eos": True}))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
        assert "".join(d.content or "" for d in deltas) == answer


def test_without_a_parser_the_reply_is_all_content(engine, thinking_user):
    user, text = thinking_user
    with served(engine) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        message = ask(client, user).choices[0].message
        assert (message.content, getattr(message, "reasoning_content", None)) == (text, None)


def test_enable_thinking_false_closes_the_block_in_the_prompt(engine, think_checkpoint):
    user = USERS[0]
    ids_thinking, _ = greedy_text(think_checkpoint, user)
    ids, text = greedy_text(think_checkpoint, user, enable_thinking=False)
    assert ids != ids_thinking
    with served(engine, reasoning_parser="qwen3") as http:
        tokenized = http.post("/tokenize", json={"prompt": think_checkpoint[2].decode(ids)}).json()
        assert tokenized["tokens"] == ids
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        message = ask(client, user, chat_template_kwargs={"enable_thinking": False}).choices[0].message
        assert (message.reasoning_content, message.content) == (None, text)  # a closed block: all answer


@pytest.mark.parametrize("kwargs", [{"messages": []}, {"bos_token": "x"}, {"add_generation_prompt": False}])
def test_chat_template_kwargs_may_not_shadow_the_renderers_names(engine, kwargs):
    with served(engine) as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "chat_template_kwargs": kwargs})
    assert r.status_code == 400
    error = r.json()["error"]
    assert "reserved" in error["message"] and "\n" not in error["message"]
    assert error["param"] == "chat_template_kwargs"


def test_llm_chat_passes_chat_template_kwargs_to_the_template(engine, think_checkpoint):
    from compiled_llm.serve.llm import LLM

    llm = LLM.__new__(LLM)
    llm.__dict__.update(engine=engine)
    ids, _ = greedy_text(think_checkpoint, USERS[0], enable_thinking=False)
    prompt = llm._chat_prompt([{"role": "user", "content": USERS[0]}], True, {"enable_thinking": False})
    assert prompt["prompt_token_ids"] == ids


def test_a_grammar_constrains_the_answer_after_the_thinking_not_the_thinking(engine, thinking_user):
    user, text = thinking_user
    reasoning = text.split("</think>", 1)[0]
    choices = ["the fox", "a lazy dog"]
    with served(engine, reasoning_parser="qwen3") as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        reply = client.chat.completions.create(
            model="think", messages=[{"role": "user", "content": user}], max_tokens=MAX_TOKENS, temperature=0.0,
            extra_body={"structured_outputs": {"choice": choices}})
        message = reply.choices[0].message
        assert message.reasoning_content == reasoning  # greedy, as without a grammar
        assert message.content in choices and reply.choices[0].finish_reason == "stop"
