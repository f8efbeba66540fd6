"""Executors: how rank 0's engine reaches the other tensor-parallel ranks.

The scheduler, the sampler and every request's state live once, in the engine (rank 0). Each
device operation that runs the program (a step, the KV-sizing step, a graph capture) is first
sent to the other ranks, which run the same operation on their own weights and KV cache; the
collectives inside the program (``graph/collective_ops.py``) meet there. An executor is that
channel and the life of the ranks behind it:

    send(method, *args)          have every other rank call ``RankWorker.<method>(*args)``, in order
    ask(method, *args)           the same, and wait for their results, rank 1 first
    run_on_ranks(fn, *args,      have every other rank call ``fn(model, state, *args)``, in the same
                 wait=True)      order: its ``LoadedModel`` and a dict it keeps for such functions;
                                 returns their results, rank 1 first (``wait=False``: returns at once,
                                 for a function that meets rank 0 in a collective)
    check()                      raise ``EngineError`` if a rank has failed (naming it)
    shutdown()                   stop every rank; no process is left behind

``send`` is the runtime's own channel; ``run_on_ranks`` is for callers that drive the ranks
themselves (``compiled-llm compare`` rebuilds a rank's program and runs steps into a
scratch KV cache), with functions of their own: ``fn`` must be picklable by name (a module-level
function), and raising in it fails the ranks as a dying rank does, named.

A pipelined engine's ranks are its stages' TP ranks, stage-major (rank 0 is stage 0's first):
every rank runs every step, and each stage's program receives its inputs from the stage before
and sends its outputs on (``engine/pipeline_stage.py``); each stage's collectives run over a
group of its own.

The engine option ``distributed_executor_backend`` (vLLM's name) picks one:

- ``mp``: ``multiproc.MultiprocExecutor`` runs the ranks as processes of this host
  (torch.distributed over NCCL on CUDA and gloo on CPU, through a file store).
- ``ray``: ``ray_executor.RayExecutor`` runs them as Ray actors of the cluster this process
  joins, a placement group per pipeline stage (each on one node; stage 0's on this process's);
  torch.distributed meets through a TCP store that rank 0 hosts. Ray is an optional extra,
  imported by the Ray modules alone, and only once such an executor starts.

Nothing in the engine or the runner tells them apart.
"""
