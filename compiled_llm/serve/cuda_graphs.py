"""CUDA graphs of whole steps, one per bucket, sharing one memory pool.

Decode: a step of S sequences is padded to the next batch-size bucket with rows that write
nowhere (slot -1) and attend to nothing (seq_len 0), and replays that bucket's graph.
Prefill of one sequence: its T new tokens are padded to the next token-count bucket with rows
that belong to no sequence (past query_start_loc[-1], slot -1), so they write nowhere and no real
row sees them; launching a prefill op by op costs the host far more than the device's few ms.
Graphs read fixed input buffers, so the runner copies each step's inputs into them before
replay. Every bucket runs eagerly once before any capture: a first call may compile (Triton) or
allocate, neither of which may happen inside a capture.
"""

from __future__ import annotations

import bisect
import time
import warnings
from typing import Callable

import torch
from torch import Tensor


def prefill_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    """Powers of two from ``smallest`` up to max_tokens (and max_tokens itself)."""
    out, t = [], smallest
    while t < max_tokens:
        out.append(t)
        t *= 2
    return out + [max_tokens] if max_tokens >= 1 else out


def decode_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, steps of 8 to 64, steps of 16 to 128, steps of 32 after, up to the max."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, 129, 16), *range(160, max_batch_size + 1, 32)]
    out = sorted({s for s in sizes if s <= max_batch_size} | {max_batch_size})
    return out


class StepGraphs:
    """Captured graphs by bucket; ``replay(bucket_for(n))`` runs the smallest bucket >= n."""

    def __init__(self):
        self.buckets: list[int] = []
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: Tensor | None = None  # [rows of the largest bucket, vocab], written by every graph
        self.capture_s = 0.0
        self.pool = None

    @property
    def enabled(self) -> bool:
        return bool(self.graphs)

    def bucket_for(self, num_seqs: int) -> int | None:
        i = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[i] if i < len(self.buckets) else None

    def capture(self, buckets: list[int], forward: Callable[[int], Tensor], device, pool=None) -> bool:
        """Warm and capture ``forward(bucket)`` (which reads the static inputs of that bucket
        and returns its logits). Returns False, with a warning, when capture fails: the
        runner then stays eager."""
        t0 = time.perf_counter()
        try:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for b in buckets:  # warm-up: compiles and first allocations outside capture
                    out = forward(b)
                    forward(b)
            torch.cuda.current_stream(device).wait_stream(stream)
            torch.cuda.synchronize(device)
            self.logits = torch.empty((max(out.shape[0], 1), out.shape[-1]), dtype=out.dtype, device=device)
            del out
            self.pool = pool
            # largest first: its activations set the pool size the smaller ones reuse
            for b in sorted(buckets, reverse=True):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    logits = forward(b)
                    self.logits[: logits.shape[0]].copy_(logits)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[b] = g
            torch.cuda.synchronize(device)
        except Exception as e:  # any capture failure: run eagerly instead
            self.graphs.clear()
            self.buckets = sorted(buckets)
            self.logits = None
            try:
                torch.cuda.synchronize(device)
            except Exception:
                pass
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            warnings.warn(f"CUDA graph capture failed, decode runs eagerly: {first}", RuntimeWarning, stacklevel=2)
            return False
        self.buckets = sorted(buckets)
        self.capture_s = time.perf_counter() - t0
        return True

    def replay(self, bucket: int, rows: int) -> Tensor:
        self.graphs[bucket].replay()
        return self.logits[:rows]


DecodeGraphs = StepGraphs  # the name the runner and tests have used
