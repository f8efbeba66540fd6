"""The Ray Serve application (``compiled_llm.serve.ray_serve.app``) on the local Ray cluster the
Ray test modules share, one application of two engine replicas for the module, spoken to by the
real ``openai`` client.

- Two replicas answer completions (token ids and text, streamed or not) and chats with
  transformers' greedy tokens; other routes (``/v1/models``) are the server's own.
- Requests that share a prompt prefix go to the replica that was sent it; prompts with nothing
  in common spread over both.
- Killing one replica under load ends or retries each of its requests within 30 s (a retried
  one answers correctly), and the other replica keeps serving.
- Bad options (replicas and autoscaling bounds both, an unknown engine option) are refused before
  any replica starts; ``serve run``'s ``key=value`` strings become typed options.
- Shutting Serve down leaves no replica, controller or proxy actor behind, nor their processes.
"""

from __future__ import annotations

import concurrent.futures
import socket
import time

import pytest

ray = pytest.importorskip("ray")

import openai  # noqa: E402
import transformers  # noqa: E402
from helpers.lively import greedy_continuation  # noqa: E402
from helpers.ray_cluster import alive_actors, process_gone  # noqa: E402
from ray import serve  # noqa: E402
from ray.util.state import list_actors  # noqa: E402

from compiled_llm.errors import InvalidOptionError  # noqa: E402
from compiled_llm.serve.ray_serve.app import (ENGINE_DEPLOYMENT, REPLICA_HEADER, RayServeConfig,  # noqa: E402
                                              build_app)

APP = "llm"
REPLICA_ACTOR = f"ServeReplica:{APP}:{ENGINE_DEPLOYMENT}"
MAX_TOKENS = 8
# three full blocks of 16 tokens that several prompts share
SHARED = [(7 * i + 3) % 140 + 1 for i in range(48)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(lively_bpe_checkpoint):
    path, hf = lively_bpe_checkpoint
    return path, hf, transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def server(ray_cluster, lively_bpe_engine):
    """The application's base URL (two replicas); Serve is shut down by the last test."""
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = RayServeConfig(model=str(lively_bpe_engine), num_replicas=2, replica_num_cpus=1,
                            engine_options={"device": "cpu", "max_num_seqs": 16})
    serve.run(build_app(config), name=APP, route_prefix="/")
    yield f"http://127.0.0.1:{port}", str(lively_bpe_engine)
    serve.shutdown()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=60)


def greedy(hf, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
    return list(greedy_continuation(hf, prompt, n).token_ids)


def complete(server, prompt, max_tokens: int = MAX_TOKENS):
    """(token ids, the replica that answered) of a greedy completion."""
    raw = client(server).completions.with_raw_response.create(
        model=server[1], prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    return raw.parse().choices[0].token_ids, raw.headers[REPLICA_HEADER]


def test_two_replicas_answer_openai_requests_with_transformers_greedy_tokens(server, checkpoint):
    _, hf, tok = checkpoint
    status = serve.status().applications[APP].deployments[ENGINE_DEPLOYMENT]
    assert status.replica_states == {"RUNNING": 2}
    c = client(server)
    replicas = set()
    for prompt in ([5, 17, 33], [100, 2, 9, 41, 7, 7, 12, 60], list(range(20, 42))):
        ids, replica = complete(server, prompt)
        assert ids == greedy(hf, prompt)
        replicas.add(replica)
    assert len(replicas) == 2  # unrelated prompts spread over both
    text = "the quick brown fox"
    ids, _ = complete(server, text)
    assert ids == greedy(hf, tok(text)["input_ids"])
    streamed = c.completions.create(model=server[1], prompt=text, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == \
        c.completions.create(model=server[1], prompt=text, max_tokens=MAX_TOKENS, temperature=0,
                             extra_body={"ignore_eos": True}).choices[0].text
    messages = [{"role": "user", "content": "hello there"}]
    chat = c.chat.completions.create(model=server[1], messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat.choices[0].token_ids == greedy(hf, list(prompt_ids))
    assert [m.id for m in c.models.list().data] == [server[1]]


def test_requests_sharing_a_prefix_go_to_the_replica_that_was_sent_it(server, checkpoint):
    _, first = complete(server, SHARED + [9], max_tokens=1)
    for tail in ([1], [2, 3], [4, 5, 6], [77]):
        assert complete(server, SHARED + tail, max_tokens=1)[1] == first
    # a new prefix goes to the least loaded replica and, all idle, to the one sent fewer prompts:
    # the other one, which the shared prefix's five left four or more behind
    others = {complete(server, [(11 * i + j) % 140 + 1 for i in range(32)], max_tokens=1)[1] for j in range(3)}
    assert len(others) == 1 and first not in others


def test_killing_one_replica_under_load_ends_or_retries_its_requests_within_30_s_and_the_other_serves(
        server, checkpoint):
    """Streams show which replica serves them as soon as they start (the replica header): the
    one killed is serving some. Its streams end with an error event; its other requests, whose
    responses had not started, are retried on the other replica and answer correctly."""
    _, hf, _ = checkpoint
    prompts = [[(5 * i + j) % 140 + 1 for i in range(6 + j)] for j in range(8)]
    long = 400
    c = client(server)
    started: dict[int, str] = {}  # stream number -> its replica

    def stream(j):
        t0 = time.monotonic()
        try:
            with c.completions.with_streaming_response.create(
                    model=server[1], prompt=prompts[j], max_tokens=long, temperature=0, stream=True,
                    extra_body={"ignore_eos": True}) as response:
                started[j] = response.headers[REPLICA_HEADER]
                chunks = [chunk for chunk in response.parse() if chunk.choices]
                return "ok", chunks[-1].choices[0].finish_reason, started[j], time.monotonic() - t0
        except openai.APIError as e:
            return "error", str(e), started.get(j), time.monotonic() - t0

    def request(j):
        t0 = time.monotonic()
        try:
            ids, replica = complete(server, prompts[j], max_tokens=long)
            return "ok", ids, replica, time.monotonic() - t0
        except openai.APIError as e:
            return "error", str(e), None, time.monotonic() - t0

    pool = concurrent.futures.ThreadPoolExecutor(len(prompts))
    try:
        futures = [pool.submit(stream if j % 2 else request, j) for j in range(len(prompts))]
        deadline = time.monotonic() + 30
        while len(started) < 4 or len(set(started.values())) < 2:  # streams running on both replicas
            assert time.monotonic() < deadline and not any(f.done() for f in futures), started
            time.sleep(0.05)
        victim = started[1]
        (actor,) = [a for a in alive_actors(REPLICA_ACTOR) if a.name.endswith("#" + victim)]
        ray.kill(ray.get_actor(actor.name, namespace="serve"), no_restart=True)
        killed = time.monotonic()
        assert not any(f.done() for f in futures), "the load ended before the kill: the test would prove nothing"
        done, late = concurrent.futures.wait(futures, timeout=30)
        assert not late, "requests still running 30 s after their replica was killed"
        assert time.monotonic() - killed < 30
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    results = [f.result() for f in futures]
    for j, (outcome, value, replica, _) in enumerate(results):
        if j % 2 and replica == victim:  # a stream of the killed replica: an error event ends it
            assert outcome == "error" and "the engine replica serving this request failed" in value, value
        elif j % 2:
            assert (outcome, value) == ("ok", "length")
        elif outcome == "ok":  # served by the other replica, first or on the retry: the right tokens
            assert replica != victim and value == greedy(hf, prompts[j], long)
        else:
            assert "the engine replica serving this request failed" in value and "\n" not in value
    # the other replica keeps serving (Serve also starts a replacement for the killed one)
    for prompt in prompts[:3]:
        ids, replica = complete(server, prompt)
        assert ids == greedy(hf, prompt)


def test_options_are_checked_before_any_replica_starts():
    with pytest.raises(InvalidOptionError, match="either num_replicas or min_replicas/max_replicas"):
        RayServeConfig(model="m", num_replicas=2, min_replicas=1, max_replicas=3)
    with pytest.raises(InvalidOptionError, match=r"min_replicas \(4\) is above max_replicas \(3\)"):
        RayServeConfig(model="m", min_replicas=4, max_replicas=3)
    with pytest.raises(InvalidOptionError, match="unknown engine option 'max_num_seq'"):
        RayServeConfig(model="m", engine_options={"max_num_seq": 3})
    with pytest.raises(InvalidOptionError, match="api_server_count is compiled-llm serve's"):
        RayServeConfig(model="m", server_options={"api_server_count": 2})
    with pytest.raises(InvalidOptionError, match="data_parallel_size is compiled-llm serve's"):
        RayServeConfig(model="m", engine_options={"data_parallel_size": 2})
    # `serve run ...:build_app key=value`: strings, typed by the option they name
    config = RayServeConfig.from_args({"model": "m", "min_replicas": "1", "max_replicas": "4", "max_num_seqs": "8",
                                       "enable_prefix_caching": "false", "device": "cpu", "api_key": "k"})
    assert (config.min_replicas, config.max_replicas) == (1, 4)
    assert config.engine_options == {"max_num_seqs": 8, "enable_prefix_caching": False, "device": "cpu"}
    assert config.server_options == {"api_key": "k"}
    options = config.engine_deployment_options()
    assert options["autoscaling_config"].max_replicas == 4 and "num_replicas" not in options
    assert options["request_router_config"].request_router_class.endswith("PrefixAwareRequestRouter")
    assert isinstance(build_app({"model": "m", "num_replicas": "2", "device": "cpu"}), serve.Application)


def test_shutting_serve_down_leaves_no_actor_or_process_behind(server):
    pids = [a.pid for a in list_actors(filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)]
    assert len(pids) >= 4  # Serve's controller and proxy, the ingress, the engine replicas
    serve.shutdown()
    deadline = time.monotonic() + 30
    while [a for a in list_actors(filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)]:
        assert time.monotonic() < deadline, list_actors(filters=[("state", "=", "ALIVE")])
        time.sleep(0.2)
    assert alive_actors(REPLICA_ACTOR) == []
    assert all(process_gone(pid) for pid in pids)
