"""`compiled-llm serve --data-parallel-size 2` on a CPU: two engine processes behind one endpoint,
checked with the official openai client against transformers' greedy outputs (the lively
checkpoint), their metrics labelled by replica, and one replica killed mid-load.

One server for the module, four sequences per replica at a time (so that a replica under load
runs some requests and holds others waiting). The last test kills one of its replicas and then
stops it: it runs last.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request

import openai
import pytest

from helpers import replica_requests
from helpers.replica_requests import GREEDY, answer_concurrently, generated_by_engine
from helpers.server_fixtures import child_pids, engine_pids, process_exists, scrape, serve_process, wait_until

MODEL = "lively"
MAX_NUM_SEQS = 4
PROMPTS = ["The quick brown fox", "A compiler lowers", "Once upon a time", "Paged attention keeps", "hello world",
           "continuous batching of requests", "in the beginning", "tokens per second"]


@pytest.fixture(scope="module")
def server(lively_bpe_engine, tmp_path_factory):
    log = tmp_path_factory.mktemp("dp_server") / "serve.log"
    with serve_process(lively_bpe_engine, "--data-parallel-size", "2", "--served-model-name", MODEL,
                       "--max-num-seqs", str(MAX_NUM_SEQS), log_path=log) as s:
        yield s


def expected_text(lively_oracle, lively_hf_tokenizer, prompt: str, max_tokens: int) -> str:
    return lively_oracle(lively_hf_tokenizer(prompt)["input_ids"], max_tokens)[1]


def health(url: str) -> tuple[int, dict]:
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        return r.status, json.loads(r.read())


def test_two_replicas_start_and_health_reports_both_live_as_documented(server):
    assert len(engine_pids(server.process.pid)) == 2
    assert health(server.url) == (200, {"data_parallel_size": 2, "live_replicas": 2, "dead_replicas": []})
    with urllib.request.urlopen(server.url + "/openapi.json", timeout=10) as r:
        documented = json.loads(r.read())["paths"]["/health"]["get"]["responses"]["200"]["content"]
    assert list(documented) == ["application/json"]


def test_a_replica_that_cannot_load_stops_the_others_and_names_itself(lively_bpe_engine, tmp_path):
    import functools
    import multiprocessing

    from compiled_llm.cli.main import make_parser
    from compiled_llm.cli.serve import load_engine
    from compiled_llm.errors import CompiledLLMError
    from compiled_llm.serve.engine_process.dp_client import DataParallelClient

    def loader(source):
        return functools.partial(load_engine, make_parser().parse_args(["serve", str(source), "--device", "cpu"]))

    missing = tmp_path / "not-an-engine"
    missing.mkdir()
    before = set(multiprocessing.active_children())
    with pytest.raises(CompiledLLMError, match="data-parallel replica 1 of 2: the engine could not start: .*not-an-engine"):
        DataParallelClient.start_processes([loader(lively_bpe_engine), loader(missing)])
    assert set(multiprocessing.active_children()) <= before  # the replica that loaded was stopped


def test_32_concurrent_requests_equal_transformers_greedy_and_both_replicas_serve(server, lively_hf_tokenizer,
                                                                                  lively_oracle):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]
    max_tokens = [16 + i % 8 for i in range(32)]
    expected = [expected_text(lively_oracle, lively_hf_tokenizer, p, n) for p, n in zip(prompts, max_tokens)]
    before = scrape(server.url, by_engine=True)
    assert answer_concurrently(server.api_url, MODEL, prompts, max_tokens) == expected
    generated = generated_by_engine(before, scrape(server.url, by_engine=True))
    assert sum(generated) == sum(max_tokens)
    assert min(generated) >= sum(max_tokens) / 4  # both replicas took a fair share (least loaded, no shared prefix)


def test_killing_a_replica_mid_load_fails_its_running_requests_restarts_its_waiting_ones_and_the_other_serves_on(
        server, lively_hf_tokenizer, lively_oracle):
    pids = engine_pids(server.process.pid)
    everything = child_pids(server.process.pid)  # the engines and multiprocessing's resource tracker
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} again {i}" for i in range(4 * MAX_NUM_SEQS)]
    max_tokens = 100

    def one(aclient, prompt: str):
        return replica_requests.stream_outcome(aclient, MODEL, prompt, max_tokens)

    def both_full() -> dict | None:
        """/metrics once each replica runs all it may and holds some waiting."""
        m = scrape(server.url, by_engine=True)
        full = all(m[f"compiled_llm:num_requests_running{{engine={i}}}"] == MAX_NUM_SEQS
                   and m[f"compiled_llm:num_requests_waiting{{engine={i}}}"] >= 1 for i in (0, 1))
        return m if full else None

    async def main():
        async with openai.AsyncOpenAI(base_url=server.api_url, api_key="x", max_retries=0) as aclient:
            calls = [asyncio.ensure_future(one(aclient, p)) for p in prompts]
            gauges = await asyncio.to_thread(wait_until, both_full, 60.0, "both replicas running and queueing")
            os.kill(pids[0], signal.SIGKILL)
            return time.monotonic(), gauges, await asyncio.gather(*calls)

    killed_at, gauges, results = asyncio.run(main())
    status, body = health(server.url)
    assert status == 200 and body["live_replicas"] == 1 and len(body["dead_replicas"]) == 1
    (dead,) = body["dead_replicas"]
    errors = [(message, at) for kind, message, at in results if kind == "error"]
    # its running requests had streamed tokens: they end, with an error naming the replica (one
    # of them may have finished between the scrape and the kill, and a waiting one taken its
    # place and streamed too: the count is the running gauge's, give or take that)
    assert gauges[f"compiled_llm:num_requests_running{{engine={dead}}}"] == MAX_NUM_SEQS
    assert 1 <= len(errors) <= MAX_NUM_SEQS + 1
    assert all(f"data-parallel replica {dead} stopped" in m and at - killed_at < 30 for m, at in errors)
    # its waiting ones had streamed nothing: they ran on the other replica, as did that one's own
    for (kind, text, _), prompt in zip(results, prompts):
        if kind == "ok":
            assert text == expected_text(lively_oracle, lively_hf_tokenizer, prompt, max_tokens)

    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
    for prompt in PROMPTS[:3]:  # later requests go to the live replica
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
        assert out.choices[0].text == expected_text(lively_oracle, lively_hf_tokenizer, prompt, 12)

    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) == 0  # one replica left was still a server
    # multiprocessing's resource tracker ends when it reads its pipe's end, just after the server
    wait_until(lambda: not [pid for pid in everything if process_exists(pid)], 10.0, "the server's children to end")
    log = server.log()
    assert f"data-parallel replica {dead}: the engine process exited (exit code {-signal.SIGKILL})" in log
    assert "Traceback" not in log
