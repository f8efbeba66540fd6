"""`bench --workload serving`: the client's SSE parsing and per-request timing, the Poisson
schedule and the statistics, then one real run on a CPU (a tiny engine served by `compiled-llm
serve` in a subprocess, the bench process its client) whose numbers must add up."""

import itertools
import json
import math
import random

import pytest

from compiled_llm.cli.bench import load_generator, server_launcher, serving, serving_report, sse_client
from compiled_llm.cli.bench.workloads import Result, throughput_requests
from compiled_llm.errors import CompiledLLMError, InvalidOptionError


def sse(*payloads: str, newline: str = "\n") -> bytes:
    return "".join(f"data: {p}{newline}{newline}" for p in payloads).encode()


def completion_chunk(text: str, finish_reason=None, completion_tokens=None, prompt_tokens=7) -> str:
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if completion_tokens is not None:
        chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}
    return json.dumps(chunk)


def usage_chunk(completion_tokens: int, prompt_tokens=7) -> str:
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [],
                       "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                 "total_tokens": prompt_tokens + completion_tokens}})


# ---- SSE parsing ------------------------------------------------------------------------------


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_sse_events_come_out_whole_wherever_the_bytes_are_split(newline):
    payloads = [completion_chunk("Hel"), completion_chunk("lo", "length", 2), usage_chunk(2), "[DONE]"]
    stream = (": a comment the server may send\n\n" + "event: completion\n").encode() + sse(*payloads, newline=newline)
    for cut in range(1, len(stream)):
        decoder = sse_client.SSEDecoder()
        events = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        assert [e.decode() for e in events] == payloads, f"split at byte {cut}"
    decoder = sse_client.SSEDecoder()  # and one byte at a time
    assert [e.decode() for b in stream for e in decoder.feed(bytes([b]))] == payloads


def test_sse_multi_line_data_is_joined_with_newlines():
    assert sse_client.SSEDecoder().feed(b"data: a\ndata:b\n\n") == [b"a\nb"]


def chunked(*pieces: bytes) -> bytes:
    """``pieces`` in HTTP/1.1's chunked transfer coding, a size extension on the first."""
    out = b""
    for i, piece in enumerate(pieces):
        out += b"%x%s\r\n%s\r\n" % (len(piece), b";ext=1" if i == 0 else b"", piece)
    return out + b"0\r\n\r\n"


def test_chunked_body_comes_out_whole_wherever_the_bytes_are_split():
    body_pieces = [sse(completion_chunk("Hel")), b"", sse(completion_chunk("lo", "length", 2)) * 9, sse("[DONE]")]
    body_pieces = [p for p in body_pieces if p]  # a zero-size chunk would end the body
    wire = chunked(*body_pieces) + b"bytes after the body"
    expected = b"".join(body_pieces)
    for cut in range(1, len(wire)):
        decoder = sse_client.ChunkedDecoder()
        got = decoder.feed(wire[:cut]) + decoder.feed(wire[cut:])
        assert got == expected and decoder.done, f"split at byte {cut}"
    decoder = sse_client.ChunkedDecoder()
    assert b"".join(decoder.feed(bytes([b])) for b in wire) == expected and decoder.done


@pytest.mark.parametrize("wire, error", [
    (b"zz\r\nabc", "malformed chunk size"),
    (b"0x5\r\nabcde\r\n", "malformed chunk size"),
    (b"\r\nabc", "malformed chunk size"),
    (b"3\r\nabcXY4\r\n", "not followed by CRLF"),
])
def test_chunked_body_with_bad_framing_is_an_error(wire, error):
    with pytest.raises(CompiledLLMError, match=error):
        sse_client.ChunkedDecoder().feed(wire)


def test_only_plain_http_urls_are_requested():
    host, port, request = sse_client.http_request("POST", "http://127.0.0.1:8123/v1/completions?x=1", b"{}",
                                                  {"Accept": "text/event-stream"})
    assert (host, port) == ("127.0.0.1", 8123)
    assert request.startswith(b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: 127.0.0.1:8123\r\n")
    assert b"Content-Length: 2\r\n" in request and request.endswith(b"\r\n\r\n{}")
    with pytest.raises(CompiledLLMError, match="plain http only"):
        sse_client.http_request("GET", "https://example.com/health")


def serve_raw(responses: list[bytes]):
    """A server on a free port that answers its i-th connection with ``responses[i]`` (written in
    pieces, then the connection closed); (base url, the asyncio server) inside a running loop."""
    import asyncio

    async def start():
        remaining = list(responses)

        async def answer(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            response = remaining.pop(0)
            for i in range(0, len(response), 7):
                writer.write(response[i:i + 7])
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", server

    return start()


def test_stream_one_times_a_chunked_stream_and_names_what_went_wrong():
    import asyncio

    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    stream = chunked(sse(completion_chunk("Hel", completion_tokens=1)),
                     sse(completion_chunk("lo", "length", 2)), sse(usage_chunk(2)), sse("[DONE]"))
    error = json.dumps({"error": {"message": "max_tokens must be at least 1", "type": "x"}}).encode()
    responses = [
        head + stream,
        b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(error), error),
        head + stream[:40],  # broken off mid-stream
        head + stream[:60] + b"XY" + stream[60:],  # a chunk's framing broken
        head + chunked(sse("[1, 2]"), sse(completion_chunk("lo", "length", 2)), sse("[DONE]")),
    ]

    async def run():
        base, server = await serve_raw(responses)
        async with server:
            url = base + "/v1/completions"
            return [await sse_client.stream_one(url, b"{}", 7, 0.0, 0.0, {}) for _ in responses]

    ok, refused, broken, misframed, not_an_object = asyncio.run(run())
    assert ok.ok and ok.output_tokens == 2 and ok.finish_reason == "length" and ok.chunks == 4, ok.error
    assert len(ok.itl) == 1 and 0 < ok.ttft <= ok.e2e
    assert not refused.ok and refused.error == "HTTP 400: max_tokens must be at least 1"
    assert not broken.ok and "closed the connection before the response's end" in broken.error
    assert not misframed.ok and ("CRLF" in misframed.error or "chunk size" in misframed.error)
    assert not not_an_object.ok and "not a JSON object" in not_an_object.error


def test_stream_one_to_a_port_nobody_listens_on_fails_in_one_line():
    import asyncio
    import socket

    with socket.socket() as s:  # a port just freed: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    record = asyncio.run(sse_client.stream_one(f"http://127.0.0.1:{port}/v1/completions", b"{}", 7, 0.0, 0.0, {}))
    assert not record.ok and record.error.startswith(f"cannot connect to 127.0.0.1:{port}")


# ---- per-request timing -----------------------------------------------------------------------


def timed(events: list[tuple[float, str]], prompt_len=7) -> sse_client.RequestRecord:
    timer = sse_client.StreamTimer(sent=100.0)
    for now, payload in events:
        timer.on_event(payload.encode(), now)
    return timer.record(now=events[-1][0], prompt_len=prompt_len)


def test_timer_counts_tokens_by_usage_in_every_chunk_even_when_text_is_empty():
    # continuous usage: a chunk with empty text (an incomplete UTF-8 character) still carries a
    # token, and a chunk may carry two
    record = timed([(100.5, completion_chunk("", None, 1)), (100.6, completion_chunk("é", None, 2)),
                    (100.8, completion_chunk("ab", None, 4)), (101.0, completion_chunk("c", "length", 5)),
                    (101.0, usage_chunk(5)), (101.1, "[DONE]")])
    assert record.ok and record.finish_reason == "length"
    assert record.output_tokens == 5 and record.prompt_tokens == 7
    assert record.ttft == pytest.approx(0.5)
    assert record.itl == pytest.approx([0.1, 0.2, 0.2])  # per chunk, as vLLM counts it
    assert record.e2e == pytest.approx(1.1)


def test_timer_without_continuous_usage_counts_a_token_per_chunk_and_takes_the_final_usage():
    record = timed([(100.2, completion_chunk("a")), (100.3, completion_chunk("b")),
                    (100.5, completion_chunk("", "length")),  # only closes the stream
                    (100.5, usage_chunk(2)), (100.6, "[DONE]")])
    assert record.ok and record.output_tokens == 2
    assert record.ttft == pytest.approx(0.2) and record.itl == pytest.approx([0.1])


def test_timer_reports_streams_that_end_badly():
    no_finish = timed([(100.2, completion_chunk("a")), (100.3, "[DONE]")])
    assert not no_finish.ok and "finish_reason" in no_finish.error
    error = timed([(100.2, json.dumps({"error": {"message": "engine failed", "type": "InternalServerError"}}))])
    assert not error.ok and error.error == "engine failed"
    assert sse_client.error_message(400, b'{"error": {"message": "top_p must be in (0, 1]", "type": "x"}}') == \
        "HTTP 400: top_p must be in (0, 1]"


# ---- schedule and statistics ------------------------------------------------------------------


def test_poisson_send_times_are_seeded_with_the_rate_as_mean():
    times = load_generator.send_times(20_000, rate=50.0, seed=3)
    assert times == load_generator.send_times(20_000, rate=50.0, seed=3)
    assert times != load_generator.send_times(20_000, rate=50.0, seed=4)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] == 0.0 and min(gaps) >= 0
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50.0, rel=0.03)
    # exponential gaps: the standard deviation equals the mean
    mean = sum(gaps) / len(gaps)
    assert math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) == pytest.approx(mean, rel=0.05)
    assert load_generator.send_times(5, math.inf) == [0.0] * 5


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert serving_report.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_summary_figures_follow_their_definitions():
    records = [sse_client.RequestRecord(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.1, itl=[0.01, 0.02, 0.03, 0.04], e2e=0.2),
               sse_client.RequestRecord(ok=True, prompt_tokens=20, output_tokens=3, ttft=0.3, itl=[0.05, 0.05], e2e=0.4),
               sse_client.RequestRecord(ok=False, error="HTTP 503: busy")]
    m = serving_report.summarize(records, duration_s=2.0)
    assert (m["completed"], m["failed"], m["output_tokens"]) == (2, 1, 8)
    assert m["request_s"] == pytest.approx(1.0)
    assert m["output_tok_s"] == pytest.approx(4.0) and m["total_tok_s"] == pytest.approx(19.0)
    assert m["ttft_ms_mean"] == pytest.approx(200.0) and m["ttft_ms_p50"] == pytest.approx(200.0)
    # TPOT = (e2e - TTFT) / (output tokens - 1): 25 ms and 50 ms
    assert m["tpot_ms_mean"] == pytest.approx(37.5)
    assert m["itl_ms_mean"] == pytest.approx(1e3 * 0.2 / 6)
    assert m["itl_ms_p99"] == pytest.approx(serving_report.percentile([10, 20, 30, 40, 50, 50], 99))


def test_options_are_checked_and_passed_to_the_server_as_flags():
    with pytest.raises(InvalidOptionError, match="rate"):
        serving.parse_rate("0")
    with pytest.raises(InvalidOptionError, match="rate"):
        serving.parse_rate("fast")
    assert serving.parse_rate("inf") == math.inf and serving.parse_rate("2.5") == 2.5
    with pytest.raises(InvalidOptionError, match="max_input_len"):
        serving.ServingOptions(max_input_len=50)
    with pytest.raises(InvalidOptionError, match="api_server_count must be >= 1, got 0"):
        serving.ServingOptions(api_server_count=0)
    flags = server_launcher.option_flags({"max_num_seqs": 8, "enforce_eager": True, "enable_prefix_caching": False,
                                  "num_blocks": None, "device": "cpu"})
    assert flags == ["--max-num-seqs", "8", "--enforce-eager", "--no-enable-prefix-caching", "--device", "cpu"]


def test_split_load_keeps_the_schedule():
    bodies = [b"%d" % i for i in range(7)]
    loads = load_generator.split_load("http://x", bodies, list(range(7)), [0.1 * i for i in range(7)], processes=3)
    assert sorted(b for load in loads for b in load.bodies) == sorted(bodies)
    for load in loads:  # each request keeps its own send time
        assert all(at == pytest.approx(0.1 * int(b)) for b, at in zip(load.bodies, load.send_at))


# ---- a real run ---------------------------------------------------------------------------------


def test_bench_serving_on_cpu_reports_every_request(capsys):
    from compiled_llm.cli.main import main

    rate, n, max_in, max_out = 20.0, 8, 110, 104
    code = main(["bench", "tiny-qwen2", "--workload", "serving", "--num-requests", str(n), "--request-rate", str(rate),
                 "--request-rate", "inf", "--max-input-len", str(max_in), "--max-output-len", str(max_out),
                 "--client-processes", "2", "--no-hf", "--device", "cpu", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    results = [Result(**r) for r in json.loads(captured.out, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))]
    (offline,) = [r for r in results if r.system.startswith("offline")]
    runs = [r for r in results if r.system.startswith("compiled-llm serve")]
    assert [r.extra["request_rate"] for r in runs] == ["20", "inf"]
    assert offline.metrics["output_tok_s"] > 0

    _, max_tokens = throughput_requests(n, max_in, max_out)
    for run in runs:
        m = run.metrics
        assert (m["completed"], m["failed"]) == (n, 0), run.extra["errors"]
        assert m["output_tokens"] == sum(max_tokens)  # ignore_eos: every request runs to max_tokens
        assert m["output_tok_s"] > 0 and m["request_s"] > 0 and m["total_tok_s"] > m["output_tok_s"]
        assert m["vs_offline"] == pytest.approx(m["output_tok_s"] / offline.metrics["output_tok_s"])
        for name in ("ttft", "tpot", "itl", "e2e"):
            assert 0 < m[f"{name}_ms_p50"] <= m[f"{name}_ms_p99"], name
        assert m["ttft_ms_p99"] <= m["e2e_ms_p99"]
        assert run.extra["client_chunks"] >= n and run.extra["client_processes"] == 2
    # the Poisson run sends its last request at the schedule's last time
    assert runs[0].metrics["duration_s"] >= load_generator.send_times(n, rate)[-1]

    table = serving_report.format_table(results)
    assert "rate=20" in table and "rate=inf" in table and "ttft_ms_p99" in table and "offline" in table
