"""Executors: how rank 0's engine reaches the other tensor-parallel ranks.

The scheduler, the sampler and every request's state live once, in the engine (rank 0). Each
device operation that runs the program (a step, the KV-sizing step, a graph capture) is first
sent to the other ranks, which run the same operation on their own weights and KV cache; the
collectives inside the program (``graph/collective_ops.py``) meet there. An executor is that
channel and the life of the ranks behind it:

    send(method, *args)   have every other rank call ``RankWorker.<method>(*args)``, in order
    check()               raise ``EngineError`` if a rank has failed (naming it)
    shutdown()            stop every rank; no process is left behind

``multiproc.MultiprocExecutor`` runs the ranks as processes of this host (torch.multiprocessing,
torch.distributed over NCCL on CUDA and gloo on CPU). A multi-node backend is one more file:
start a ``RankWorker`` per GPU of the other nodes (as Ray actors, say), rendezvous
torch.distributed through a TCP store that rank 0 hosts, and carry ``send`` over the actors'
calls; nothing in the engine or the runner changes.
"""
