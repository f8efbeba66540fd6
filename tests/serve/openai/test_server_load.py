"""`compiled-llm serve` under load on a CPU: 500 seeded requests against one server, sent faster
than its admission limit lets in, some hanging up mid-stream, some with bad parameters.

Every accepted request runs to max_tokens (EOS ignored) or was cut off by its own client; every
other one gets a clean OpenAI error (400 or 404 for what it asked, 429/503 with Retry-After when
admission control refused it). Afterwards nothing is running or waiting, no KV block is held,
and the server's memory is within a bound of what it was after a warm-up."""

import asyncio
import collections
import json
import random
import time
from dataclasses import dataclass

import httpx2
from prometheus_client.parser import text_string_to_metric_families
from helpers.server_fixtures import serve_process

from compiled_llm.cli.bench.sse_client import SSEDecoder

NUM_REQUESTS = 500
WARM_UP_REQUESTS = 50
BURST = 200  # sent at once, far over the admission limit; the rest follow at RATE
RATE = 150.0  # requests/s
MAX_NUM_SEQS = 4
MAX_WAITING_REQUESTS = 8
MAX_WAITING_PROMPT_TOKENS = 200
MAX_MODEL_LEN = 1024
# A client that hangs up after its first chunk asked for far more tokens: the server must abort
# it. So many that it cannot finish them (900 steps) before it sees the hang-up, even when the
# client reads late and the first chunk was long written.
DISCONNECT_MAX_TOKENS = 900
RSS_BOUND_MIB = 100
TOKEN_IDS = 256  # the tiny presets' byte tokens
VOCAB_SIZE = 272  # tiny presets' vocab (ids >= this are out of the model's range)


@dataclass
class Outcome:
    kind: str
    status: int
    expected_status: int | None = None  # for bad requests
    finish_reason: str | None = None
    completion_tokens: int | None = None
    max_tokens: int | None = None
    error: dict | None = None
    retry_after: str | None = None
    done: bool = False  # a stream ended with data: [DONE]
    stream_error: str = ""


def valid_body(rng: random.Random, chat: bool = False) -> dict:
    body = {"model": "tiny", "max_tokens": rng.randint(1, 8), "temperature": rng.choice([0.0, 0.8]),
            "ignore_eos": True}
    if chat:
        body["messages"] = [{"role": "user", "content": "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 30)))}]
    else:
        body["prompt"] = [rng.randrange(TOKEN_IDS) for _ in range(rng.randint(1, 48))]
    return body


def bad_request(rng: random.Random) -> tuple[dict | bytes, int, str]:
    """(body, expected status, what is wrong)."""
    body = valid_body(rng)
    case = rng.randrange(12)
    if case == 0:
        return {**body, "max_tokens": -1}, 400, "negative max_tokens"
    if case == 1:
        return {**body, "temperature": "hot"}, 400, "temperature not a number"
    if case == 2:
        return {**body, "model": "no-such-model"}, 404, "unknown model"
    if case == 3:
        return {**body, "top_p": 2}, 400, "top_p over 1"
    if case == 4:
        return {**body, "prompt": body["prompt"] + [VOCAB_SIZE + 5]}, 400, "out-of-vocab prompt id"
    if case == 5:
        return {**body, "prompt": [1] * (4 * MAX_MODEL_LEN)}, 400, "prompt over max_model_len"
    if case == 6:
        return {**body, "prompt": []}, 400, "empty prompt"
    if case == 7:
        return {**body, "prompt": ""}, 400, "empty text prompt"
    if case == 8:
        return {**body, "max_tokens": "ten"}, 400, "max_tokens not a number"
    if case == 9:
        return {k: v for k, v in body.items() if k != "prompt"}, 400, "no prompt"
    if case == 10:
        return b'{"model": "tiny", "prompt": [1, 2', 400, "body not JSON"
    return {**body, "n": 0}, 400, "n = 0"


def is_admission_refusal(outcome: Outcome) -> bool:
    return outcome.status in (429, 503)


async def send(client: httpx2.AsyncClient, kind: str, body, at: float, start: float,
               expected_status: int | None = None) -> Outcome:
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    stream = kind in ("stream", "chat", "disconnect")
    if isinstance(body, dict):
        body = {**body, "stream": True, "stream_options": {"include_usage": True}} if stream else body
        content = json.dumps(body).encode()
    else:
        content = body
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    outcome = Outcome(kind, 0, expected_status, max_tokens=body.get("max_tokens") if isinstance(body, dict) else None)
    async with client.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as r:
        outcome.status = r.status_code
        if r.status_code != 200:
            outcome.retry_after = r.headers.get("Retry-After")
            try:
                outcome.error = json.loads(await r.aread())["error"]
            except (ValueError, KeyError, TypeError):
                outcome.error = None
            return outcome
        if not stream:
            reply = json.loads(await r.aread())
            outcome.finish_reason = reply["choices"][0]["finish_reason"]
            outcome.completion_tokens = reply["usage"]["completion_tokens"]
            return outcome
        decoder = SSEDecoder()
        async for piece in r.aiter_raw():
            for data in decoder.feed(piece):
                if data == b"[DONE]":
                    outcome.done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    outcome.stream_error = str(chunk["error"])
                for choice in chunk.get("choices") or []:
                    outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
                if chunk.get("usage"):
                    outcome.completion_tokens = chunk["usage"]["completion_tokens"]
                if kind == "disconnect" and chunk.get("choices"):
                    return outcome  # hang up after the first chunk: leaving the block closes the connection
    return outcome


async def send_all(base_url: str, requests: list[tuple], times: list[float]) -> list[Outcome]:
    limits = httpx2.Limits(max_connections=len(requests), max_keepalive_connections=len(requests))
    async with httpx2.AsyncClient(base_url=base_url, limits=limits, timeout=httpx2.Timeout(120.0),
                                  trust_env=False) as client:
        start = time.perf_counter()
        return await asyncio.gather(*(send(client, kind, body, at, start, expected)
                                       for (kind, body, expected, _), at in zip(requests, times)))


def workload(rng: random.Random, n: int, bad_fraction: float, disconnect_fraction: float) -> list[tuple]:
    """(kind, body, expected status, note) per request."""
    requests = []
    for _ in range(n):
        x = rng.random()
        if x < bad_fraction:
            body, status, why = bad_request(rng)
            requests.append(("bad", body, status, why))
        elif x < bad_fraction + disconnect_fraction:
            requests.append(("disconnect", {**valid_body(rng), "max_tokens": DISCONNECT_MAX_TOKENS}, None, ""))
        else:
            kind = rng.choice(["stream", "stream", "plain", "chat"])
            requests.append((kind, valid_body(rng, chat=kind == "chat"), None, ""))
    return requests


def scrape(base_url: str) -> dict[str, list]:
    """/metrics: samples by metric family name."""
    text = httpx2.get(base_url + "/metrics", timeout=30.0, trust_env=False).text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def engine_gauges(base_url: str) -> dict[str, float]:
    families = scrape(base_url)
    return {name: sum(s.value for s in families["compiled_llm:" + name])
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}


def finished_by_reason(base_url: str) -> collections.Counter:
    return collections.Counter({s.labels["finished_reason"]: s.value
                                for s in scrape(base_url)["compiled_llm:request_success"] if s.name.endswith("_total")})


def idle_gauges(base_url: str, timeout_s: float = 20.0) -> dict[str, float]:
    """The gauges once nothing runs or waits (an abort reaches the engine between steps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = engine_gauges(base_url)
        if (gauges["num_requests_running"] == 0 and gauges["num_requests_waiting"] == 0) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.2)


def rss_mib(pid: int) -> float:
    """The process's resident memory (Linux)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def check_outcome(o: Outcome, note: str) -> None:
    where = f"{o.kind} request ({note or 'valid'}): status {o.status}"
    if o.kind == "bad":
        assert o.status == o.expected_status, where
    elif is_admission_refusal(o):
        assert o.retry_after is not None and int(o.retry_after) >= 0, where + ": no Retry-After"
    else:
        assert o.status == 200, where
    if o.status != 200:  # OpenAI's error shape
        assert o.error is not None, where + ": the body is not OpenAI error JSON"
        assert isinstance(o.error.get("message"), str) and o.error["message"], where
        assert isinstance(o.error.get("type"), str), where
        return
    assert not o.stream_error, where + f": {o.stream_error}"
    if o.kind == "disconnect":
        return
    assert o.finish_reason == "length", where + f": finish_reason {o.finish_reason}"
    assert o.completion_tokens == o.max_tokens, where
    if o.kind in ("stream", "chat"):
        assert o.done, where + ": the stream did not end with [DONE]"


def test_500_requests_over_the_admission_limit_with_disconnects_and_bad_parameters(tiny_engine):
    flags = ["--served-model-name", "tiny", "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", str(MAX_MODEL_LEN),
             "--max-waiting-requests", str(MAX_WAITING_REQUESTS), "--max-waiting-prompt-tokens", str(MAX_WAITING_PROMPT_TOKENS)]
    rng = random.Random(0)
    with serve_process(tiny_engine, *flags) as server:
        # warm-up: the same mix, spread out, so that every path has run before the RSS is read
        warm = workload(rng, WARM_UP_REQUESTS, bad_fraction=0.2, disconnect_fraction=0.15)
        outcomes = asyncio.run(send_all(server.url, warm, [0.05 * i for i in range(len(warm))]))
        for o, (_, _, _, note) in zip(outcomes, warm):
            check_outcome(o, note)
        assert idle_gauges(server.url)["kv_cache_usage_perc"] == 0
        rss_warm = rss_mib(server.process.pid)
        reasons_before = finished_by_reason(server.url)

        requests = workload(rng, NUM_REQUESTS, bad_fraction=0.2, disconnect_fraction=0.15)
        times = [0.0] * BURST
        while len(times) < NUM_REQUESTS:
            times.append(times[-1] + rng.expovariate(RATE))
        outcomes = asyncio.run(send_all(server.url, requests, times))
        for o, (_, _, _, note) in zip(outcomes, requests):
            check_outcome(o, note)

        refused = [o for o in outcomes if o.kind != "bad" and is_admission_refusal(o)]
        finished = [o for o in outcomes if o.kind in ("stream", "plain", "chat") and o.status == 200]
        cut_off = [o for o in outcomes if o.kind == "disconnect" and o.status == 200]
        # how many get in depends on the CPU's speed; enough must for the checks to mean something
        assert refused, "the burst did not reach the admission limit"
        assert len(finished) >= 10 and cut_off, (len(finished), len(cut_off))

        gauges = idle_gauges(server.url)
        assert gauges == {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0}
        # each hung-up stream was aborted, not run to its max_tokens; every other one ran to it
        reasons = finished_by_reason(server.url)
        reasons.subtract(reasons_before)
        assert +reasons == {"abort": len(cut_off), "length": len(finished)}
        assert rss_mib(server.process.pid) <= rss_warm + RSS_BOUND_MIB
        # and it still serves
        (after,) = asyncio.run(send_all(server.url, [("plain", valid_body(rng), None, "")], [0.0]))
        check_outcome(after, "after the load")
