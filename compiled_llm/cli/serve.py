"""`compiled-llm serve ENGINE|SOURCE`: an OpenAI-compatible HTTP server (``compiled_llm.serve.openai``).

The model loads as in ``run`` (a SOURCE is built into the engine cache on first use), in the
engine process the server starts (``serve.engine_process.engine_core``); the build options are ``BuildConfig``'s
fields, the server options ``ServerConfig``'s and the engine options ``EngineConfig``'s, all as
flags.

Unlike ``run``, which captures each CUDA graph when its bucket first runs (so that nothing stands
before the first token), the server captures all of them before it says ready, as vLLM's does: a
capture in the middle of serving stalls every running stream and the requests that arrive
meanwhile, and a server's start-up is paid once.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import time

from compiled_llm.cli.engine_args import (add_build_arguments, add_dataclass_arguments, add_engine_arguments,
                                          build_config, build_options, dataclass_options, engine_options)
from compiled_llm.cli.run import BUILD_GROUP
from compiled_llm.engine.build_config import BuildConfig
from compiled_llm.errors import InvalidOptionError
from compiled_llm.serve.server_config import API_KEY_VAR, ServerConfig

logger = logging.getLogger("compiled_llm.serve")


def add_parser(subparsers):
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (completions, chat, streaming, metrics)",
        description=(
            "Serve ENGINE|SOURCE over HTTP with OpenAI's API: POST /v1/completions, POST "
            "/v1/chat/completions (streamed with stream: true), GET /v1/models, GET /health, GET "
            "/metrics (Prometheus), GET /version, POST /tokenize and /detokenize. Listens on "
            "127.0.0.1 unless --host says otherwise. SIGTERM stops accepting requests, lets running "
            "ones finish for up to --shutdown-timeout seconds, and exits 0; if the engine process "
            "dies, running requests fail and the server exits 1 (with --data-parallel-size N, a dead "
            "replica's requests fail or start again elsewhere, and the server exits 1 when none is left). "
            "--api-server-count N runs N HTTP processes on the one port."
        ),
    )
    p.add_argument("source", metavar="ENGINE|SOURCE",
                   help="an engine directory made by 'compiled-llm build', or a model source (checkpoint "
                        "directory, preset, hub id) built into the engine cache on first use")
    add_build_arguments(p.add_argument_group("build", BUILD_GROUP), for_source=True)
    add_dataclass_arguments(p.add_argument_group("server"), ServerConfig)
    add_engine_arguments(p.add_argument_group("engine"))
    p.set_defaults(handler=run)


def server_config(args) -> ServerConfig:
    """The server options of the flags, the API key from $COMPILED_LLM_API_KEY when no flag gives one."""
    options = dataclass_options(args, ServerConfig)
    if options["api_key"] is None:
        options["api_key"] = os.environ.get(API_KEY_VAR) or None
    return ServerConfig(**options)


def load_engine(args, placement=None):
    """The engine process's loader: the model as ``run`` loads it, logging as this command does.
    A data-parallel replica first takes its share of the machine (``placement``, a
    ``dp_placement.ReplicaPlacement``: its GPUs, or on a CPU its torch threads)."""
    from compiled_llm.cli.main import configure_logging

    if placement is not None:
        placement.apply()
    from compiled_llm.cli.run import build_llm

    configure_logging()
    engine = build_llm(args).engine
    t0 = time.perf_counter()
    if engine.capture_cuda_graphs():
        logger.info("captured %d CUDA graphs in %.1f s", engine.stats.graphs_captured, time.perf_counter() - t0)
    return engine


def engine_cpus(api_servers: int) -> int:
    """The cores a CPU server's engine processes share: this process's, but one for each API
    server beyond the first (an engine's thread pool spins at its barriers, and stalls for
    whole time slices when another busy process takes one of its cores: a streaming API server
    does)."""
    return max(1, len(os.sched_getaffinity(0)) - (api_servers - 1))


def replica_loads(args, build: BuildConfig, api_servers: int = 1) -> list:
    """The loader of each data-parallel replica's engine process: the same engine, each replica
    an engine of its own (data_parallel_size 1) placed as ``dp_placement.replica_placements``
    says (its own GPUs, or on a CPU its share of the cores the API servers leave,
    ``engine_cpus``). Replicas that are Ray actors (the ray backend) are placed by the cluster,
    whatever the device: the GPU Ray gives each, or on a CPU the CPUs of its bundle
    (``ray_replicas.replica_cpu_placement``), not this machine's."""
    from compiled_llm.serve.engine_process.dp_placement import (check_replica_device, engine_world_size,
                                                                replica_placements)

    one = argparse.Namespace(**{**vars(args), "data_parallel_size": 1})
    if args.distributed_executor_backend == "ray":
        check_replica_device(build.device, args.data_parallel_size)
        return [functools.partial(load_engine, one) for _ in range(args.data_parallel_size)]
    ranks = engine_world_size(args.source, build, build_options(args, for_source=True))
    return [functools.partial(load_engine, one, placement)
            for placement in replica_placements(args.data_parallel_size, build.device, ranks, engine_cpus(api_servers))]


def api_server_engine_load(args, build: BuildConfig, api_servers: int):
    """The engine process's loader under several API servers without replicas: as the server of
    one loads it, but on a CPU with the cores the API servers leave (``engine_cpus``)."""
    from compiled_llm.model.placement import resolve_device
    from compiled_llm.serve.engine_process.dp_placement import engine_world_size, replica_placements

    if resolve_device(build.device).type != "cpu":
        return functools.partial(load_engine, args)
    ranks = engine_world_size(args.source, build, build_options(args, for_source=True))
    (placement,) = replica_placements(1, build.device, ranks, engine_cpus(api_servers))
    return functools.partial(load_engine, args, placement)


def run(args) -> int:
    from compiled_llm.cli.main import LOGGING_LEVEL_VAR
    from compiled_llm.serve.engine_config import EngineConfig
    from compiled_llm.serve.engine_process.dp_client import DataParallelClient
    from compiled_llm.serve.engine_process.engine_core_client import EngineCoreClient
    from compiled_llm.serve.openai.api_server import serve

    config = server_config(args)  # bad values fail before anything loads
    build = build_config(args, for_source=True)
    EngineConfig.from_options(engine_options(args))
    if config.api_server_count > 1 and args.data_parallel_size > 1 and args.distributed_executor_backend == "ray":
        raise InvalidOptionError("api_server_count > 1 runs local engine processes; it does not combine with "
                                 "--data-parallel-size N --distributed-executor-backend ray (replicas as Ray actors)")
    loads = replica_loads(args, build, config.api_server_count) if args.data_parallel_size > 1 else None
    if not os.environ.get(LOGGING_LEVEL_VAR):
        # a server's log is its output: the ready line and the stats lines show without a
        # terminal too, in the engine process as well (it reads the variable)
        os.environ[LOGGING_LEVEL_VAR] = "INFO"
        logging.getLogger("compiled_llm").setLevel(logging.INFO)
    if config.api_server_count > 1:
        from compiled_llm.cli.main import configure_logging
        from compiled_llm.serve.openai.api_servers import serve_api_servers

        if loads is not None:
            logger.info("starting %d data-parallel engine replicas (load balance: %s)", len(loads),
                        config.load_balance_method)
        loads = loads or [api_server_engine_load(args, build, config.api_server_count)]
        return serve_api_servers(loads, config, model_name=args.source, setup=configure_logging)
    if loads is None:
        core = EngineCoreClient.start_process(functools.partial(load_engine, args))
    elif args.distributed_executor_backend == "ray":
        from compiled_llm.serve.engine_process.dp_placement import engine_parallel_sizes
        from compiled_llm.serve.engine_process.ray_replicas import start_ray_replicas

        logger.info("starting %d data-parallel engine replicas as Ray actors (load balance: %s)", len(loads),
                    config.load_balance_method)
        sizes = engine_parallel_sizes(args.source, build, build_options(args, for_source=True))
        core = start_ray_replicas(loads, *sizes, build.device, config.load_balance_method)
    else:
        logger.info("starting %d data-parallel engine replicas (load balance: %s)", len(loads), config.load_balance_method)
        core = DataParallelClient.start_processes(loads, config.load_balance_method)
    return serve(core, config, model_name=args.source)
