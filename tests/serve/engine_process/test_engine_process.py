"""The server's engine process: the message channel between it and the front end, its start (and
refusal to start), its death under running requests (which ends the server), and the front end's
detokenization of the streams the engine no longer detokenizes."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from compiled_llm.errors import CompiledLLMError, EngineError
from helpers.server_fixtures import engine_pids, serve_process


def serve_args(source, *flags):
    from compiled_llm.cli.main import make_parser

    return make_parser().parse_args(["serve", str(source), "--device", "cpu", *flags])


def load_served_engine(source, *flags):
    from compiled_llm.cli.serve import load_engine

    return functools.partial(load_engine, serve_args(source, *flags))


# ---- the channel ---------------------------------------------------------------------------------------


def test_a_message_larger_than_the_pipe_goes_through_without_blocking_the_sender():
    from compiled_llm.serve.engine_process.message_channel import MessageChannel

    a_to_b, b_to_a = os.pipe(), os.pipe()
    a = MessageChannel(b_to_a[0], a_to_b[1])
    b = MessageChannel(a_to_b[0], b_to_a[1])
    big = ("step", list(range(1_000_000)), "é" * 1000)
    t0 = time.perf_counter()
    a.send(big)
    a.send(("small", 1))
    assert time.perf_counter() - t0 < 2.0 and a.pending  # queued, not blocked on the reader
    received = []
    while len(received) < 2:
        received += b.receive()
        a.flush()
    assert received == [big, ("small", 1)] and not a.pending
    a.close()
    assert b.receive() == [] and b.closed


def test_a_channel_knows_whether_its_reader_missed_more_than_the_last_message():
    from compiled_llm.serve.engine_process.message_channel import MessageChannel

    a_to_b, b_to_a = os.pipe(), os.pipe()
    sender, reader = MessageChannel(b_to_a[0], a_to_b[1]), MessageChannel(a_to_b[0], b_to_a[1])
    assert not sender.reader_behind
    sender.send(("step", [1, 2, 3]))
    assert not sender.reader_behind  # the last message alone: sent a moment ago
    sender.send(("step", [4]))
    assert sender.reader_behind  # an earlier one is still unread
    assert reader.receive() == [("step", [1, 2, 3]), ("step", [4])]
    assert not sender.reader_behind
    big = ("step", list(range(1_000_000)))  # more than the pipe holds: the rest waits here
    sender.send(big)
    sender.send(("step", [5]))
    assert sender.pending and sender.reader_behind
    reader.close()
    sender.close()


def test_a_socket_channel_never_counts_its_reader_behind():
    import socket

    from compiled_llm.serve.engine_process.message_channel import MessageChannel

    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    left, right = socket.socketpair()
    for sock in (client, left):
        sender = MessageChannel(sock.fileno(), sock.fileno())
        for _ in range(3):  # unread by the peer, but a socket cannot count unread bytes
            sender.send(("step", list(range(1000))))
        assert not sender.reader_behind
        sender.close()
    for s in (peer, server, right):
        s.close()


# ---- the process ---------------------------------------------------------------------------------------


def test_an_engine_that_cannot_load_is_refused_with_its_reason(tmp_path):
    from compiled_llm.serve.engine_process.engine_core_client import EngineCoreClient

    missing = tmp_path / "not-an-engine"
    missing.mkdir()
    with pytest.raises(CompiledLLMError, match="the engine could not start: .*not-an-engine"):
        EngineCoreClient.start_process(load_served_engine(missing, "--enforce-eager"))


def test_a_dead_engine_process_fails_its_requests_with_one_clear_error(lively_bpe_engine):
    from compiled_llm.serve.engine_process.async_engine import AsyncEngine
    from compiled_llm.serve.engine_process.engine_core_client import EngineCoreClient
    from compiled_llm.serve.sampling_params import SamplingParams

    core = EngineCoreClient.start_process(load_served_engine(lively_bpe_engine))
    assert core.info.max_model_len > 0 and core.tokenizer is not None
    pid = core._process.pid

    told = []  # what the server hears: the reason, once

    async def main():
        front = AsyncEngine(core, on_failure=told.append)
        front.start()
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        group = front.submit([core.validator.validate("A compiler lowers", params)], stream=True)
        first = await group.next_outputs()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineError, match="engine process exited"):
            while await group.next_outputs():
                pass
        group.release()
        with pytest.raises(EngineError, match="the engine stopped"):
            front.submit([core.validator.validate("hello", params)])
        await front.stop()
        return first, front.failure

    first, failure = asyncio.run(main())
    assert first[0][1].outputs[0].delta_token_ids
    assert f"exit code {-signal.SIGKILL}" in failure
    assert told == [failure]
    assert not core.alive


def engine_process_of(server_pid: int) -> int:
    (pid,) = engine_pids(server_pid)
    return pid


def running_requests(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "compiled_llm:num_requests_running")


def test_a_server_whose_engine_process_dies_fails_its_requests_and_exits_non_zero(lively_bpe_engine, tmp_path):
    body = {"prompt": "A compiler lowers", "max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    with serve_process(lively_bpe_engine, "--log-stats-interval", "0.2", log_path=tmp_path / "serve.log") as server:
        def post(payload: dict):
            return urllib.request.urlopen(urllib.request.Request(
                server.api_url + "/completions", data=json.dumps(payload).encode(),
                headers={"Content-Type": "application/json"}), timeout=60)

        unstreamed = []

        def call_unstreamed():
            try:
                post(body)
            except urllib.error.HTTPError as e:
                unstreamed.append((e.code, json.loads(e.read())))

        waiter = threading.Thread(target=call_unstreamed)
        waiter.start()
        stream = post({**body, "stream": True})
        assert stream.readline().startswith(b"data: {")  # the stream has begun
        deadline = time.monotonic() + 20
        while running_requests(server.url) < 2:
            assert time.monotonic() < deadline, "the two requests never ran together"
            time.sleep(0.01)
        os.kill(engine_process_of(server.process.pid), signal.SIGKILL)
        killed = time.monotonic()
        events = [line[len("data: "):] for line in stream.read().decode().splitlines() if line.startswith("data: ")]
        exit_code = server.process.wait(timeout=10)
        took = time.monotonic() - killed
        waiter.join(10)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "engine process exited" in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert all("error" not in json.loads(e) for e in events[:-2])
    (status, response), = unstreamed
    assert status == 500 and "engine process exited" in response["error"]["message"]
    assert exit_code == 1 and took < 10
    log = server.log()
    assert log.count("engine process exited") == 1 and "Traceback" not in log
    after = log[log.index("engine process exited"):]
    assert "throughput" not in after  # the stats log stopped


# ---- detokenization on the front end's side ------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(lively_bpe_engine):
    from compiled_llm.serve.llm import LLM

    return LLM(str(lively_bpe_engine), device="cpu")


def run_front(engine, requests, stream: bool):
    from compiled_llm.serve.engine_process.async_engine import AsyncEngine

    async def main():
        front = AsyncEngine.in_thread(engine)
        front.start()
        try:
            group = front.submit(requests, stream=stream)
            pieces = [[] for _ in requests]
            finals = [None] * len(requests)
            outputs = [[] for _ in requests]
            async for ready in group:
                for i, out in ready:
                    pieces[i].append(out.outputs[0].delta_text)
                    outputs[i].append(out.outputs[0])
                    if out.finished:
                        finals[i] = out.outputs[0]
            group.release()
            # read after the stream ended: each output's whole text is still the text it had
            for parts, outs in zip(pieces, outputs):
                for k, out in enumerate(outs[:-1]):
                    assert out.text == "".join(parts[:k + 1])
            return pieces, finals
        finally:
            await front.stop()

    return asyncio.run(main())


@pytest.mark.parametrize("stream", [True, False])
def test_front_end_text_equals_the_engines_own(llm, stream):
    from compiled_llm.serve.sampling_params import SamplingParams

    prompts = ["Once upon a time", "hello world", "tokens per second"]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = llm.generate(prompts, params, use_tqdm=False)  # detokenized in the engine
    pieces, finals = run_front(llm.engine, [llm.engine.validate(p, params) for p in prompts], stream)
    for want, got, parts in zip(expected, finals, pieces):
        assert got.text == want.text and got.token_ids == want.token_ids
        assert "".join(parts) == want.text
        if stream:
            assert len(parts) > 1


def test_stop_strings_are_still_found_by_the_engine(llm):
    from compiled_llm.serve.sampling_params import SamplingParams

    base = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    (full,) = llm.generate(["Once upon a time"], base, use_tqdm=False)
    full = full.text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), "the lively model's text should have a middle"
    (want,) = llm.generate(["Once upon a time"], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                          stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)
    request = llm.engine.validate("Once upon a time", SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True))
    pieces, (got,) = run_front(llm.engine, [request], stream=True)
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert got.text == want.text and got.text.endswith(stop) and "".join(pieces[0]) == want.text
    assert got.token_ids == want.token_ids


def deltas_by_request(deltas: list[tuple]) -> dict[str, list[int]]:
    """Each request's new token ids in ``step_deltas`` tuples (one completion each)."""
    out: dict[str, list[int]] = {}
    for rid, _finished, _metrics, _prompt_lp, completions in deltas:
        for _index, _text, ids, *_ in completions:
            out.setdefault(rid, []).extend(ids)
    return out


def test_streams_held_while_the_front_end_is_behind_get_their_tokens_merged_and_ends_at_once(llm):
    from compiled_llm.serve.engine_process.engine_messages import OutputAssembler
    from compiled_llm.serve.sampling_params import SamplingParams

    engine = llm.engine
    prompts = ["Once upon a time", "hello world", "tokens per second"]
    lengths = [12, 8, 12]
    expected = [llm.generate([p], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                             use_tqdm=False)[0].token_ids for p, n in zip(prompts, lengths)]
    for rid, prompt, n, stream in zip(["a", "b", "whole"], prompts, lengths, [True, True, False]):
        text, ids, p = engine.validate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        engine.add_request(None, request_id=rid, stream=stream,
                           _validated=(text, ids, OutputAssembler.engine_params(p, engine.tokenizer)))
    per_step = []
    while engine.has_unfinished_requests():
        # the front end is behind for the first 5 steps, and from the 7th on
        step = len(per_step)
        per_step.append(deltas_by_request(engine.step_deltas(hold_streams=not 5 <= step < 7)))
    assert per_step[0] == {"a": expected[0][:1], "b": expected[1][:1]}  # first tokens are never held
    assert per_step[1:5] == [{}] * 4
    assert (len(per_step[5]["a"]), len(per_step[5]["b"])) == (5, 5)  # 4 held steps' tokens and the 6th's
    assert set(per_step[6]) == {"a", "b"} and len(per_step[6]["a"]) == 1
    # held again from the 7th step: only ends are reported, with all their tokens since
    assert sorted(rid for got in per_step[7:] for rid in got) == ["a", "b", "whole"]
    received = {rid: [t for got in per_step for t in got.get(rid, [])] for rid in ("a", "b", "whole")}
    assert [received["a"], received["b"], received["whole"]] == expected


def test_a_held_stream_that_is_aborted_sends_nothing_more(llm):
    from compiled_llm.serve.engine_process.engine_messages import OutputAssembler
    from compiled_llm.serve.sampling_params import SamplingParams

    engine = llm.engine
    text, ids, p = engine.validate("Once upon a time", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    engine.add_request(None, request_id="gone", stream=True,
                       _validated=(text, ids, OutputAssembler.engine_params(p, engine.tokenizer)))
    first = engine.step_deltas(hold_streams=True)  # the first token goes out even so
    assert [(rid, len(completions[0][2])) for rid, _, _, _, completions in first] == [("gone", 1)]
    for _ in range(3):
        assert engine.step_deltas(hold_streams=True) == []
    assert engine.abort_request("gone").outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():  # a step queued ahead may still be in flight
        assert engine.step_deltas() == []


# ---- the front end's pacing --------------------------------------------------------------------------


class _StubCore:
    """An engine core the test feeds by hand: what AsyncEngine reads of one."""

    tokenizer = None

    def __init__(self):
        self.sent, self.on_message = [], None

    def start(self, on_message):
        self.on_message = on_message

    def send(self, message):
        self.sent.append(message)

    async def close(self):
        pass


def test_a_step_wakes_new_streams_at_once_and_running_ones_a_batch_per_turn():
    """The event loop must not spend a whole turn on every running stream's next chunk: new
    requests and first tokens wait behind at most WAKE_BATCH of them."""
    from compiled_llm.serve.engine_process import async_engine as ae
    from compiled_llm.serve.sampling_params import SamplingParams

    n = 3 * ae.WAKE_BATCH + 5

    async def scenario():
        core = _StubCore()
        engine = ae.AsyncEngine(core)
        engine.start()
        groups = [engine.submit([(None, [1, 2, 3], SamplingParams(max_tokens=10, detokenize=False))], stream=True)
                  for _ in range(n)]
        ids = [g.request_ids[0] for g in groups]
        got = {rid: [] for rid in ids}

        async def consume(group):
            try:
                async for ready in group:
                    for _, out in ready:
                        got[group.request_ids[0]].extend(out.outputs[0].delta_token_ids)
            finally:
                group.release()

        tasks = [asyncio.ensure_future(consume(g)) for g in groups]
        await asyncio.sleep(0)  # every consumer waits for its first output

        def step(token, finished=False):
            core.on_message(("step", [(rid, finished, None, None, [(0, "", [token], "length" if finished else None,
                                                                     None, None, None)]) for rid in ids],
                             [], [], None))

        step(7)  # first tokens: every stream at once
        await asyncio.sleep(0)
        assert all(got[rid] == [7] for rid in ids)

        step(8)  # running streams: WAKE_BATCH per turn of the loop, in order
        seen = [0]
        for _ in range(6):
            await asyncio.sleep(0)
            served = [got[rid] == [7, 8] for rid in ids]
            assert served == sorted(served, reverse=True)  # in order of arrival
            seen.append(sum(served))
        assert max(b - a for a, b in zip(seen, seen[1:])) == ae.WAKE_BATCH
        assert seen[-1] == n

        step(9)
        step(10, finished=True)  # a stream that has fallen behind gets both tokens in one output
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert all(got[rid] == [7, 8, 9, 10] for rid in ids)
        await engine.stop()

    asyncio.run(scenario())


def test_a_later_prompts_first_token_is_not_paced_behind_running_streams():
    """In a streamed call with several prompts, each prompt's first output is woken at once,
    not only the call's first."""
    from compiled_llm.serve.engine_process import async_engine as ae
    from compiled_llm.serve.sampling_params import SamplingParams

    def request():
        return (None, [1, 2, 3], SamplingParams(max_tokens=10, detokenize=False))

    async def scenario():
        core = _StubCore()
        engine = ae.AsyncEngine(core)
        engine.start()
        others = [engine.submit([request()], stream=True) for _ in range(2 * ae.WAKE_BATCH)]
        pair = engine.submit([request(), request()], stream=True)
        got = []

        async def consume(group, sink):
            try:
                async for ready in group:
                    sink.extend((i, out.outputs[0].delta_token_ids) for i, out in ready)
            finally:
                group.release()

        tasks = [asyncio.ensure_future(consume(g, [])) for g in others]
        tasks.append(asyncio.ensure_future(consume(pair, got)))
        await asyncio.sleep(0)

        def out(rid, token, finished=False):
            return (rid, finished, None, None, [(0, "", [token], "length" if finished else None, None, None, None)])

        a, b = pair.request_ids
        running = [g.request_ids[0] for g in others]
        core.on_message(("step", [out(rid, 7) for rid in running] + [out(a, 7)], [], [], None))
        for _ in range(4):
            await asyncio.sleep(0)
        assert got == [(0, [7])]
        # every stream has started; now the second prompt's first token comes behind them all
        core.on_message(("step", [out(rid, 8) for rid in running] + [out(a, 8), out(b, 5)], [], [], None))
        await asyncio.sleep(0)
        assert (1, [5]) in got  # woken at once, while the running streams are paced
        core.on_message(("step", [out(rid, 9, True) for rid in running] + [out(a, 9, True), out(b, 6, True)],
                         [], [], None))
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        await engine.stop()

    asyncio.run(scenario())


# ---- several API servers over the same engines -----------------------------------------------------------


def engine_cores_in_threads(engines, api_servers: int):
    """Each engine stepped by an EngineCore in a thread, with the owner's channel and one per
    API server (``--api-server-count``): (the owners' channels, for each API server its clients
    of the engines, the threads)."""
    from compiled_llm.serve.engine_process.engine_core import EngineCore
    from compiled_llm.serve.engine_process.engine_core_client import EngineCoreClient
    from compiled_llm.serve.engine_process.engine_messages import EngineInfo, EngineSnapshot
    from compiled_llm.serve.engine_process.message_channel import MessageChannel

    def pair():
        """Two ends of a pair of pipes: (this side's, the engine's)."""
        (to_engine_r, to_engine_w), (from_engine_r, from_engine_w) = os.pipe(), os.pipe()
        return MessageChannel(from_engine_r, to_engine_w), MessageChannel(to_engine_r, from_engine_w)

    owners, clients, threads = [], [[] for _ in range(api_servers)], []
    for engine in engines:
        owner, owner_end = pair()
        ends = []
        for k in range(api_servers):
            mine, theirs = pair()
            ends.append(theirs)
            clients[k].append(EngineCoreClient(mine, EngineInfo.of(engine), engine.tokenizer,
                                               EngineSnapshot.of(engine), owns_engine=False))
        threads.append(threading.Thread(target=EngineCore(engine, owner_end, ends).run, daemon=True))
        threads[-1].start()
        owners.append(owner)
    return owners, clients, threads


def test_two_api_servers_over_two_replicas_hear_only_of_their_own_requests_and_one_that_goes_has_its_aborted(
        llm, lively_oracle):
    """What --api-server-count 2 --data-parallel-size 2 runs, in threads: each API server's
    requests, numbered its own way, reach both replicas and come back to it alone, equal to
    transformers' greedy; an API server that goes away has its running request aborted, and the
    other serves on."""
    from compiled_llm.serve.engine_process.async_engine import AsyncEngine
    from compiled_llm.serve.engine_process.dp_client import DataParallelClient
    from compiled_llm.serve.llm import LLM
    from compiled_llm.serve.sampling_params import SamplingParams

    engines = [LLM.from_loaded(llm.model).engine for _ in range(2)]
    owners, clients, threads = engine_cores_in_threads(engines, api_servers=2)
    tokenizer = llm.engine.tokenizer
    prompts = [tokenizer.encode(f"{p} {i}") for i, p in enumerate(["Once upon a time", "hello world"] * 4)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    heard = [[], []]  # (replica, request id) of every output each API server was sent

    def listening(k: int, on_message):
        def on(message):
            if message[0] == "step":
                heard[k] += [(message[-1], encoded[0]) for encoded in message[1]]
            on_message(message)
        return on

    async def tokens(front, ids, params) -> list[int]:
        group = front.submit([clients[0][0].validator.validate(ids, params)], stream=True)
        try:
            return (await group.results())[0].outputs[0].token_ids
        finally:
            group.release()

    async def main():
        fronts = [AsyncEngine(DataParallelClient(clients[k]), request_id_prefix=f"{k}-") for k in (0, 1)]
        for k, front in enumerate(fronts):
            front._on_message = listening(k, front._on_message)
            front.start()
        got = await asyncio.gather(*(tokens(fronts[i % 2], ids, greedy) for i, ids in enumerate(prompts)))
        # API server 1 goes (its process ended: its channels close) with a long request running
        long = fronts[1].submit([clients[1][0].validator.validate(
            prompts[0], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))], stream=True)
        await long.next_outputs()
        for client in clients[1]:
            client.channel.close()
        after = await tokens(fronts[0], prompts[1], greedy)
        await fronts[0].stop()
        return got, after

    try:
        got, after = asyncio.run(main())
        wait_for = time.monotonic() + 10
        while any(e.has_unfinished_requests() for e in engines) and time.monotonic() < wait_for:
            time.sleep(0.05)
        assert not any(e.has_unfinished_requests() for e in engines)
        # the long one was aborted within a few steps of its API server's going, not run to 400 tokens
        assert sum(e.stats.generated_tokens for e in engines) < len(prompts) * 10 + 10 + 100
    finally:
        for owner in owners:
            owner.send(("shutdown",))
        for thread in threads:
            thread.join(10)
    assert got == [lively_oracle(ids, 10)[0] for ids in prompts]
    assert after == lively_oracle(prompts[1], 10)[0]
    for k in (0, 1):
        assert {replica for replica, _ in heard[k]} == {0, 1}
        assert all(rid.startswith(f"{k}-") for _, rid in heard[k])
    assert not any(t.is_alive() for t in threads)
