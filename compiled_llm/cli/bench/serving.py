"""The serving workload: ``compiled-llm serve`` under the throughput workload's requests, timed by
a client in another process, in the style of vLLM's serving benchmark.

One run:

1. offline reference: ``LLM.generate`` on the same requests in this process
   (``workloads.compiled_throughput``, the median of three runs); the LLM is then freed, since
   on a GPU the server must not find a second KV cache beside its own;
2. the server: ``compiled-llm serve ENGINE`` as a subprocess on a free 127.0.0.1 port, with the
   bench's engine options (and ``--api-server-count`` when given), warmed up with the workload's
   prompt lengths and every decode batch size up to the number of requests;
3. for each request rate: every request sent to ``/v1/completions`` with ``stream: true`` (token-id
   prompts, temperature 0.6, ``ignore_eos``), at a Poisson rate (exponential gaps from a seeded
   RNG) or all at once (``inf``). Each run's prompts are shifted by one token id from the
   previous run's, so the prefix cache cannot serve a run from an earlier one.

Per request: TTFT, from sending to the first chunk carrying a token; ITL, the gaps between token
chunks (per chunk, as vLLM counts it: a chunk may carry several tokens, as a server merges the
steps a slow reader missed); TPOT, (e2e - TTFT) / (output tokens - 1); e2e. Output tokens are the
server's ``usage`` count (``stream_options.include_usage``).

The client is an asyncio protocol per request, with its own HTTP/1.1 and SSE parsing, constant
work per byte (``sse_client.py``). A GPU server streams tens of thousands of chunks a second,
more than one Python process reads, so the client can run in several processes
(``client_processes``) whose records are merged (``load_generator.py``); each run reports the
chunks the client handled per CPU second, and warns when a client process was saturated.

With ``--dataset-name prefix_repetition`` the requests are that dataset's instead, and the run
compares servers rather than a server with offline generation (``routing_comparison.py``: DP=1
against N replicas routed prefix-aware and round-robin, with the prefix-cache hit rate of each).

This module is the workload; the server subprocess is ``server_launcher.py``'s, the figures and
the table ``serving_report.py``'s.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from compiled_llm.cli.bench.load_generator import ClientLoad, run_clients, send_times, split_load
from compiled_llm.cli.bench.prefix_repetition import PrefixRepetition
from compiled_llm.cli.bench.server_launcher import SERVER_START_TIMEOUT_S, launched_server, option_flags, served_model
from compiled_llm.cli.bench.serving_report import summarize
from compiled_llm.cli.bench.workloads import Result, compiled_throughput, throughput_requests
from compiled_llm.errors import CompiledLLMError, InvalidOptionError

logger = logging.getLogger("compiled_llm.cli.bench.serving")

TEMPERATURE = 0.6  # the throughput workload's
# a client process busier than this may have delayed its timestamps
CLIENT_SATURATED_CPU_FRACTION = 0.9
# The offline reference is the median of this many runs: on an H200 one run of the throughput
# workload varied from 38k to 50k tok/s between processes, enough to swing vs_offline by 0.3
OFFLINE_RUNS = 3


@dataclass(frozen=True)
class ServingOptions:
    """What one ``bench --workload serving`` run sends."""

    request_rates: tuple[float, ...] = (math.inf,)
    num_requests: int = 256
    max_input_len: int = 1024
    max_output_len: int = 1024
    served_model_name: str | None = None
    client_processes: int = 1
    api_server_count: int | None = None  # the server's --api-server-count; None: serve's default
    seed: int = 0
    # the prefix_repetition dataset's shape (``prefix_repetition.py``); None: the throughput
    # workload's requests (lengths drawn up to max_input_len / max_output_len)
    prefix_repetition: PrefixRepetition | None = None

    def __post_init__(self):
        if not self.request_rates or any(not r > 0 for r in self.request_rates):
            raise InvalidOptionError(f"request rates must be > 0 (inf: all at once), got {list(self.request_rates)}")
        if self.num_requests < 1:
            raise InvalidOptionError(f"num_requests must be >= 1, got {self.num_requests}")
        # the throughput workload draws lengths uniform in 100..max
        if self.max_input_len < 100 or self.max_output_len < 100:
            raise InvalidOptionError(
                f"max_input_len and max_output_len must be >= 100 (lengths are drawn in 100..max), "
                f"got {self.max_input_len} and {self.max_output_len}")
        if self.client_processes < 1:
            raise InvalidOptionError(f"client_processes must be >= 1, got {self.client_processes}")
        if self.prefix_repetition is not None:
            self.prefix_repetition.users(self.num_requests)  # a whole number of requests per prefix
        if self.api_server_count is not None and self.api_server_count < 1:
            raise InvalidOptionError(f"api_server_count must be >= 1, got {self.api_server_count}")


def parse_rate(text: str) -> float:
    """A request rate in requests/s: a positive number, or ``inf`` (all at once)."""
    try:
        rate = float(text)
    except ValueError:
        raise InvalidOptionError(f"request rate must be a number or inf, got {text!r}") from None
    if not rate > 0:
        raise InvalidOptionError(f"request rate must be > 0, got {text!r}")
    return rate


def default_client_processes(device_type: str) -> int:
    """One client process on a CPU (the server is slow and the cores are few). On a GPU, enough
    to read a fast server's stream without a saturated reader delaying its own timestamps: one
    process read 20-23k single-event chunks per CPU second on an H200's host, and a GPU server
    streams up to ~45k; half the cores, up to 8, leaving the rest to the server."""
    if device_type == "cpu":
        return 1
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def shifted(prompts: Sequence[Sequence[int]], shift: int, vocab: int) -> list[list[int]]:
    """The prompts with every id moved by ``shift`` (mod ``vocab``): the same lengths, but prompts
    the prefix cache has not seen."""
    return [[(t + shift) % vocab for t in p] for p in prompts]


def completion_body(model: str, prompt: Sequence[int], max_tokens: int) -> bytes:
    """The JSON body of one streamed /v1/completions request of the workload."""
    return json.dumps({
        "model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": TEMPERATURE,
        "ignore_eos": True, "stream": True,
        # continuous_usage_stats (vLLM's): a usage count in every chunk, so a chunk's tokens are
        # counted even when its text is empty (an incomplete UTF-8 sequence)
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }).encode()


def offline_reference(engine: str, device, engine_options: dict, options: ServingOptions) -> Result:
    """``LLM.generate`` on the workload in this process (the throughput workload's measurement,
    the median of ``OFFLINE_RUNS`` on one engine), then the LLM freed, CUDA's cached blocks
    included. It is one engine whatever ``data_parallel_size`` the server runs: ``vs_offline``
    of a server of N replicas is their speed-up over one."""
    import gc

    import torch

    from compiled_llm.serve.llm import LLM

    llm = LLM(engine, device=device, **{**engine_options, "data_parallel_size": 1})
    try:
        runs = [compiled_throughput(llm, options.num_requests, options.max_input_len, options.max_output_len,
                                    shift=2 * k) for k in range(OFFLINE_RUNS)]
        result = sorted(runs, key=lambda r: r.metrics["output_tok_s"])[len(runs) // 2]
        dtype = str(llm.model.dtype).removeprefix("torch.")
        vocab_size = llm.model.config.vocab_size
    finally:
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    speeds = " / ".join(f"{r.metrics['output_tok_s']:,.0f}" for r in runs)
    return Result("serving", "offline LLM.generate", result.metrics,
                  note=f"median of {len(runs)} runs ({speeds} tok/s); {result.note}",
                  extra={"dtype": dtype, "vocab_size": vocab_size})


def warm_up(base_url: str, model: str, prompts: Sequence[Sequence[int]], max_output_len: int,
            api_key: str | None = None) -> None:
    """Every prompt at once, the i-th with i + 1 new tokens, so that the decode batch shrinks one
    size at a time from all of them: the server runs the workload's prefill shapes and every
    decode batch size (capturing their CUDA graphs) before the timed runs."""
    n = len(prompts)
    max_tokens = [min(1 + i, max_output_len) for i in range(n)]
    bodies = [completion_body(model, p, m) for p, m in zip(prompts, max_tokens)]
    (report,) = run_clients([ClientLoad(base_url, tuple(bodies), tuple(len(p) for p in prompts),
                                        (0.0,) * n, api_key)])
    failed = [r.error for r in report.records if not r.ok]
    if failed:
        raise CompiledLLMError(f"{len(failed)} of {n} warm-up requests failed, the first with: {failed[0]}")


def serving_run(base_url: str, model: str, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                rate: float, options: ServingOptions, api_key: str | None = None) -> tuple[dict, dict]:
    """One timed run at ``rate``: (metrics, extra) with the client's load figures in extra."""
    bodies = [completion_body(model, p, m) for p, m in zip(prompts, max_tokens)]
    loads = split_load(base_url, bodies, [len(p) for p in prompts], send_times(len(prompts), rate, options.seed),
                       options.client_processes, api_key)
    reports = run_clients(loads)
    duration = max(r.end_time for r in reports) - min(r.start_time for r in reports)
    records = [rec for r in reports for rec in r.records]
    metrics = summarize(records, duration)
    errors = [r.error for r in records if not r.ok]
    if errors:
        logger.warning("%d of %d requests failed at rate %s, the first with: %s", len(errors), len(records), rate,
                       errors[0])
    chunks = sum(rec.chunks for rec in records)
    cpu = sum(r.cpu_s for r in reports)
    busiest = max(r.cpu_s / r.wall_s for r in reports if r.wall_s > 0) if reports else 0.0
    if busiest > CLIENT_SATURATED_CPU_FRACTION:
        logger.warning("a client process was busy %.0f%% of the run at rate %s: its timings may include its own "
                       "delays; use more --client-processes", 100 * busiest, rate)
    # the rate as text: --json must stay strict JSON, which has no inf
    extra = {"request_rate": rate_label(rate), "client_processes": len(reports), "client_chunks": chunks,
             "client_cpu_s": cpu, "client_chunks_per_cpu_s": chunks / cpu if cpu > 0 else 0.0,
             "client_busiest_cpu_fraction": busiest, "errors": errors[:5]}
    return metrics, extra


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def run_serving(engine: str, device, engine_options: dict, options: ServingOptions,
                start_timeout_s: float = SERVER_START_TIMEOUT_S) -> list[Result]:
    """The offline reference, then one server and a timed run per request rate (module docstring)."""
    offline = offline_reference(engine, device, engine_options, options)
    vocab = min(offline.extra["vocab_size"], 10_001)
    prompts, max_tokens = throughput_requests(options.num_requests, options.max_input_len, options.max_output_len,
                                              offline.extra["vocab_size"])
    rates = options.request_rates
    args = [*option_flags({"device": device.type, **engine_options}),
            # the whole workload may wait at once (rate inf): admission control must not refuse it
            "--max-waiting-requests", str(options.num_requests),
            "--max-waiting-prompt-tokens", str(sum(len(p) for p in prompts))]
    if options.served_model_name:
        args += ["--served-model-name", options.served_model_name]
    if options.api_server_count is not None:
        args += ["--api-server-count", str(options.api_server_count)]
    results = [offline]
    with launched_server(engine, args, start_timeout_s) as server:
        model = options.served_model_name or served_model(server.base_url)
        warm_up(server.base_url, model, shifted(prompts, len(rates), vocab), options.max_output_len)
        for k, rate in enumerate(rates):
            metrics, extra = serving_run(server.base_url, model, shifted(prompts, k, vocab), max_tokens, rate, options)
            metrics["vs_offline"] = metrics["output_tok_s"] / offline.metrics["output_tok_s"]
            results.append(Result("serving", f"compiled-llm serve, rate {rate_label(rate)}", metrics,
                                  note=f"{options.num_requests} requests, client {extra['client_processes']} "
                                       f"process(es), {extra['client_chunks_per_cpu_s']:,.0f} chunks per client "
                                       f"CPU s", extra=extra))
    return results
