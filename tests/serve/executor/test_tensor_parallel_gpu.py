"""Tensor parallelism on two GPUs (NCCL): skipped unless two are visible.

- The custom all-reduce (triton_all_reduce, over symmetric memory) gives NCCL's bits, with and
  without the residual, eagerly and replayed in a CUDA graph, on both ranks; also for calls of
  changing sizes issued back to back, eagerly and as one graph.
- A TP=2 engine generates what the TP=1 engine does, with CUDA graphs and the custom
  all-reduce, with NCCL's only, and eagerly; and its shutdown ends (NCCL's teardown waits for
  every graph that captured one of its collectives, so the graphs must go first). Only the
  first TP engine of a process opens the custom all-reduce workspace.

Run on a machine with two GPUs:  python -m pytest -q tests/serve/executor/test_tensor_parallel_gpu.py
"""

from __future__ import annotations

import textwrap
import time

import pytest
import torch
from helpers.rank_processes import run_ranks

from compiled_llm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

# each rank: the custom kernel against NCCL on the same inputs (seeded per rank), bit for bit
_RANK_SCRIPT = textwrap.dedent("""
    import datetime, sys
    import torch, torch.distributed as dist
    from compiled_llm.kernels import triton_all_reduce as ar

    rank, store = int(sys.argv[1]), sys.argv[2]
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    assert ar.open_workspace(dev) is not None, "symmetric memory did not open"
    def nccl(x, r):
        y = x.clone()
        dist.all_reduce(y)
        return y if r is None else y + r
    for dtype in (torch.bfloat16, torch.float32):
        # grids of 1 to 128 blocks, one after another; a 2 MiB slot holds 256 bf16 rows of 4096
        for rows, hidden in ((1, 4096), (3, 896), (256, 4096), (8, 4096), (5, 3000), (64, 4096), (1, 896)):
            g = torch.Generator(device=dev).manual_seed(100 * rank + rows)
            x = torch.randn(rows, hidden, device=dev, generator=g).to(dtype)
            r = torch.randn(rows, hidden, device=dev, generator=g).to(dtype)
            if x.numel() * x.element_size() > ar.DEFAULT_CAPACITY:
                assert not ar.handles(x), (rows, hidden, dtype)
                continue
            assert ar.handles(x), (rows, hidden, dtype)
            for res in (None, r):
                assert torch.equal(ar.all_reduce(x, res), nccl(x, res)), ("eager", rows, hidden, dtype)
            # replayed: the same static input, fresh values each time
            static, out = x.clone(), None
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                out = ar.all_reduce(static, r)
            for i in range(20):
                static.copy_(torch.randn(rows, hidden, device=dev, generator=g).to(dtype))
                graph.replay()
                assert torch.equal(out, nccl(static, r)), ("graph", i, rows, hidden, dtype)
            del graph
    # back to back, with no NCCL call or host sync between them, as in a decode step, while the
    # grid changes from call to call: each call's parity and counters must hold on their own
    gen = torch.Generator(device=dev).manual_seed(rank)
    shapes = [(1, 4096), (256, 4096), (3, 896), (8, 4096), (1, 4096), (64, 4096), (5, 3000)] * 3
    xs = [torch.randn(shape, device=dev, generator=gen).bfloat16() for shape in shapes]
    rs = [torch.randn(shape, device=dev, generator=gen).bfloat16() for shape in shapes]
    outs = [ar.all_reduce(x, r) for x, r in zip(xs, rs)]
    for i, (x, r, out) in enumerate(zip(xs, rs, outs)):
        assert torch.equal(out, nccl(x, r)), ("back to back, eager", i, x.shape)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        outs = [ar.all_reduce(x, r) for x, r in zip(xs, rs)]
    for replay in range(5):
        for x in xs:
            x.copy_(torch.randn(x.shape, device=dev, generator=gen).bfloat16())
        graph.replay()
        for i, (x, r, out) in enumerate(zip(xs, rs, outs)):
            assert torch.equal(out, nccl(x, r)), ("back to back, graph", replay, i, x.shape)
    del graph
    torch.cuda.synchronize()
    ar.close_workspace(dev)
    dist.destroy_process_group()
    print("rank", rank, "equal")
""")


def test_custom_all_reduce_gives_nccls_bits_eagerly_and_in_a_graph(tmp_path):
    for rank, (status, out) in enumerate(run_ranks(tmp_path, _RANK_SCRIPT, timeout=300)):
        assert status == 0 and f"rank {rank} equal" in out, out[-3000:]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from compiled_llm.engine.build import build_engine

    out = {}
    for size in (1, 2):
        out[size] = tmp_path_factory.mktemp(f"tp{size}") / "engine"
        # fp32: the ranks' partial sums round differently from one GPU's whole sums, which in
        # bf16 can flip a near-tie of this random model's greedy choice
        build_engine("tiny-llama", out[size], dtype="float32", device="cuda", tensor_parallel_size=size,
                     progress=False)
    return out


def test_tp2_engines_generate_what_tp1_does_and_shut_down(engines):
    """One process, engine after engine: the first TP engine runs the custom all-reduce; one
    asked for NCCL's does not; nor does a later one (its rank 0 would rendezvous symmetric memory
    a second time, which torch before pytorch#196082's fix cannot match with fresh workers)."""
    from compiled_llm.kernels import triton_all_reduce

    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 60)), list(range(3, 270, 3))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, detokenize=False)

    def run(engine, **kw):
        """(tokens, graphs captured, custom all-reduce on) of one engine, which must then shut down in
        under 30 s."""
        llm = LLM(str(engine), gpu_memory_utilization=0.3, **kw)
        try:
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            executor = llm.engine.executor
            result = tokens, llm.stats.graphs_captured, executor is not None and executor.custom_all_reduce
        finally:
            t0 = time.monotonic()
            llm.shutdown()
        assert time.monotonic() - t0 < 30, "shutdown hung"
        return result

    want, _, _ = run(engines[1])
    fresh = triton_all_reduce.rendezvous_count() == 0
    got, graphs, custom = run(engines[2])
    assert got == want and graphs > 0 and custom == fresh
    made = triton_all_reduce.rendezvous_count()
    got, graphs, custom = run(engines[2], disable_custom_all_reduce=True)
    assert got == want and graphs > 0 and not custom
    got, graphs, custom = run(engines[2], enforce_eager=True)
    assert got == want and graphs == 0 and not custom
    assert triton_all_reduce.rendezvous_count() == made  # the later engines did not rendezvous again
