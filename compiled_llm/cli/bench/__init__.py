"""`compiled-llm bench ENGINE_DIR --workload latency|throughput|prefill|coldstart|all|serving`: the
project's workloads (``workloads.py``, ``coldstart.py``) on a built engine, with Hugging Face
transformers measured in the same run (built from the engine's source config with random
weights; for an engine built with ``--quantization``, the latency workload also with torchao's
weight-only quantization of that scheme, ``torchao_peer.py``) and one table comparing them;
``serving`` (``serving.py``, with its client ``sse_client.py``, ``load_generator.py``, server
``server_launcher.py`` and table ``serving_report.py``) times ``compiled-llm serve`` from a client
process against offline generation instead, or, with ``--dataset-name prefix_repetition``
(``prefix_repetition.py``), servers of one and N replicas under each routing against one
another (``routing_comparison.py``). Results are recorded in BENCHMARKS.md."""

from __future__ import annotations

import argparse

from compiled_llm.cli.engine_args import (add_build_arguments, add_engine_arguments, build_config, build_options,
                                          engine_options)
from compiled_llm.cli.run import BUILD_GROUP

# plain Python (no torch): the parser's choices and defaults
from compiled_llm.cli.bench.prefix_repetition import DATASETS, USERS_PER_PREFIX, PrefixRepetition

PREFIX_REPETITION_OPTIONS = ("prefix_len", "suffix_len", "num_prefixes", "output_len")


def add_parser(subparsers):
    p = subparsers.add_parser(
        "bench",
        help="benchmark an engine on the latency / throughput / prefill workloads (vs HF transformers)",
        description="Run the benchmark workloads on ENGINE_DIR and, unless --no-hf, the same workloads "
                    "on Hugging Face transformers in the same run; print one table. latency: batch 1, a "
                    "128-token prompt, 256 greedy tokens; throughput: 256 requests with prompt and output "
                    "lengths uniform in 100..1024, temperature 0.6; prefill: one 1024-token prompt; "
                    "coldstart: fresh processes from start to first token; serving (not part of all): "
                    "'compiled-llm serve' in a subprocess under the throughput requests, streamed from a "
                    "client at --request-rate, against offline generation in the same run; serving with "
                    "--dataset-name prefix_repetition: shared-prefix requests against DP=1 and, with "
                    "--data-parallel-size N, N replicas routed prefix-aware and round-robin, with their "
                    "prefix-cache hit rates. With --data-parallel-size N the latency, throughput and prefill "
                    "workloads run over N engine replicas (LLM(data_parallel_size=N)).",
    )
    p.add_argument("engine", metavar="ENGINE_DIR",
                   help="an engine directory made by 'compiled-llm build', or a model source (built into the "
                        "engine cache on first use)")
    p.add_argument("--workload", choices=("latency", "throughput", "prefill", "coldstart", "structured", "all",
                                          "serving"),
                   default="all",
                   help="which workload to run (default all); coldstart times fresh processes from start to "
                        "first token (ours and transformers') and a fresh build; serving starts a server "
                        "and is not part of all; structured runs the latency and throughput workloads under JSON schemas against the same engine unconstrained, and times grammar compiles")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face transformers peer")
    p.add_argument("--num-requests", type=int, metavar="N",
                   help="requests of the throughput and serving workloads (default 256; prefix_repetition: "
                        f"{USERS_PER_PREFIX} per prefix)")
    serving = p.add_argument_group("serving workload")
    serving.add_argument("--request-rate", action="append", type=_rate, metavar="R",
                         help="requests per second, sent at Poisson-distributed times, or inf (the default): "
                              "all at once; repeat to run several rates against one server")
    serving.add_argument("--max-input-len", type=int, default=1024, metavar="N",
                         help="prompt lengths are drawn in 100..N (default 1024)")
    serving.add_argument("--max-output-len", type=int, default=1024, metavar="N",
                         help="max_tokens are drawn in 100..N (default 1024)")
    serving.add_argument("--served-model-name", metavar="NAME",
                         help="the model name the server answers to (default: the server's own)")
    serving.add_argument("--dataset-name", choices=DATASETS, default="random",
                         help="random (the default): the throughput workload's requests; prefix_repetition "
                              "(vLLM's): --prefix-repetition-num-prefixes shared prefixes, each the start of "
                              "num-requests / num-prefixes prompts with a suffix of their own, shuffled; with "
                              "--data-parallel-size N it compares DP=1 (N x --num-blocks), N replicas under "
                              "--load-balance-method prefix_aware and under round_robin, in one table")
    for name, default, what in (("prefix-len", PrefixRepetition.prefix_len, "tokens of each shared prefix"),
                                ("suffix-len", PrefixRepetition.suffix_len, "tokens of each request's own suffix"),
                                ("num-prefixes", PrefixRepetition.num_prefixes, "shared prefixes"),
                                ("output-len", PrefixRepetition.output_len, "tokens each request generates")):
        serving.add_argument(f"--prefix-repetition-{name}", type=int, metavar="N",
                             help=f"prefix_repetition: {what} (default {default})")
    serving.add_argument("--client-processes", type=int, metavar="N",
                         help="client processes sending the requests (default 1 on a CPU; on a GPU half the "
                              "cores, up to 8: one process reads about 20k chunks/s)")
    serving.add_argument("--api-server-count", type=int, metavar="N",
                         help="the server's --api-server-count: HTTP processes streaming the responses "
                              "(default: serve's, 1)")
    add_build_arguments(p.add_argument_group("build", BUILD_GROUP), for_source=True)
    add_engine_arguments(p.add_argument_group("engine options"))
    p.add_argument("--no-cuda-graphs", dest="enforce_eager", action="store_true",
                   help=argparse.SUPPRESS)  # the old name of --enforce-eager
    p.add_argument("--json", action="store_true", help="print the results as one JSON list instead of a table")
    p.set_defaults(handler=run)


def _rate(text: str) -> float:
    from compiled_llm.cli.bench.serving import parse_rate
    from compiled_llm.errors import InvalidOptionError

    try:
        return parse_rate(text)
    except InvalidOptionError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def hf_config_of(llm) -> dict | None:
    """The config.json the engine was built from (preset or checkpoint), or None."""
    import json
    from pathlib import Path

    manifest = llm.model.manifest or {}
    source = manifest.get("source", {})
    if source.get("preset"):
        from compiled_llm.model.presets import preset_hf_config

        return preset_hf_config(source["preset"])
    model_dir = source.get("model_dir")
    if model_dir and (Path(model_dir) / "config.json").is_file():
        return json.loads((Path(model_dir) / "config.json").read_text())
    if not llm.model.is_engine:
        from compiled_llm.model.presets import is_preset, preset_hf_config

        if is_preset(llm.model.name):
            return preset_hf_config(llm.model.name)
        path = Path(llm.model.name) / "config.json"
        if path.is_file():
            return json.loads(path.read_text())
    return None


BENCH_MAX_MODEL_LEN = 4096


def run(args) -> int:
    from compiled_llm.engine.loader import is_engine_dir
    from compiled_llm.model.placement import resolve_device
    from compiled_llm.serve.llm import LLM

    from compiled_llm.cli.bench import workloads as wl

    prefix_shape = _prefix_repetition(args)  # bad values fail before anything loads
    if args.num_requests is None:
        args.num_requests = 256 if prefix_shape is None else USERS_PER_PREFIX * prefix_shape.num_prefixes
    workloads = (*wl.WORKLOADS, "coldstart", "structured") if args.workload == "all" else (args.workload,)
    config = build_config(args, for_source=True)  # bad values fail before anything loads
    if args.data_parallel_size > 1 and args.workload != "serving" and set(workloads) - set(wl.WORKLOADS):
        from compiled_llm.errors import InvalidOptionError

        what = "includes coldstart and structured, which measure" if args.workload == "all" else "measures"
        raise InvalidOptionError(f"--workload {args.workload} {what} one engine; with --data-parallel-size "
                                 f"{args.data_parallel_size} choose latency, throughput or prefill")
    device = resolve_device(config.device)
    engine = args.engine
    if not is_engine_dir(engine):  # a model source: its cached engine (so --enforce-eager still compiles)
        from compiled_llm.engine.cache import cached_engine
        from compiled_llm.serve.kernel_warmup import warm_kernels

        engine = str(cached_engine(engine, config, warm_up=warm_kernels))
    if args.max_model_len is None:
        # the workloads' longest sequence is 2,048 tokens: a shorter limit than a model's keeps
        # the block tables (and the graphs' inputs) small
        from compiled_llm.engine.artifact import build_config as built_with, read_manifest

        args.max_model_len = min(BENCH_MAX_MODEL_LEN, built_with(read_manifest(engine)).max_model_len)
    if args.workload == "serving":
        return _run_serving(args, engine, device, prefix_shape)
    cold = []
    if "coldstart" in workloads:  # first: its fresh processes need the device to themselves
        from compiled_llm.cli.bench import coldstart

        cold = coldstart.measure(engine, device.type, with_hf=not args.no_hf)
        workloads = tuple(w for w in workloads if w != "coldstart")
        if not workloads:
            _print_results(args, cold, device, None, coldstart.format_table(cold))
            return 0
    llm = LLM(engine, **{**build_options(args, for_source=True), "device": device}, **engine_options(args))
    results = []
    structured = []
    if "structured" in workloads:  # its peer is the same engine unconstrained, measured in it
        from compiled_llm.cli.bench.structured import run_structured

        structured = run_structured(llm, args.num_requests)
        workloads = tuple(w for w in workloads if w != "structured")
    for w in workloads:
        if w == "throughput":
            results.append(wl.compiled_throughput(llm, args.num_requests))
        else:
            results.extend(wl.run_compiled(llm, (w,)))
    hf_cfg = None if args.no_hf else hf_config_of(llm)
    dtype = llm.model.dtype
    scheme = llm.model.build_config.quantization if llm.model.is_engine else None
    llm.shutdown()  # a tensor-parallel engine's workers, or the data-parallel replicas, end here
    del llm  # free the engine's memory for the peer
    if hf_cfg is not None:
        import gc

        import torch

        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        from compiled_llm.cli.bench import hf_child

        for w in workloads:  # each in a child process of its own
            results.append(hf_child.run_hf_child(hf_cfg, dtype, device, w, args.num_requests))
        if scheme and "latency" in workloads:  # a quantized engine: torchao's same scheme too
            results.append(hf_child.run_torchao_child(hf_cfg, dtype, device, scheme))
    table = wl.format_table(results)
    if structured:
        from compiled_llm.cli.bench.structured import format_table as structured_table

        table = (table + "\n\n" if results else "") + structured_table(structured)
        results += structured
    if cold:
        from compiled_llm.cli.bench import coldstart

        table += "\n\n" + coldstart.format_table(cold)
    _print_results(args, cold + results, device, dtype, table)
    if not args.json and not args.no_hf and hf_cfg is None:
        print("hf: skipped (the engine records no preset or checkpoint config to build it from)")
    return 0


def _prefix_repetition(args):
    """The prefix_repetition dataset's shape from the flags, or None under the random dataset
    (where its flags are refused)."""
    from compiled_llm.errors import InvalidOptionError

    given = {name: getattr(args, f"prefix_repetition_{name}") for name in PREFIX_REPETITION_OPTIONS}
    given = {name: value for name, value in given.items() if value is not None}
    if args.dataset_name != "prefix_repetition":
        if given:
            flags = ", ".join(f"--prefix-repetition-{name.replace('_', '-')}" for name in given)
            raise InvalidOptionError(f"{flags} apply to --dataset-name prefix_repetition only")
        return None
    if args.workload != "serving":
        raise InvalidOptionError("--dataset-name prefix_repetition is a dataset of --workload serving")
    return PrefixRepetition(**given)


def _run_serving(args, engine: str, device, prefix_shape) -> int:
    import math

    from compiled_llm.cli.bench import serving, serving_report

    options = serving.ServingOptions(
        request_rates=tuple(args.request_rate or (math.inf,)), num_requests=args.num_requests,
        max_input_len=args.max_input_len, max_output_len=args.max_output_len,
        served_model_name=args.served_model_name,
        client_processes=args.client_processes or serving.default_client_processes(device.type),
        prefix_repetition=prefix_shape, api_server_count=args.api_server_count)
    if prefix_shape is not None:
        from compiled_llm.cli.bench.routing_comparison import run_routing_comparison

        results = run_routing_comparison(engine, device, engine_options(args), options)
    else:
        results = serving.run_serving(engine, device, engine_options(args), options)
    dtype = next((r.extra["dtype"] for r in results if "dtype" in r.extra), None)
    _print_results(args, results, device, dtype, serving_report.format_table(results))
    return 0


def _print_results(args, results, device, dtype, table: str) -> None:
    import dataclasses
    import json

    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
        return
    replicas = f", {args.data_parallel_size} data-parallel replicas" if args.data_parallel_size > 1 else ""
    print(f"{args.engine} on {device.type}" + (f", {str(dtype).removeprefix('torch.')}" if dtype else "") + replicas)
    print(table)
