"""CUDA graphs of whole steps, one per bucket, sharing one memory pool, each captured when its
bucket first runs.

Decode: a step of S sequences is padded to the next batch-size bucket with rows that write
nowhere (slot -1) and attend to nothing (seq_len 0), and replays that bucket's graph.
Prefill of one sequence: its T new tokens are padded to the next token-count bucket with rows
that belong to no sequence (past query_start_loc[-1], slot -1), so they write nowhere and no real
row sees them; launching a prefill op by op costs the host far more than the device's few ms.
Graphs read fixed input buffers, so the runner copies each step's inputs into them before
replay, and write fixed output buffers: the logits, or a pipeline stage's activations
(``pipeline_lanes.py``; a forward may return several tensors). A bucket runs eagerly once right
before its capture: a first call may compile (Triton) or allocate, neither of which may happen
inside a capture.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import time
import warnings
from typing import Callable

import torch
from torch import Tensor

from compiled_llm.errors import first_line


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


def _tensors(out: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return (out,) if isinstance(out, Tensor) else tuple(out)


def first_rows(out: Tensor | tuple[Tensor, ...], rows: int) -> Tensor | tuple[Tensor, ...]:
    """``out`` (a tensor or a tuple of them) cut to its first ``rows`` rows."""
    return out[:rows] if isinstance(out, Tensor) else tuple(o[:rows] for o in out)


@contextlib.contextmanager
def _syncs_raise():
    """CUDA operations that synchronise with the host raise inside (torch's sync debug mode,
    whose "prototype feature" notice is not for the user)."""
    mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


@dataclasses.dataclass(frozen=True)
class GraphsSummary:
    """What one set of graphs (``StepGraphs``) of a rank holds: its buckets, those captured, and
    whether a capture failed (every bucket eager) or ran out of memory (``eager_from`` and up)."""

    name: str
    buckets: tuple[int, ...]
    captured: tuple[int, ...]
    failed: bool
    eager_from: int | None


class StepGraphs:
    """Graphs by bucket, each captured the first time its bucket runs, so a load captures
    nothing before the first token. ``run(bucket, rows)`` replays (capturing first if needed).
    A capture that runs out of GPU memory leaves the bucket and every larger one to run eagerly
    (a larger step needs at least as much), with a warning, while the graphs of smaller buckets
    keep replaying: batch-1 decode, which graphs speed up most, never loses its graph to a
    large bucket. Any other capture failure switches the graphs off, with a warning, and every
    bucket runs eagerly."""

    def __init__(self):
        self.buckets: list[int] = []
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # what every graph writes: [rows of the largest bucket, ...] per output of the forward
        self.outputs: tuple[Tensor, ...] | None = None
        self._one_output = True  # the forward returns a tensor, not a tuple of them
        self.capture_s = 0.0
        self.pool = None
        self._forward: Callable[[int], Tensor] | None = None
        self._max_rows = 0
        self._device = None
        self.failed = False  # a capture failed: every bucket runs eagerly from then on
        self.eager_from: int | None = None  # smallest bucket whose capture ran out of memory
        self._stream = None  # side stream captures run on

    @property
    def enabled(self) -> bool:
        return self._forward is not None

    def bucket_for(self, num_seqs: int) -> int | None:
        i = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[i] if i < len(self.buckets) else None

    def prepare(self, buckets: list[int], forward: Callable[[int], Tensor | tuple[Tensor, ...]], max_rows: int, device,
                pool) -> None:
        """Graphs of ``forward(bucket)`` (which reads the static inputs of that bucket and
        returns its logits, or a tuple of tensors, each of at most ``max_rows`` rows) will be
        captured on first use, in the shared memory ``pool`` (``torch.cuda.graph_pool_handle()``)."""
        self.buckets = sorted(buckets)
        self._forward, self._max_rows, self._device, self.pool = forward, max_rows, device, pool

    def run(self, bucket: int, rows: int) -> Tensor | tuple[Tensor, ...]:
        """The first ``rows`` rows of what ``bucket``'s step returns on the inputs staged for it."""
        if self._forward is None:
            raise RuntimeError("StepGraphs.run before prepare")
        if not self.capture(bucket):
            return first_rows(self._forward(bucket), rows)
        self.graphs[bucket].replay()
        return first_rows(self.outputs[0] if self._one_output else self.outputs, rows)

    def capture(self, bucket: int) -> bool:
        """Capture ``bucket`` now unless it is; False when graphs are off, a capture failed, or
        the bucket is too large to capture (``eager_from``)."""
        if not self.enabled or self.failed:
            return False
        if bucket in self.graphs:
            return True
        return not self._too_large(bucket) and self._capture(bucket)

    def summary(self, name: str) -> GraphsSummary:
        return GraphsSummary(name, tuple(self.buckets), tuple(sorted(self.graphs)), self.failed, self.eager_from)

    def capture_all(self) -> bool:
        """Capture every bucket now (benchmarks do before they time). False when graphs are off
        or some bucket runs eagerly."""
        return self.enabled and all(self.capture(b) for b in self.buckets)

    def release(self) -> None:
        """Drop every captured graph; nothing runs through these graphs afterwards. A graph that
        captured an NCCL collective holds a reference on the communicator, and NCCL's teardown
        (``destroy_process_group``) waits until that graph is destroyed."""
        if self.graphs:
            torch.cuda.synchronize(self._device)
        self.graphs.clear()
        self.outputs = None
        self._forward = None

    def _capture(self, bucket: int) -> bool:
        t0 = time.perf_counter()
        device = self._device
        current = torch.cuda.current_stream(device)
        try:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            stream = self._stream
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                # One eager run first, on the staged inputs (its KV writes are the ones the
                # replay makes again): a first call may compile (Triton) or allocate, neither
                # of which may happen inside a capture. A step that synchronises with the host
                # cannot be captured: finding that out here, rather than by a failed capture,
                # keeps the failure from leaving the CUDA RNG in capture mode for the process.
                with _syncs_raise():
                    out = self._forward(bucket)
                if self.outputs is None:
                    self._one_output = isinstance(out, Tensor)
                    self.outputs = tuple(torch.empty((self._max_rows, *o.shape[1:]), dtype=o.dtype, device=device)
                                         for o in _tensors(out))
                del out
                # capture_begin/end rather than torch.cuda.graph(): that context manager also
                # collects garbage and empties the allocator's cache, which mid-run costs far
                # more than the capture itself
                g = torch.cuda.CUDAGraph()
                # Thread-local capture mode, not torch's default global one: in a multi-rank
                # engine other threads touch CUDA while this one captures. NCCL's watchdog
                # polls the events of the works in flight: the eager run above enqueued the
                # stage's collectives, and a later pipeline stage posted every lane's receive
                # before its first lane captures (``PipelineLanes.run``). Under global mode such
                # a query, or any unsafe call, from another thread is an error that breaks the
                # capture (whether torch's watchdog steps aside depends on its version).
                # Nothing else is enqueued on this thread until capture_end (the lanes post
                # and wait for their messages outside the capture), and thread-local mode still
                # refuses unsafe calls made here, the thread whose work the graph records.
                g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    for static, o in zip(self.outputs, _tensors(self._forward(bucket))):
                        static[: o.shape[0]].copy_(o)
                finally:
                    g.capture_end()
            current.wait_stream(stream)
            self.graphs[bucket] = g
        except torch.cuda.OutOfMemoryError as e:  # this bucket and larger ones run eagerly
            current.wait_stream(self._stream)  # the eager run's work (KV writes) comes first
            self._cap(bucket, e)
            return False
        except Exception as e:  # any other capture failure: run eagerly from now on
            self._disable(e)
            return False
        finally:
            self.capture_s += time.perf_counter() - t0
        return True

    def _too_large(self, bucket: int) -> bool:
        return self.eager_from is not None and bucket >= self.eager_from

    def _cap(self, bucket: int, error: Exception) -> None:
        """``bucket``'s capture ran out of memory: it and larger uncaptured buckets run eagerly."""
        self.eager_from = bucket if self.eager_from is None else min(self.eager_from, bucket)
        warnings.warn(f"CUDA graph capture of bucket {bucket} ran out of GPU memory: steps padded to "
                      f"{bucket} rows or more run eagerly, smaller ones keep their graphs ({first_line(error, limit=None)})",
                      RuntimeWarning, stacklevel=4)

    def _disable(self, error: Exception) -> None:
        self.failed = True
        self.graphs.clear()
        self.outputs = None
        try:
            torch.cuda.synchronize(self._device)
        except Exception:
            pass
        warnings.warn(f"CUDA graph capture failed, steps run eagerly: {first_line(error, limit=None)}", RuntimeWarning,
                      stacklevel=3)
