"""The custom all-reduce (kernels/triton_all_reduce.py) against NCCL on the GPUs of one host.

    python benchmarks/all_reduce_bench.py [--world 2] [--rows 1 8 64 256] [--hidden 4096]

Each rank is a process (this one is rank 0). First every rank checks that the kernel gives the
bits of the ranks' x summed in rank order (NCCL's bits, with two ranks), with and without the
residual, bf16 and fp32. Then it times a chain of 64 all-reduces with the residual add, each fed
by the previous one (``x = all_reduce(x * 0.5) + r``), replayed in a CUDA graph, as a decode
step's chain of layers is:

- ``custom``: the kernel, residual fused;
- ``nccl``: what the op's reference does on GPUs, a copy out of the graph's buffer, NCCL's
  all-reduce, then the add;
- ``launch``: the scale-and-add alone, the floor every column pays.

Rank 0 prints one line per (rows, form) with microseconds per link; exit status 0 when every
rank's results were right (with two ranks, the chains' results also equal NCCL's).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

CHAIN = 64
REPLAYS = 50


def rank_order_sum(x: torch.Tensor) -> torch.Tensor:
    """The kernel's sum: every rank's x, added in rank order in fp32, rounded to x's dtype (with
    two ranks also NCCL's bits; with more, NCCL's ring adds in another order)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    total = torch.zeros_like(x, dtype=torch.float32)
    for part in parts:
        total += part.float()
    return total.to(x.dtype)


def check_bits(ar, device: torch.device, rank: int) -> int:
    """Calls whose result differs from the rank-ordered sum (sizes up to the workspace's slot)."""
    bad = 0
    for dtype in (torch.bfloat16, torch.float32):
        full_slot = ar.DEFAULT_CAPACITY // torch.empty((), dtype=dtype).element_size()
        for n in (4096, 7 * 4096 + 5, 64 * 4096 + 3, full_slot):
            for it in range(10):
                x = torch.randn(n, device=device, generator=torch.Generator(device=device).manual_seed(1000 * it + rank))
                r = torch.randn(n, device=device, generator=torch.Generator(device=device).manual_seed(it))
                x, r = x.to(dtype), r.to(dtype)
                want = rank_order_sum(x)
                if not (torch.equal(ar.all_reduce(x), want) and torch.equal(ar.all_reduce(x, r), want + r)):
                    bad += 1
    return bad


def chain_forms(ar, r: torch.Tensor) -> dict:
    def custom(x):
        for _ in range(CHAIN):
            x = ar.all_reduce(x * 0.5, r)
        return x

    def nccl(x):
        for _ in range(CHAIN):
            y = (x * 0.5).clone()
            dist.all_reduce(y)
            x = y + r
        return x

    def launch(x):
        for _ in range(CHAIN):
            x = x * 0.5 + r
        return x

    return {"custom": custom, "nccl": nccl, "launch": launch}


def time_in_graph(fn, x0: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(µs per link, the graph's output) of ``fn`` captured once and replayed; every rank calls
    it with the same ``fn`` at the same time."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(x0)  # warm-up outside the capture (compiles the kernel, opens NCCL's channels)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x0)
    torch.cuda.synchronize()
    dist.barrier()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(REPLAYS):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / REPLAYS / CHAIN * 1e6, out.clone()


def rank_main(rank: int, world: int, store: str, rows: list[int], hidden: int) -> int:
    from compiled_llm.kernels import triton_all_reduce as ar

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        if ar.open_workspace(device) is None:
            print(f"rank {rank}: no symmetric memory between these GPUs", flush=True)
            return 1
        bad = check_bits(ar, device, rank)
        print(f"rank {rank}: {bad} calls differ from the rank-ordered sum", flush=True)
        for T in rows:
            x0 = torch.randn(T, hidden, device=device, generator=torch.Generator(device=device).manual_seed(rank))
            r = torch.randn(T, hidden, device=device, generator=torch.Generator(device=device).manual_seed(7)) * 0.01
            x0, r = x0.bfloat16(), r.bfloat16()
            outs = {}
            for name, fn in chain_forms(ar, r).items():
                if name == "custom" and not ar.handles(x0):
                    continue
                us, outs[name] = time_in_graph(fn, x0)
                if rank == 0:
                    print(f"rows {T:4d} x {hidden} bf16  {name:7s} {us:7.2f} us per link", flush=True)
            if world == 2 and "custom" in outs and not torch.equal(outs["custom"], outs["nccl"]):
                bad += 1
                print(f"rank {rank}: rows {T}: the custom chain's result differs from NCCL's", flush=True)
        dist.barrier()
        torch.cuda.synchronize()
        ar.close_workspace(device)
        return int(bad > 0)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="ranks, one GPU each")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--store", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < args.world:
        print(f"needs {args.world} CUDA GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    if args.store:
        return rank_main(args.rank, args.world, args.store, args.rows, args.hidden)
    store = os.path.join(tempfile.mkdtemp(prefix="all_reduce_bench"), "store")
    peers = [subprocess.Popen([sys.executable, __file__, "--world", str(args.world), "--hidden", str(args.hidden),
                               "--rank", str(rank), "--store", store, "--rows", *map(str, args.rows)])
             for rank in range(1, args.world)]
    try:
        status = rank_main(0, args.world, store, args.rows, args.hidden)
        return max([status] + [p.wait(timeout=300) for p in peers])
    finally:
        for p in peers:
            p.kill()


if __name__ == "__main__":
    sys.exit(main())
