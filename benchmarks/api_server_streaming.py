"""How many streamed chunks the HTTP front end delivers a second, with one API server or several
(``serve --api-server-count``), over an engine that costs nothing: a stand-in that "steps" every
``--step-ms`` and gives every running request one token, so the front end alone sets the pace.

    python benchmarks/api_server_streaming.py TOKENIZER_DIR [--api-server-count 1 2] [--streams 256]

TOKENIZER_DIR: a transformers tokenizer (``benchmarks/bench_tokenizer.py`` makes one of a real
size): the front end detokenizes the stand-in's tokens with it, as it does a real engine's. Each
count runs its own server (the real one: ``serve`` or ``serve_api_servers``, only the engine
stands in) and one load of ``--streams`` requests sent at once, streamed to ``--tokens`` tokens
each, read by the serving bench's client (``--client-processes``). Printed: the output tokens
and the SSE chunks the clients received per second, the run's wall time, and each process's
CPU (the busiest server process's share of the run: near 1.0, that process is the limit).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import math
import multiprocessing
import os
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace


@dataclasses.dataclass
class _Request:
    request_id: str
    max_tokens: int
    start: int
    generated: int = 0


class StandInEngine:
    """What the engine core reads of an LLMEngine, over no model: every step sleeps ``step_s``
    and gives each running request (up to ``max_num_seqs``) its next token, from a cycle of
    ``token_ids``."""

    def __init__(self, tokenizer, token_ids: list[int], step_s: float, max_num_seqs: int = 1024):
        from compiled_llm.serve.core.sequence import RequestMetrics

        self._metrics = RequestMetrics
        self.tokenizer = tokenizer
        self.token_ids = token_ids
        self.step_s = step_s
        self.max_num_seqs = max_num_seqs
        self.scheduler = SimpleNamespace(waiting=collections.deque(), running=[], num_preemptions=0)
        self.block_manager = SimpleNamespace(num_free_blocks=1 << 16, num_blocks=1 << 16,
                                             stats=SimpleNamespace(queried_tokens=0, hit_tokens=0))
        self.stats = SimpleNamespace(prefill_tokens=0, generated_tokens=0, steps=0, prefill_steps=0, prefill_s=0.0,
                                     decode_steps=0, decode_s=0.0)
        self.speculator = None
        self.failed_request_ids: list[str] = []
        self._started = 0

    def info(self):
        """What the engine process reports when ready (``EngineInfo.of`` reads a real engine's
        model)."""
        from compiled_llm.serve.engine_process.engine_messages import EngineInfo

        return EngineInfo(name="stand-in", vocab_size=self.tokenizer.vocab_size, max_model_len=1 << 16, block_size=16,
                          num_blocks=self.block_manager.num_blocks, max_num_seqs=self.max_num_seqs,
                          generation_defaults={}, device="cpu")

    def add_request(self, _prompt, request_id: str, stream: bool, _validated) -> None:
        _, ids, params = _validated
        self.stats.prefill_tokens += len(ids)
        self._started += 1
        self.scheduler.waiting.append(_Request(request_id, params.max_tokens, start=self._started * 7))

    def abort_request(self, request_id: str):
        sched = self.scheduler
        sched.waiting = collections.deque(r for r in sched.waiting if r.request_id != request_id)
        sched.running = [r for r in sched.running if r.request_id != request_id]
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def step_deltas(self) -> list[tuple]:
        time.sleep(self.step_s)
        sched, cycle = self.scheduler, self.token_ids
        while sched.waiting and len(sched.running) < self.max_num_seqs:
            sched.running.append(sched.waiting.popleft())
        deltas, still = [], []
        for r in sched.running:
            token = cycle[(r.start + r.generated) % len(cycle)]
            r.generated += 1
            done = r.generated >= r.max_tokens
            deltas.append((r.request_id, done, self._metrics(time.perf_counter()) if done else None, None,
                           [(0, "", [token], "length" if done else None, None, None, None)]))
            if not done:
                still.append(r)
        sched.running = still
        self.stats.steps += 1
        self.stats.decode_steps += 1
        self.stats.generated_tokens += len(deltas)
        return deltas


def load_stand_in(tokenizer_dir: str, step_s: float) -> StandInEngine:
    """The engine process's loader (picklable: the spawned process imports this file). The
    process reports the stand-in's own ``info``."""
    from compiled_llm.model.tokenizer.loader import load_tokenizer
    from compiled_llm.serve.engine_process import engine_messages

    engine_messages.EngineInfo.of = classmethod(lambda cls, engine: engine.info())

    tokenizer = load_tokenizer(tokenizer_dir)
    text = " ".join(open(__file__).read().split())  # English words, code and punctuation
    return StandInEngine(tokenizer, tokenizer.encode(text), step_s)


def serve_stand_in(tokenizer_dir: str, step_s: float, count: int, port: int) -> None:
    """The server's process: ``compiled-llm serve``'s path for ``count`` API servers, over the
    stand-in engine."""
    from compiled_llm.cli.main import configure_logging
    from compiled_llm.serve.engine_process.engine_core_client import EngineCoreClient
    from compiled_llm.serve.openai.api_server import serve
    from compiled_llm.serve.openai.api_servers import serve_api_servers
    from compiled_llm.serve.server_config import ServerConfig

    configure_logging()
    config = ServerConfig(port=port, api_server_count=count, max_waiting_requests=1 << 16,
                          log_stats_interval=3600.0)
    load = functools.partial(load_stand_in, tokenizer_dir, step_s)
    if count == 1:
        sys.exit(serve(EngineCoreClient.start_process(load), config, "stand-in"))
    sys.exit(serve_api_servers([load], config, "stand-in", setup=configure_logging))


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(c) for c in open(f"/proc/{pid}/task/{task}/children").read().split()]
        except OSError:
            pass
    return out


def process_cpu(pid: int) -> dict[int, float]:
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for p in [pid, *_children(pid)]:
        try:
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[p] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def one_run(tokenizer_dir: str, count: int, streams: int, tokens: int, step_s: float, client_processes: int) -> dict:
    from compiled_llm.cli.bench.load_generator import run_clients, send_times, split_load
    from compiled_llm.cli.bench.server_launcher import _wait_healthy, Server
    from compiled_llm.cli.bench.serving import completion_body
    from compiled_llm.cli.bench.serving_report import summarize

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    server = ctx.Process(target=serve_stand_in, args=(tokenizer_dir, step_s, count, port))
    server.start()
    try:
        _wait_healthy(Server(SimpleNamespace(poll=lambda: server.exitcode, returncode=server.exitcode),
                             f"http://127.0.0.1:{port}", Path(os.devnull)), 120.0)
        time.sleep(3.0)  # every API server up
        url = f"http://127.0.0.1:{port}"
        warm = [completion_body("stand-in", [1, 2, 3], 4) for _ in range(8)]
        run_clients(split_load(url, warm, [3] * 8, [0.0] * 8, 1))
        bodies = [completion_body("stand-in", [1, 2, 3], tokens) for _ in range(streams)]
        before = process_cpu(server.pid)
        t0 = time.perf_counter()
        reports = run_clients(split_load(url, bodies, [3] * streams, send_times(streams, math.inf), client_processes))
        wall = time.perf_counter() - t0
        after = process_cpu(server.pid)
    finally:
        os.kill(server.pid, 15)
        server.join(60)
    records = [r for rep in reports for r in rep.records]
    failed = [r.error for r in records if not r.ok]
    out_tokens = sum(r.output_tokens for r in records if r.ok)
    chunks = sum(r.chunks for r in records)
    return {
        "api_server_count": count, "streams": streams, "failed": len(failed), "wall_s": round(wall, 2),
        "output_tok_s": round(out_tokens / wall), "chunks_s": round(chunks / wall),
        "tokens_per_chunk": round(out_tokens / max(chunks, 1), 2),
        **{k: round(v) for k, v in summarize(records, wall).items() if k in ("ttft_ms_p50", "ttft_ms_p99", "e2e_ms_p50")},
        # the busiest server process (an API server, when they are the limit) and the client's
        "server_busiest_cpu": round(max(after[pid] - before.get(pid, 0.0) for pid in after) / wall, 2),
        "server_cpu_s": round(sum(after[pid] - before.get(pid, 0.0) for pid in after), 2),
        "client_cpu_s": round(sum(rep.cpu_s for rep in reports), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tokenizer", help="a transformers tokenizer directory")
    parser.add_argument("--api-server-count", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=2.0)
    parser.add_argument("--client-processes", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    for _ in range(args.repeat):
        for count in args.api_server_count:
            print(json.dumps(one_run(args.tokenizer, count, args.streams, args.tokens, args.step_ms / 1e3,
                                     args.client_processes)), flush=True)


if __name__ == "__main__":
    main()
