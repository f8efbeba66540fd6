"""`compiled-llm serve --api-server-count 2` on a CPU: two HTTP processes on one port over the
engine process, checked with the official openai client against transformers' greedy outputs
(the lively checkpoint). Which API server took a connection is read from /proc (the process
that holds its socket). (Two API servers over two data-parallel replicas, in threads:
tests/serve/engine_process/test_engine_process.py.)

One server for the module; the last test kills one of its API servers, which stops it.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import re
import signal
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from compiled_llm.cli.main import LOGGING_LEVEL_VAR, main
from helpers.server_fixtures import (api_server_pids, child_pids, connections_by_pid, engine_pids, process_exists,
                                     serve_process, wait_until)

MODEL = "lively"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}  # every request runs to max_tokens
PROMPTS = ["The quick brown fox", "A compiler lowers", "Once upon a time", "Paged attention keeps", "hello world",
           "continuous batching of requests", "in the beginning", "tokens per second"]


@pytest.fixture(scope="module")
def server(lively_bpe_engine, tmp_path_factory):
    log = tmp_path_factory.mktemp("api_servers") / "serve.log"
    with serve_process(lively_bpe_engine, "--api-server-count", "2", "--served-model-name", MODEL, "--max-num-seqs", "4",
                       log_path=log) as s:
        # /health answers once the first API server is up; the log line once both are
        wait_until(lambda: "2 API server processes" in s.log(), 60.0, "both API servers ready")
        yield s


def port_of(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def expected_text(lively_oracle, lively_hf_tokenizer, prompt: str, max_tokens: int) -> str:
    return lively_oracle(lively_hf_tokenizer(prompt)["input_ids"], max_tokens)[1]


def metrics_text(connection: http.client.HTTPConnection) -> dict[str, float]:
    """GET /metrics over ``connection``: {sample name + labels but model_name: value}."""
    connection.request("GET", "/metrics")
    response = connection.getresponse()
    assert response.status == 200
    values = {}
    for family in text_string_to_metric_families(response.read().decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            values[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return values


def connection_to_each_api_server(server, pids: list[int]) -> dict[int, http.client.HTTPConnection]:
    """A kept-alive connection accepted by each API server (new ones until each has one)."""
    port, found = port_of(server), {}
    for _ in range(200):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("GET", "/health")  # answered: accepted by one of them
        assert connection.getresponse().read() is not None
        client_port = connection.sock.getsockname()[1]
        (pid,) = [p for p, ports in connections_by_pid(pids, port).items() if client_port in ports]
        if pid in found:
            connection.close()
        else:
            found[pid] = connection
        if len(found) == len(pids):
            return found
    raise AssertionError(f"200 connections were all accepted by {list(found)}")


def test_a_bad_api_server_count_or_a_taken_port_is_one_line_before_anything_loads(capsys, monkeypatch):
    monkeypatch.setenv(LOGGING_LEVEL_VAR, "WARNING")  # as serve would set it, for the process: left alone
    assert main(["serve", "tiny-qwen2", "--port", "0", "--api-server-count", "0"]) == 2
    err = capsys.readouterr().err
    assert "api_server_count must be an integer >= 1, got 0" in err and err.count("\n") == 1

    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "tiny-qwen2", "--port", str(port), "--api-server-count", "2"]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in err and err.count("\n") == 1


def test_requests_over_many_connections_equal_transformers_greedy_and_both_api_servers_take_some(
        server, lively_hf_tokenizer, lively_oracle):
    pids = api_server_pids(server.process.pid)
    assert len(pids) == 2 and len(engine_pids(server.process.pid)) == 1
    # test_data_parallel's first 16 requests: the oracle has them already when that module ran before
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(16)]
    max_tokens = [16 + i % 8 for i in range(16)]
    expected = [expected_text(lively_oracle, lively_hf_tokenizer, p, n) for p, n in zip(prompts, max_tokens)]

    async def one(aclient, i: int) -> str:
        if i % 4 == 3:  # some not streamed
            out = await aclient.completions.create(model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i], **GREEDY)
            return out.choices[0].text
        stream = await aclient.completions.create(model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i],
                                                  stream=True, **GREEDY)
        return "".join([c.choices[0].text async for c in stream])

    seen = {pid: set() for pid in pids}  # the client ports of the connections each API server accepted

    async def watch() -> None:
        while True:
            for pid, ports in connections_by_pid(pids, port_of(server)).items():
                seen[pid].update(ports)
            await asyncio.sleep(0.05)

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.api_url, api_key="x", max_retries=0) as aclient:
            watching = asyncio.ensure_future(watch())
            try:
                return await asyncio.gather(*(one(aclient, i) for i in range(16)))
            finally:
                watching.cancel()

    assert asyncio.run(all_of_them()) == expected
    assert sum(len(ports) for ports in seen.values()) >= 8  # concurrent calls, connections of their own
    assert all(seen.values()), seen


def test_metrics_count_every_request_whichever_api_server_answers_and_each_says_healthy(server):
    pids = api_server_pids(server.process.pid)
    connections = connection_to_each_api_server(server, pids)
    before = {pid: metrics_text(c) for pid, c in connections.items()}
    assert before[pids[0]] == before[pids[1]]
    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
    for prompt in PROMPTS[:4]:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, **GREEDY)
    for pid, connection in connections.items():
        after = metrics_text(connection)
        assert after["compiled_llm:request_success_total{finished_reason=length}"] == \
            before[pid]["compiled_llm:request_success_total{finished_reason=length}"] + 4
        assert after["compiled_llm:generation_tokens_total{engine=0}"] == \
            before[pid]["compiled_llm:generation_tokens_total{engine=0}"] + 4 * 6
        connection.request("GET", "/health")
        response = connection.getresponse()
        assert (response.status, response.read()) == (200, b"")


def test_an_api_server_that_dies_stops_the_server_exit_1_and_nothing_is_left_behind(server):
    everything = child_pids(server.process.pid)  # API servers, engines, multiprocessing's tracker
    pids = api_server_pids(server.process.pid)
    # the directory of the metrics files an API server has open (prometheus_client's multiprocess mode)
    metrics_dir = next(target.parent for fd in Path(f"/proc/{pids[0]}/fd").iterdir()
                       if (target := Path(os.readlink(fd))).suffix == ".db")
    assert {f.name for f in metrics_dir.iterdir()} >= {f"counter_{pid}.db" for pid in pids}
    os.kill(pids[1], signal.SIGKILL)
    assert server.process.wait(60) == 1
    # multiprocessing's resource tracker ends once it sees the server's end of its pipe close
    wait_until(lambda: not [pid for pid in everything if process_exists(pid)], 10.0, "every process to end")
    assert not metrics_dir.exists()
    log = server.log()
    assert re.search(rf"API server [01] \(pid {pids[1]}\) exited unexpectedly \(killed by SIGKILL\); stopping the "
                     "server", log)
    assert "Traceback" not in log
