"""The runtime: paged KV cache with prefix caching, continuous batching, CUDA graphs per step
bucket, on-device sampling, the ``LLM`` API and the OpenAI-compatible server.

Where things run, and where to find them (vLLM v1's rooms):

    llm.py, sampling_params.py, outputs.py, engine_config.py   the API: LLM, its options, its types
    llm_engine.py      the engine: one step = schedule (core/) -> run (worker/, executor/) -> outputs
    engine_loop.py     the thread that drives an in-process engine for ``LLM``
    core/              host scheduling: scheduler, block manager, sequences, validation,
                       detokenizer, n-gram speculation
    worker/            the device side of a step: model runner, CUDA graphs, KV cache, sampler
    executor/          how rank 0 reaches the other ranks (tensor parallel, pipeline stages):
                       processes of this host, or Ray actors (``--distributed-executor-backend ray``)
    engine_process/    the engine in a process of its own, and its clients: the HTTP side's
                       (``serve``; data-parallel replicas local or Ray actors), and ``LLM``'s over
                       data-parallel replicas
    openai/            the HTTP server (FastAPI); its options and metrics are server_config.py
                       and metrics.py, here
    ray_serve/         the Ray Serve application: engine replicas behind one OpenAI endpoint,
                       routed by prompt prefix (Ray is an optional extra; only it,
                       executor/ray_executor.py and engine_process/ray_replicas.py import it)
    reference.py       the eager reference runtime (``run --eager``, tests)
    kernel_warmup.py   a build's kernel warm-up: the runtime run once over a new CUDA engine
    profiling.py       ``--profile``: a torch profiler trace of a run
"""
