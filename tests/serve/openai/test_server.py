"""`compiled-llm serve`: the official openai client against a real server process on a CPU, its
greedy tokens checked against transformers (the lively checkpoint, whose outputs vary), and the
async front end on its own.

Two server processes for the whole module: one with an API key for the API's behaviour, and one
with a one-request batch and a one-request waiting queue for admission control and the SIGTERM
drain (which ends it).
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from helpers.server_fixtures import child_pids, http_status, process_exists, scrape, serve_process, wait_until

API_KEY = "test-key"
MODEL = "lively"
PROMPTS = [
    "The quick brown fox",
    "A compiler lowers",
    "Once upon a time",
    "Paged attention keeps",
    "hello world",
    "continuous batching of requests",
    "in the beginning",
    "tokens per second",
]


# ---- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(lively_bpe_engine, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with serve_process(lively_bpe_engine, "--api-key", API_KEY, "--served-model-name", MODEL, log_path=log) as s:
        yield s


@pytest.fixture(scope="module")
def small_server(lively_bpe_engine, tmp_path_factory):
    """One sequence at a time and one waiting request: the third concurrent request is refused."""
    log = tmp_path_factory.mktemp("small_server") / "serve.log"
    with serve_process(lively_bpe_engine, "--served-model-name", MODEL, "--max-num-seqs", "1",
                       "--max-waiting-requests", "1", "--shutdown-timeout", "60", log_path=log) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key=API_KEY, max_retries=0)


def greedy(**extra):
    """Greedy sampling that ignores EOS, so every request runs to max_tokens like the lively_oracle."""
    return {"temperature": 0.0, "extra_body": {"ignore_eos": True, **extra}}


def idle(url: str) -> bool:
    m = scrape(url)
    return (m["compiled_llm:num_requests_running"] == 0 and m["compiled_llm:num_requests_waiting"] == 0
            and m["compiled_llm:kv_cache_usage_perc"] == 0)


# ---- the API ---------------------------------------------------------------------------------------------


def test_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_equals_transformers_greedy(client, lively_hf_tokenizer, lively_oracle):
    prompt = PROMPTS[0]
    ids, text = lively_oracle(lively_hf_tokenizer(prompt)["input_ids"], 24)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **greedy())
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert out.choices[0].text == text
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(lively_hf_tokenizer(prompt)["input_ids"]), 24)
    assert out.usage.total_tokens == out.usage.prompt_tokens + 24


def test_completion_stops_at_eos_like_transformers(client, lively_hf_tokenizer, lively_oracle):
    # without ignore_eos the output is the lively_oracle's run cut after its first end token (the
    # checkpoint's EOS and the tokenizer's, as in vLLM), or at max_tokens
    ends = {lively_hf_tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    stops = 0
    for prompt in PROMPTS:
        ids, _ = lively_oracle(lively_hf_tokenizer(prompt)["input_ids"], 40)
        end = next((i for i, t in enumerate(ids) if t in ends), None)
        cut = ids if end is None else ids[:end + 1]
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0.0)
        assert out.choices[0].text == lively_hf_tokenizer.decode(cut, skip_special_tokens=True)
        assert out.choices[0].finish_reason == ("length" if end is None else "stop")
        assert out.usage.completion_tokens == len(cut)
        stops += end is not None
    assert stops > 0  # the prompts exercise a stop


def test_token_id_prompts_give_one_choice_each_in_order(client, lively_hf_tokenizer, lively_oracle):
    prompts = [lively_hf_tokenizer(p)["input_ids"] for p in PROMPTS[1:4]]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, echo=True, **greedy())
    assert [c.index for c in out.choices] == [0, 1, 2]
    for choice, ids in zip(out.choices, prompts):
        assert choice.text == lively_hf_tokenizer.decode(ids) + lively_oracle(ids, 12)[1]
    assert out.usage.prompt_tokens == sum(map(len, prompts))
    assert out.usage.completion_tokens == 3 * 12


def test_streamed_completion_equals_transformers_greedy(client, lively_hf_tokenizer, lively_oracle):
    prompt = PROMPTS[2]
    _, text = lively_oracle(lively_hf_tokenizer(prompt)["input_ids"], 32)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, stream=True,
                                            stream_options={"include_usage": True}, **greedy()))
    pieces = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in pieces) == text
    assert [c.choices[0].finish_reason for c in pieces][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in pieces[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32


def chat_messages(text: str) -> list[dict]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


def chat_prompt_ids(lively_hf_tokenizer, messages) -> list[int]:
    out = lively_hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_completion_equals_transformers_greedy(client, lively_hf_tokenizer, lively_oracle):
    messages = chat_messages(PROMPTS[3])
    ids = chat_prompt_ids(lively_hf_tokenizer, messages)
    _, text = lively_oracle(ids, 20)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, **greedy())
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == text
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 20)

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, stream=True, **greedy())
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_32_concurrent_streams_are_each_correct(server, lively_hf_tokenizer, lively_oracle):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]
    expected = [lively_oracle(lively_hf_tokenizer(p)["input_ids"], 16 + i % 8)[1] for i, p in enumerate(prompts)]

    async def one(aclient, i: int) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=prompts[i], max_tokens=16 + i % 8,
                                                  stream=True, **greedy())
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.api_url, api_key=API_KEY, max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    assert asyncio.run(all_of_them()) == expected


def test_a_stream_closed_midway_is_aborted_and_frees_its_blocks(client, server):
    before = scrape(server.url)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=480, stream=True, **greedy())
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None
    stream.close()
    wait_until(lambda: idle(server.url), what="running 0 and KV-cache usage 0")
    after = scrape(server.url)
    aborted = "compiled_llm:request_success_total{finished_reason=abort}"
    assert after[aborted] == before.get(aborted, 0.0) + 1
    generated = "compiled_llm:generation_tokens_total"
    assert after[generated] - before[generated] < 480  # it stopped before its max_tokens


def test_n_completions_are_indexed_prompt_major(client, lively_hf_tokenizer, lively_oracle):
    expected = [lively_oracle(lively_hf_tokenizer(p)["input_ids"], 6)[1] for p in PROMPTS[:2]]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=6, **greedy())
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [expected[0]] * 2 + [expected[1]] * 2
    assert out.usage.completion_tokens == 4 * 6

    streamed = {}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=6, stream=True,
                                           **greedy()):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(4)] == [expected[0]] * 2 + [expected[1]] * 2


def test_a_seed_makes_sampling_reproducible(client):
    def sample():
        return client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=1.0, seed=7,
                                         extra_body={"ignore_eos": True}).choices[0].text

    assert sample() == sample()


def test_stop_strings_end_the_text(client, lively_hf_tokenizer, lively_oracle):
    _, text = lively_oracle(lively_hf_tokenizer(PROMPTS[0])["input_ids"], 24)
    stop = text[6:9]
    cut = text[:text.index(stop)]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, stop=[stop], **greedy())
    assert (out.choices[0].text, out.choices[0].finish_reason) == (cut, "stop")
    assert out.choices[0].model_extra["stop_reason"] == stop
    kept = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, stop=[stop],
                                     **greedy(include_stop_str_in_output=True))
    assert kept.choices[0].text == cut + stop


@pytest.fixture(scope="module")
def reference_logprobs(lively_bpe_checkpoint):
    """log_softmax of transformers' logits for each token of ``ids`` after the first ``start``."""
    import torch

    model = lively_bpe_checkpoint[1]

    def reference(ids: list[int], start: int):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)[start - 1:len(ids) - 1]

    return reference


def test_completion_logprobs_are_the_models_log_softmax(client, lively_hf_tokenizer, lively_oracle, reference_logprobs):
    prompt = lively_hf_tokenizer(PROMPTS[5])["input_ids"]
    ids, _ = lively_oracle(prompt, 8)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, logprobs=3, **greedy())
    lp = out.choices[0].logprobs
    ref = reference_logprobs(prompt + ids, len(prompt))
    assert "".join(lp.tokens) == lively_hf_tokenizer.decode(ids, skip_special_tokens=False)
    assert lp.text_offset == [len("".join(lp.tokens[:j])) for j in range(8)]
    for j, token in enumerate(ids):
        assert lp.token_logprobs[j] == pytest.approx(float(ref[j, token]), abs=1e-4)
        best = sorted(lp.top_logprobs[j].values(), reverse=True)[:3]
        assert best == pytest.approx(ref[j].topk(3).values.tolist(), abs=1e-4)


def test_chat_logprobs_list_the_top_tokens_in_order(client, lively_hf_tokenizer, lively_oracle, reference_logprobs):
    messages = chat_messages(PROMPTS[6])
    prompt = chat_prompt_ids(lively_hf_tokenizer, messages)
    ids, _ = lively_oracle(prompt, 6)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, logprobs=True,
                                         top_logprobs=2, **greedy())
    content = out.choices[0].logprobs.content
    ref = reference_logprobs(prompt + ids, len(prompt))
    assert len(content) == 6
    for j, entry in enumerate(content):
        assert entry.logprob == pytest.approx(float(ref[j, ids[j]]), abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(ref[j].topk(2).values.tolist(), abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token  # greedy takes the most likely
        assert bytes(entry.bytes).decode() == entry.token


def test_every_route_needs_the_key_but_health_metrics_and_version(server):
    bad = openai.OpenAI(base_url=server.api_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401
    request = urllib.request.Request(server.api_url + "/completions", data=json.dumps({"prompt": "hi"}).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 401
    assert set(json.loads(e.value.read())["error"]) == {"message", "type", "param", "code"}
    for path in ("/tokenize", "/detokenize"):
        request = urllib.request.Request(server.url + path, data=b"{not json", headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=10)
        assert e.value.code == 401, path  # the key is checked before the body
    for path in ("/health", "/metrics", "/version", "/openapi.json"):
        assert http_status(server.url + path) == 200, path


@pytest.mark.parametrize("params, named", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),  # a type error is a 400 too, not FastAPI's 422
    ({"max_tokens": 100_000}, "max length"),
    ({"extra_body": {"stop_token_ids": [-3]}}, "stop_token_ids"),
])
def test_bad_parameters_are_400_with_the_reason(client, params, named):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hello", **params)
    assert e.value.status_code == 400
    assert named in e.value.body["message"]


def test_bad_chat_messages_are_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[])
    assert "messages" in e.value.body["message"]


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_tools_are_served_with_each_tool_choice_and_auto_needs_the_flag(client):
    ask = dict(model=MODEL, messages=chat_messages("hi"), tools=[WEATHER_TOOL], max_tokens=4, temperature=0)
    reply = client.chat.completions.create(**ask, tool_choice="none")
    assert reply.choices[0].message.tool_calls in (None, []) and reply.choices[0].finish_reason in ("stop", "length")
    reply = client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = reply.choices[0].message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function" and call.function.name == "get_weather"
    # this model's vocabulary spells no "{": its grammar has no first token, and the answer ends
    # ("abort") instead of breaking it (tests/serve/openai/test_structured_server.py spells JSON)
    assert reply.choices[0].message.content is None and reply.choices[0].finish_reason in ("stop", "length", "abort")
    reply = client.chat.completions.create(**ask, tool_choice="required")
    assert reply.choices[0].finish_reason in ("tool_calls", "length", "stop", "abort")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**ask, tool_choice="auto")
    assert "--enable-auto-tool-choice" in e.value.body["message"]


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hello", max_tokens=2)
    assert "no-such-model" in e.value.body["message"]


def test_tokenize_and_detokenize(server, lively_hf_tokenizer):
    def post(path, body):
        request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json", **KEY})
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.loads(r.read())

    ids = post("/tokenize", {"prompt": PROMPTS[5]})
    assert ids["tokens"] == lively_hf_tokenizer(PROMPTS[5])["input_ids"] and ids["count"] == len(ids["tokens"])
    assert post("/detokenize", {"tokens": ids["tokens"]})["prompt"] == PROMPTS[5]
    chat = post("/tokenize", {"messages": chat_messages("hi")})
    assert chat["tokens"] == chat_prompt_ids(lively_hf_tokenizer, chat_messages("hi"))


def test_metrics_show_the_histograms_and_counters(client, server):
    client.completions.create(model=MODEL, prompt=PROMPTS[6], max_tokens=8, **greedy())
    m = scrape(server.url)
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert m[f"compiled_llm:{name}_count"] >= 1, name
        assert m[f"compiled_llm:{name}_bucket{{le=+Inf}}"] == m[f"compiled_llm:{name}_count"]
    assert m["compiled_llm:request_success_total{finished_reason=length}"] >= 1
    assert m["compiled_llm:prompt_tokens_total"] > 0 and m["compiled_llm:generation_tokens_total"] >= 8
    assert m["compiled_llm:prefix_cache_queries_total"] >= m["compiled_llm:prefix_cache_hits_total"]
    assert "compiled_llm:num_preemptions_total" in m


# ---- what vLLM's clients rely on ------------------------------------------------------------------------------


def post(server, path: str, body: dict) -> tuple[int, dict]:
    """(status, JSON body) of POST ``path`` with the API key."""
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def sse_events(server, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed call, [DONE] left out."""
    request = urllib.request.Request(server.url + path, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=60) as r:
        lines = r.read().decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("body, named", [
    ({"prompt": [True, False], "max_tokens": True}, ["prompt", "max_tokens"]),  # not token 1 and 0, not 1 token
    ({"prompt": [[False]], "max_tokens": 2}, ["prompt"]),
    ({"prompt": "hi", "max_tokens": 2, "temperature": True}, ["temperature"]),
    ({"prompt": "hi", "max_tokens": 2, "ignore_eos": 1}, ["ignore_eos"]),
    ({"prompt": "hi", "max_tokens": 2.0}, ["max_tokens"]),
    ({"prompt": "hi", "max_tokens": 2, "stop_token_ids": [True]}, ["stop_token_ids"]),
])
def test_http_takes_the_types_sampling_params_takes(server, body, named):
    status, out = post(server, "/v1/completions", body)
    assert status == 400, out
    for name in named:
        assert name in out["error"]["message"]


def test_stream_options_without_stream_is_400_as_in_vllm(server):
    status, out = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                   "stream_options": {"include_usage": True}})
    assert status == 400
    assert out["error"]["message"] == "Stream options can only be defined when `stream=True`."
    assert out["error"]["param"] == "stream_options"


def test_a_seed_must_fit_int64_as_in_vllm(server):
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1})[0] == 200
    status, out = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 2**63})
    assert status == 400 and "seed" in out["error"]["message"]


def test_chat_prompt_logprobs_are_at_the_top_level_and_null_unless_asked(server):
    body = {"messages": chat_messages(PROMPTS[1]), "max_tokens": 2, "temperature": 0.0}
    status, out = post(server, "/v1/chat/completions", body)
    assert status == 200 and out["prompt_logprobs"] is None and "prompt_logprobs" not in out["choices"][0]
    status, out = post(server, "/v1/chat/completions", {**body, "prompt_logprobs": 1})
    assert status == 200 and "prompt_logprobs" not in out["choices"][0]
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == out["usage"]["prompt_tokens"]


def test_echoed_special_tokens_keep_their_text_and_offsets_run_on(server, lively_hf_tokenizer):
    prompt = [0, 0, 0, 0, 0]
    echo = lively_hf_tokenizer.decode(prompt, skip_special_tokens=False)
    assert echo  # token 0 is a special token whose text vLLM echoes
    status, out = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 1,
                                                   "temperature": 0.0, "ignore_eos": True})
    assert status == 200
    choice = out["choices"][0]
    assert choice["text"].startswith(echo)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 5 + 3 and "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:j])) for j in range(8)]


def test_echo_with_max_tokens_0_scores_the_prompt_alone(server, lively_hf_tokenizer, reference_logprobs):
    # lm-eval's loglikelihood requests: the prompt's own logprobs, nothing generated shown
    prompt = lively_hf_tokenizer(PROMPTS[1])["input_ids"]
    status, out = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1,
                                                   "temperature": 0.0})
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["text"] == lively_hf_tokenizer.decode(prompt)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) and lp["token_logprobs"][0] is None
    ref = reference_logprobs(prompt, 1)
    for j, token in enumerate(prompt[1:]):
        assert lp["token_logprobs"][j + 1] == pytest.approx(float(ref[j, token]), abs=1e-4)
    assert post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0})[0] == 400  # without echo: nothing


def test_tokenize_returns_the_token_strings_when_asked(server, lively_hf_tokenizer):
    status, out = post(server, "/tokenize", {"prompt": PROMPTS[5], "return_token_strs": True})
    assert status == 200
    assert out["token_strs"] == lively_hf_tokenizer.convert_ids_to_tokens(out["tokens"])
    assert post(server, "/tokenize", {"prompt": PROMPTS[5]})[1]["token_strs"] is None
    plain = post(server, "/tokenize", {"prompt": PROMPTS[5], "add_special_tokens": False})[1]
    assert plain["tokens"] == lively_hf_tokenizer(PROMPTS[5], add_special_tokens=False)["input_ids"]
    # what it cannot do is refused by name, not ignored
    status, out = post(server, "/tokenize", {"messages": chat_messages("hi"), "chat_template": "{{ messages }}"})
    assert status == 400 and out["error"]["param"] == "chat_template"


def test_completion_top_logprobs_list_the_chosen_token_first(server):
    status, out = post(server, "/v1/completions", {"prompt": PROMPTS[4], "max_tokens": 24, "logprobs": 5,
                                                   "temperature": 1.5, "seed": 3, "ignore_eos": True})
    assert status == 200
    lp = out["choices"][0]["logprobs"]
    unlikely = 0
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        first = next(iter(top))
        assert (first, top[first]) == (token, logprob)
        unlikely += logprob < max(top.values())
    assert unlikely > 0  # some sampled tokens were not the most likely: the order is not the ranks'


def test_min_tokens_holds_back_the_stop_tokens(server, lively_hf_tokenizer, lively_oracle):
    prompt = lively_hf_tokenizer(PROMPTS[0])["input_ids"]
    ids, _ = lively_oracle(prompt, 12)
    first = ids[0]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "stop_token_ids": [first],
            "return_token_ids": True}
    assert post(server, "/v1/completions", body)[1]["choices"][0]["token_ids"] == [first]
    out = post(server, "/v1/completions", {**body, "min_tokens": 4})[1]["choices"][0]
    assert first not in out["token_ids"][:4] and len(out["token_ids"]) >= 4
    assert out["finish_reason"] == ("stop" if out["token_ids"][-1] == first else "length")


def test_truncate_prompt_tokens_keeps_the_last_ones(server, lively_hf_tokenizer, lively_oracle):
    prompt = lively_hf_tokenizer(" ".join(PROMPTS))["input_ids"]
    ids, text = lively_oracle(prompt[-6:], 5)
    status, out = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0.0,
                                                   "ignore_eos": True, "truncate_prompt_tokens": 6,
                                                   "return_token_ids": True})
    assert status == 200
    assert out["usage"]["prompt_tokens"] == 6
    assert out["choices"][0]["prompt_token_ids"] == prompt[-6:] and out["choices"][0]["text"] == text
    status, out = post(server, "/v1/chat/completions", {"messages": chat_messages("hi"), "max_tokens": 1,
                                                        "truncate_prompt_tokens": 3})
    assert status == 200 and out["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize("path, extra, named", [
    ("/v1/completions", {"guided_choice": ["a", "b"]}, "guided_choice"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"skip_special_tokens": False}, "skip_special_tokens"),
    ("/v1/completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("/v1/completions", {"cache_salt": "salt"}, "cache_salt"),
    ("/v1/completions", {"logprobs": -1}, "whole vocabulary"),
    ("/v1/chat/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),  # reserved
    ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "whole vocabulary"),
    ("/v1/chat/completions", {"add_special_tokens": True}, "add_special_tokens"),
])
def test_vllm_fields_this_server_lacks_are_refused_by_name(server, path, extra, named):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": chat_messages("hi")}
    status, out = post(server, path, {**base, "max_tokens": 2, **extra})
    assert status == 400, out
    assert named in out["error"]["message"]
    # the neutral values ask for nothing
    assert post(server, path, {**base, "max_tokens": 2, "use_beam_search": False, "skip_special_tokens": True,
                               "structured_outputs": None, "response_format": {"type": "text"}})[0] == 200


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"structured_outputs": {"choice": ["yes", "no"]}, "logit_bias": {"5": 2.5}}),
    ("/v1/completions", {"response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA,
                                                                                         "strict": True}}}),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "[a-z]+"}, "logit_bias": {"7": -100}}),
])
def test_structured_outputs_and_logit_bias_are_taken_on_both_endpoints(server, path, extra):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": chat_messages("hi")}
    status, out = post(server, path, {**base, "max_tokens": 2, **extra})
    assert status == 200, out


@pytest.mark.parametrize("path, extra, named", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}},
     "response_format.json_schema.schema is missing"),
    ("/v1/completions", {"response_format": {"type": "xml"}}, "response_format.type must be one of"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "either response_format or structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ("/v1/chat/completions", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "'x', which is not in tools"),
    ("/v1/chat/completions", {"tools": [WEATHER_TOOL], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "leave response_format"),
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias keys must be token ids"),
    ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias[5] must be in [-100, 100]"),
])
def test_bad_structured_output_tool_choice_and_logit_bias_are_400_naming_the_problem(server, path, extra, named):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": chat_messages("hi")}
    status, out = post(server, path, {**base, "max_tokens": 2, **extra})
    assert status == 400, out
    assert named in out["error"]["message"]


def test_chat_echo_starts_the_reply_with_the_last_message(server):
    messages = [*chat_messages("Tell me a story"), {"role": "assistant", "content": "Once upon"}]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
            "add_generation_prompt": False}
    plain = post(server, "/v1/chat/completions", body)[1]["choices"][0]["message"]["content"]
    echoed = post(server, "/v1/chat/completions", {**body, "echo": True})[1]["choices"][0]["message"]["content"]
    assert echoed == "Once upon" + plain
    streamed = sse_events(server, "/v1/chat/completions", {**body, "echo": True})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed if c["choices"]) == echoed


def test_return_token_ids_gives_the_prompt_and_output_ids(server, lively_hf_tokenizer, lively_oracle):
    prompt = lively_hf_tokenizer(PROMPTS[2])["input_ids"]
    ids, _ = lively_oracle(prompt, 6)
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    choice = post(server, "/v1/completions", body)[1]["choices"][0]
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (prompt, ids)
    chunks = [c["choices"][0] for c in sse_events(server, "/v1/completions", body) if c["choices"]]
    assert chunks[0]["prompt_token_ids"] == prompt and all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == ids

    messages = chat_messages(PROMPTS[2])
    out = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 3, "temperature": 0.0,
                                                "ignore_eos": True, "return_token_ids": True})[1]
    assert out["prompt_token_ids"] == chat_prompt_ids(lively_hf_tokenizer, messages)
    assert out["choices"][0]["token_ids"] == lively_oracle(out["prompt_token_ids"], 3)[0]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server, lively_hf_tokenizer, lively_oracle):
    prompt = lively_hf_tokenizer(PROMPTS[3])["input_ids"]
    ids, _ = lively_oracle(prompt, 4)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True, "logprobs": 2,
            "return_tokens_as_token_ids": True}
    lp = post(server, "/v1/completions", body)[1]["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert all(key.startswith("token_id:") for top in lp["top_logprobs"] for key in top)
    chat = post(server, "/v1/chat/completions", {"messages": chat_messages("hi"), "max_tokens": 2, "logprobs": True,
                                                 "top_logprobs": 1, "return_tokens_as_token_ids": True})[1]
    assert all(e["token"].startswith("token_id:") for e in chat["choices"][0]["logprobs"]["content"])


def test_continuous_usage_stats_put_the_usage_on_every_chunk(server, lively_hf_tokenizer):
    prompt = lively_hf_tokenizer(PROMPTS[6])["input_ids"]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse_events(server, "/v1/completions", body)
    pieces = [e for e in events if e["choices"]]
    assert all(e["usage"]["prompt_tokens"] == len(prompt) for e in pieces)
    done = [e["usage"]["completion_tokens"] for e in pieces]
    assert done == sorted(done) and done[-1] == 6 and events[-1]["usage"]["completion_tokens"] == 6
    chat = sse_events(server, "/v1/chat/completions", {"messages": chat_messages("hi"), "max_tokens": 3,
                                                       "temperature": 0.0, "ignore_eos": True,
                                                       "stream_options": body["stream_options"]})
    assert all(e["usage"] is not None for e in chat) and chat[-2]["usage"]["completion_tokens"] == 3


# vLLM's tests/entrypoints/openai/test_metrics.py: EXPECTED_METRICS_V1 less the hidden, deprecated ones
VLLM_METRIC_NAMES = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
    "prefix_cache_hits", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
    "iteration_tokens_total", "cache_config_info", "request_success_total",
    *(f"{h}_{s}" for h in ("request_prompt_tokens", "request_generation_tokens", "request_params_n",
                           "request_params_max_tokens", "time_to_first_token_seconds", "inter_token_latency_seconds",
                           "e2e_request_latency_seconds", "request_queue_time_seconds",
                           "request_inference_time_seconds", "request_prefill_time_seconds",
                           "request_decode_time_seconds")
      for s in ("sum", "bucket", "count")),
]


def test_metrics_have_vllms_names_and_meanings(client, server, lively_hf_tokenizer):
    # different prompts, shorter than a block: the prefix cache serves none of their tokens
    prompts = [lively_hf_tokenizer(f"{PROMPTS[7]} {i}")["input_ids"] for i in range(3)]
    wait_until(lambda: idle(server.url), what="an idle server")
    before = scrape(server.url)
    for prompt in prompts:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, **greedy())
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for name in VLLM_METRIC_NAMES:
        assert f"compiled_llm:{name}" in text, name
    after = scrape(server.url)

    def grew(name: str) -> float:
        return after[f"compiled_llm:{name}"] - before.get(f"compiled_llm:{name}", 0.0)

    # vLLM's test_metrics_counts: three requests of len(prompt) tokens and 5 generated, one at a time
    prompt_tokens = sum(map(len, prompts))
    assert grew("request_prompt_tokens_sum") == prompt_tokens and grew("request_prompt_tokens_count") == 3
    assert grew("request_generation_tokens_sum") == 3 * 5 and grew("request_generation_tokens_count") == 3
    assert grew("request_params_n_count") == 3 and grew("request_params_max_tokens_sum") == 3 * 5
    assert grew("inter_token_latency_seconds_count") == 3 * 4 and grew("time_per_output_token_seconds_count") == 3 * 4
    assert grew("iteration_tokens_total_sum") == prompt_tokens + 3 * 5 and grew("iteration_tokens_total_count") == 3 * 5
    for name in ("request_inference_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert grew(f"{name}_count") == 3, name
    assert grew("request_decode_time_seconds_sum") <= grew("request_inference_time_seconds_sum")


# ---- admission control and SIGTERM (the one-sequence server) ------------------------------------------------


def test_past_the_waiting_limit_requests_get_503_with_retry_after(small_server):
    with urllib.request.urlopen(small_server.url + "/openapi.json", timeout=10) as r:
        openapi = json.loads(r.read())
    results, refusals = [], []

    def call(i: int):
        body = json.dumps({"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 48, "temperature": 0.0,
                           "ignore_eos": True}).encode()
        request = urllib.request.Request(small_server.api_url + "/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                results.append((r.status, None, json.loads(r.read())))
        except urllib.error.HTTPError as e:
            body = e.read()
            refusals.append((e.code, e.headers["Content-Type"], body))
            results.append((e.code, e.headers.get("Retry-After"), json.loads(body)))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [r for r in results if r[0] == 503]
    served = [r for r in results if r[0] == 200]
    assert len(refused) + len(served) == 8
    assert refused and served  # the first is always taken; at most one waits behind the running one
    for _, retry_after, body in refused:
        assert int(retry_after) >= 1 and "busy" in body["error"]["message"]
    for status, content_type, body in refusals:
        assert_listed(openapi, "POST", "/v1/completions", status, content_type, body)
    for _, _, body in served:
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 48
    wait_until(lambda: idle(small_server.url), what="an idle engine")


def test_sigterm_lets_the_running_request_finish_and_exits_0(small_server, lively_hf_tokenizer, lively_oracle):
    client = openai.OpenAI(base_url=small_server.api_url, api_key="unused", max_retries=0)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[7], max_tokens=400, stream=True, **greedy())
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    children = child_pids(small_server.process.pid)  # the engine process, multiprocessing's helper
    assert any("spawn_main" in open(f"/proc/{c}/cmdline").read() for c in children)
    small_server.process.send_signal(signal.SIGTERM)
    # draining: new requests are refused while the running one goes on
    wait_until(lambda: http_status(small_server.url + "/health") in (503, None), what="the drain")
    with pytest.raises((openai.APIStatusError, openai.APIConnectionError)) as e:
        client.completions.create(model=MODEL, prompt="late", max_tokens=2)
    assert getattr(e.value, "status_code", 503) == 503
    last = None
    for chunk in chunks:
        text += chunk.choices[0].text
        last = chunk
    assert last.choices[0].finish_reason == "length"
    assert text == lively_oracle(lively_hf_tokenizer(PROMPTS[7])["input_ids"], 400)[1]
    assert small_server.process.wait(60) == 0
    wait_until(lambda: not any(map(process_exists, children)), timeout=10, what="the server's children to end")
    assert "Traceback" not in small_server.log()


# ---- the async front end, without HTTP ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(lively_bpe_engine):
    from compiled_llm.serve.llm import LLM

    return LLM(str(lively_bpe_engine), device="cpu").engine


def requests_of(engine, prompts, max_tokens: int, **params):
    from compiled_llm.serve.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)
    return [engine.validate(p, sp) for p in prompts]


def all_blocks_free(engine) -> bool:
    return engine.block_manager.num_free_blocks == engine.num_blocks and not engine.has_unfinished_requests()


async def wait_for(check, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_the_models_root_is_the_model_as_given_not_its_engine(engine):
    # `serve tiny-qwen2` builds the preset into the engine cache: its card's root is still
    # "tiny-qwen2", as vLLM's is the --model given
    from fastapi.testclient import TestClient

    from compiled_llm.serve.engine_process.engine_core_client import EngineCoreClient
    from compiled_llm.serve.openai.api_server import build_app
    from compiled_llm.serve.server_config import ServerConfig

    app = build_app(EngineCoreClient.in_thread(engine), ServerConfig(served_model_name=MODEL), model_name="tiny-qwen2")
    (card,) = TestClient(app).get("/v1/models").json()["data"]  # no lifespan: the engine does not run
    assert (card["id"], card["root"]) == (MODEL, "tiny-qwen2")


def test_streamed_deltas_add_up_to_the_final_output(engine):
    from compiled_llm.serve.engine_process.async_engine import AsyncEngine

    async def main():
        front = AsyncEngine.in_thread(engine)
        front.start()
        try:
            # each call released once read, as the server does: stop() would otherwise give the
            # unreleased one 5 s to be let go before it stops the engine
            group = front.submit(requests_of(engine, PROMPTS[:3], 20))
            final = await group.results()
            group.release()
            stream = front.submit(requests_of(engine, PROMPTS[:3], 20), stream=True)
            texts, ids, finished = ["", "", ""], [[], [], []], [None] * 3
            async for ready in stream:
                for i, out in ready:
                    texts[i] += out.outputs[0].delta_text
                    ids[i] += out.outputs[0].delta_token_ids
                    finished[i] = out.outputs[0].finish_reason
            stream.release()
            return final, texts, ids, finished
        finally:
            await front.stop()

    final, texts, ids, finished = asyncio.run(main())
    assert [o.outputs[0].text for o in final] == texts
    assert [o.outputs[0].token_ids for o in final] == ids and all(len(i) == 20 for i in ids)
    assert finished == ["length"] * 3
    assert all_blocks_free(engine)


def test_a_busy_event_loop_gets_the_steps_it_missed_as_one_output(engine):
    from compiled_llm.serve.engine_process.async_engine import AsyncEngine

    async def main():
        front = AsyncEngine.in_thread(engine)
        front.start()
        try:
            group = front.submit(requests_of(engine, [PROMPTS[0]], 30), stream=True)
            first = await group.next_outputs()
            time.sleep(0.5)  # the event loop is blocked while the engine steps on
            merged = await group.next_outputs()
            rest = [out async for ready in group for _, out in ready]
            group.release()
            return first, merged, rest
        finally:
            await front.stop()

    first, merged, rest = asyncio.run(main())
    out = merged[0][1].outputs[0]
    assert len(out.delta_token_ids) > 1
    # the merged delta is exactly what the steps it covers added
    before = len(first[0][1].outputs[0].delta_token_ids)
    assert out.token_ids[before:before + len(out.delta_token_ids)] == out.delta_token_ids
    everything = first + merged + [(0, o) for o in rest]
    assert sum(len(o.outputs[0].delta_token_ids) for _, o in everything) == 30


def test_admission_counts_requests_not_yet_scheduled(engine):
    from compiled_llm.errors import InvalidRequestError
    from compiled_llm.serve.engine_process.async_engine import AsyncEngine, ServiceUnavailableError

    async def main():
        front = AsyncEngine.in_thread(engine, max_waiting_requests=2, max_waiting_prompt_tokens=64)
        # not started: nothing is scheduled, so the accepted requests keep waiting
        groups = [front.submit(requests_of(engine, [p], 4)) for p in PROMPTS[:2]]
        assert front.num_unscheduled[0] == 2
        with pytest.raises(ServiceUnavailableError, match="busy"):
            front.submit(requests_of(engine, [PROMPTS[2]], 4))
        with pytest.raises(InvalidRequestError, match="waiting prompt tokens"):
            front.submit(requests_of(engine, [list(range(1, 70))], 4))  # could never be admitted
        front.start()
        try:
            results = [await g.results() for g in groups]
            for g in groups:
                g.release()
            assert front.num_unscheduled == (0, 0)
            group = front.submit(requests_of(engine, [PROMPTS[2]], 4))
            later = await group.results()
            group.release()  # read: released, so stop() need not wait 5 s for it
            return results, later
        finally:
            await front.stop()

    results, later = asyncio.run(main())
    assert [len(r[0].outputs[0].token_ids) for r in results + [later]] == [4, 4, 4]
    assert all_blocks_free(engine)


def test_a_request_past_its_timeout_is_aborted_and_frees_its_blocks(engine):
    from compiled_llm.serve.engine_process.async_engine import AsyncEngine

    async def main():
        front = AsyncEngine.in_thread(engine, request_timeout=0.2)
        front.start()
        try:
            group = front.submit(requests_of(engine, [PROMPTS[1]], 480), stream=True)
            outputs = [out async for ready in group for _, out in ready]
            group.release()
            await wait_for(lambda: all_blocks_free(engine))
            return group, outputs
        finally:
            await front.stop()

    group, outputs = asyncio.run(main())
    assert group.abort_reason == "timeout"
    assert outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs[-1].outputs[0].token_ids) < 480


def test_release_mid_stream_aborts_at_once(engine):
    from compiled_llm.serve.engine_process.async_engine import AsyncEngine

    async def main():
        front = AsyncEngine.in_thread(engine)
        front.start()
        try:
            group = front.submit(requests_of(engine, [PROMPTS[2]], 480), stream=True)
            await group.next_outputs()
            group.release()
            await wait_for(lambda: all_blocks_free(engine), timeout=2.0)
            return engine.stats.generated_tokens
        finally:
            await front.stop()

    generated_before = engine.stats.generated_tokens
    assert asyncio.run(main()) - generated_before < 480


def test_drain_refuses_new_calls_and_aborts_what_outlives_the_grace(engine):
    from compiled_llm.serve.engine_process.async_engine import AsyncEngine, ServiceUnavailableError

    async def main():
        front = AsyncEngine.in_thread(engine)
        front.start()
        quick = front.submit(requests_of(engine, [PROMPTS[3]], 4))
        slow = front.submit(requests_of(engine, [PROMPTS[4]], 480))
        reader = asyncio.ensure_future(asyncio.gather(quick.results(), slow.results()))
        await asyncio.sleep(0.05)
        drained = asyncio.ensure_future(front.drain(grace=0.3))
        await asyncio.sleep(0)
        with pytest.raises(ServiceUnavailableError, match="shutting down"):
            front.submit(requests_of(engine, [PROMPTS[5]], 4))
        (quick_out,), (slow_out,) = await reader
        quick.release()
        slow.release()
        await drained
        return quick_out, slow_out, slow.abort_reason, front.core.alive

    quick_out, slow_out, reason, alive = asyncio.run(main())
    assert quick_out.outputs[0].finish_reason == "length"
    assert slow_out.outputs[0].finish_reason == "abort" and reason == "shutdown"
    assert not alive
    assert all_blocks_free(engine)


def test_metrics_count_the_engine_and_log_a_stats_line_while_busy(engine, caplog):
    import logging

    from compiled_llm.serve.engine_process.async_engine import AsyncEngine
    from compiled_llm.serve.engine_process.engine_messages import EngineSnapshot
    from compiled_llm.serve.metrics import ServerMetrics

    caplog.set_level(logging.INFO, logger="compiled_llm.serve.metrics")
    metrics = ServerMetrics("m", EngineSnapshot.of(engine), log_stats_interval=0.05)
    generated_before = engine.stats.generated_tokens

    async def main():
        front = AsyncEngine.in_thread(engine, metrics=metrics)
        front.start()
        try:
            group = front.submit(requests_of(engine, PROMPTS[:2], 60))
            outs = await group.results()
            group.release()  # read: released, so stop() need not wait 5 s for it
            await asyncio.sleep(0.2)  # the idle thread still logs the busy interval's line
            return outs
        finally:
            await front.stop()

    asyncio.run(main())
    value = metrics.registry.get_sample_value
    labels = {"model_name": "m"}
    engine_0 = {**labels, "engine": "0"}  # the engine's own series carry vLLM's engine label
    assert value("compiled_llm:generation_tokens_total", engine_0) == engine.stats.generated_tokens - generated_before
    assert value("compiled_llm:request_success_total", {**labels, "finished_reason": "length"}) == 2
    assert value("compiled_llm:e2e_request_latency_seconds_count", labels) == 2
    assert value("compiled_llm:num_requests_running", engine_0) == 0
    assert value("compiled_llm:spec_decode_num_drafts_total", engine_0) is None  # no speculation, no counters
    lines = [r.getMessage() for r in caplog.records if r.name == "compiled_llm.serve.metrics"]
    assert any("Avg generation throughput" in line and "KV cache usage" in line for line in lines)


# ---- the HTTP surface, over the app in this process (starlette's TestClient) ---------------------------------


def app_client(engine, **config):
    """A TestClient over ``build_app`` with ``engine`` stepped by a thread; enter it to start."""
    from starlette.testclient import TestClient

    from compiled_llm.serve.engine_process.engine_core_client import EngineCoreClient
    from compiled_llm.serve.openai.api_server import build_app
    from compiled_llm.serve.server_config import ServerConfig

    app = build_app(EngineCoreClient.in_thread(engine), ServerConfig(**config), model_name=MODEL)
    return TestClient(app, raise_server_exceptions=False)


KEY = {"Authorization": f"Bearer {API_KEY}"}


def assert_documented(openapi: dict, method: str, path: str, response) -> None:
    """``response`` (an httpx response) is one /openapi.json lists for ``method path``."""
    assert_listed(openapi, method, path, response.status_code, response.headers.get("content-type", ""), response.content)


def assert_listed(openapi: dict, method: str, path: str, status: int, content_type: str, body: bytes) -> None:
    """A response of ``status`` with ``content_type`` and ``body`` is one /openapi.json lists for
    ``method path``: the status, and the content type (none for a response declared without a body)."""
    responses = openapi["paths"][path][method.lower()]["responses"]
    assert str(status) in responses, f"{method} {path} sent {status}, but /openapi.json lists only {sorted(responses)}"
    declared = {t.split(";")[0].strip() for t in responses[str(status)].get("content", {})}
    sent = content_type.split(";")[0].strip()
    if declared:
        assert sent in declared, f"{method} {path} {status} sent {sent!r}, /openapi.json declares {declared}"
    else:
        assert body == b"", f"{method} {path} {status} declares no body but sent {body[:80]!r}"


# (method, path, headers, body (JSON, or raw bytes), the status the server sends)
SURFACE = [
    ("POST", "/v1/completions", {}, b"{not json", 401),  # the key is checked before the body
    ("POST", "/v1/completions", {}, {"prompt": "hi", "max_tokens": "many"}, 401),
    ("POST", "/v1/completions", KEY, b"{not json", 400),
    ("POST", "/v1/completions", KEY, {"prompt": "hi", "max_tokens": "many"}, 400),
    ("POST", "/v1/completions", KEY, {"model": "no-such-model", "prompt": "hi"}, 404),
    ("POST", "/v1/completions", KEY, {"model": MODEL, "prompt": "hi", "max_tokens": 2}, 200),
    ("POST", "/v1/completions", KEY, {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}, 200),
    ("POST", "/v1/chat/completions", {}, {"messages": "not a list"}, 401),
    ("POST", "/v1/chat/completions", KEY, {"messages": "not a list"}, 400),
    ("POST", "/v1/chat/completions", KEY, {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("POST", "/v1/chat/completions", KEY, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, 200),
    ("GET", "/v1/models", {}, None, 401),
    ("GET", "/v1/models", KEY, None, 200),
    ("POST", "/tokenize", {}, {"prompt": "hi"}, 401),
    ("POST", "/tokenize", KEY, {"prompt": 5}, 400),
    ("POST", "/tokenize", KEY, {"model": "no-such-model", "prompt": "hi"}, 404),
    ("POST", "/tokenize", KEY, {"prompt": "hi"}, 200),
    ("POST", "/detokenize", {}, {"tokens": [1, 2]}, 401),
    ("POST", "/detokenize", KEY, {"tokens": [-1]}, 400),
    ("POST", "/detokenize", KEY, {"tokens": [1, 2]}, 200),
    ("GET", "/tokenizer_info", {}, None, 401),
    ("GET", "/tokenizer_info", KEY, None, 200),
    ("GET", "/health", {}, None, 200),
    ("GET", "/metrics", {}, None, 200),
    ("GET", "/version", {}, None, 200),
]


@pytest.mark.parametrize("method, path, headers, body, status", SURFACE,
                         ids=[f"{m} {p} {'key' if h else 'keyless'} {s}" for m, p, h, _, s in SURFACE])
def test_each_response_is_one_the_openapi_document_lists(engine, method, path, headers, body, status):
    options = {"enable_tokenizer_info_endpoint": True} if path == "/tokenizer_info" else {}
    with app_client(engine, api_key=API_KEY, **options) as c:
        openapi = c.get("/openapi.json").json()
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
        response = c.request(method, path, headers={"Content-Type": "application/json", **headers}, **kwargs)
    assert response.status_code == status, response.text
    assert_documented(openapi, method, path, response)
    if status >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_the_openapi_document_lists_no_422_and_asks_for_the_key_where_it_is_needed(engine):
    with app_client(engine, api_key=API_KEY) as c:
        openapi = c.get("/openapi.json").json()
    operations = [(path, op) for path, item in openapi["paths"].items() for op in item.values()]
    assert all("422" not in op["responses"] for _, op in operations)
    assert "HTTPValidationError" not in openapi["components"]["schemas"]
    open_ = {path for path, op in operations if "security" not in op}
    assert open_ == {"/health", "/metrics", "/version"}
    assert openapi["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    stream = openapi["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(stream) == {"application/json", "text/event-stream"}


def test_a_server_that_is_shutting_down_answers_503_as_documented(engine):
    with app_client(engine) as c:
        openapi = c.get("/openapi.json").json()
        c.app.state.server.async_engine.accepting = False  # what SIGTERM's drain sets
        health = c.get("/health")
        completion = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    for path, response in (("/health", health), ("/v1/completions", completion), ("/v1/chat/completions", chat)):
        assert response.status_code == 503
        assert_documented(openapi, "GET" if path == "/health" else "POST", path, response)
    assert int(completion.headers["Retry-After"]) >= 1


def test_a_method_a_route_does_not_take_is_405_with_allow(engine):
    with app_client(engine) as c:
        response = c.delete("/health")
        post_only = c.get("/v1/completions")
    assert response.status_code == 405 and response.headers["Allow"] == "GET"
    assert post_only.status_code == 405 and post_only.headers["Allow"] == "POST"


def test_health_is_200_with_an_empty_body_as_vllm(engine):
    with app_client(engine) as c:
        response = c.get("/health")
    assert response.status_code == 200 and response.content == b""


def test_version_names_the_package_version(engine):
    import importlib.metadata

    with app_client(engine) as c:
        assert c.get("/version").json() == {"version": importlib.metadata.version("compiled_llm")}


def test_tokenizer_info_gives_the_tokenizers_class_tokens_and_chat_template(engine, lively_hf_tokenizer):
    with app_client(engine, enable_tokenizer_info_endpoint=True) as c:
        info = c.get("/tokenizer_info").json()
    with app_client(engine) as c:
        assert c.get("/tokenizer_info").status_code == 404  # off by default, as vLLM's
    assert info["tokenizer_class"]
    assert info["eos_token"] == lively_hf_tokenizer.eos_token
    assert info["chat_template"] == lively_hf_tokenizer.chat_template


def test_x_request_id_is_sent_back_and_names_the_completion(engine):
    with app_client(engine) as c:
        completion = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"X-Request-Id": "trace-17"})
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                      headers={"X-Request-Id": "trace-18"})
        plain = c.get("/v1/models")
    assert completion.headers["X-Request-Id"] == "trace-17" and completion.json()["id"] == "cmpl-trace-17"
    assert chat.headers["X-Request-Id"] == "trace-18" and chat.json()["id"] == "chatcmpl-trace-18"
    assert "X-Request-Id" not in plain.headers  # only with --enable-request-id-headers
    with app_client(engine, enable_request_id_headers=True) as c:
        made = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert made.json()["id"] == "cmpl-" + made.headers["X-Request-Id"]


def test_root_path_routes_requests_with_or_without_the_proxys_prefix(engine):
    with app_client(engine, root_path="/llm", api_key=API_KEY) as c:
        assert c.get("/v1/models", headers=KEY).status_code == 200
        assert c.get("/llm/v1/models", headers=KEY).status_code == 200
        assert c.get("/llm/v1/models").status_code == 401
        assert c.get("/llm/health").status_code == 200
        assert c.get("/openapi.json").json()["servers"] == [{"url": "/llm"}]


@pytest.mark.parametrize("root_path", ["llm", "/llm/", "/"])
def test_a_root_path_is_a_prefix_that_starts_with_a_slash(root_path):
    from compiled_llm.errors import InvalidOptionError
    from compiled_llm.serve.server_config import ServerConfig

    with pytest.raises(InvalidOptionError, match="root_path must start with '/'"):
        ServerConfig(root_path=root_path)
