"""StepGraphs' capture failures: a bucket whose capture runs out of GPU memory runs eagerly with
every larger one, while smaller buckets keep their graphs; any other failure switches graphs off.
Captures refuse unsafe CUDA calls on their own thread only: other threads (NCCL's watchdog
polling a pipeline stage's posted receives) may go on meanwhile.

The CPU tests stand in for torch.cuda's streams and graphs (a graph "replays" by counting); the
GPU test captures real graphs."""

from __future__ import annotations

import pytest
import torch
from helpers.fake_cuda import FakeGraph, use_fake_cuda

from compiled_llm.serve.worker.cuda_graphs import StepGraphs

BUCKETS = [1, 2, 4, 8, 16]
VOCAB = 5


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's stream and graph calls StepGraphs makes, as CPU no-ops."""
    use_fake_cuda(monkeypatch)


def _logits(bucket: int, device="cpu") -> torch.Tensor:
    return torch.arange(bucket * VOCAB, dtype=torch.float32, device=device).reshape(bucket, VOCAB) + bucket


def _graphs(forward, device="cpu") -> StepGraphs:
    g = StepGraphs()
    g.prepare(BUCKETS, forward, max(BUCKETS), torch.device(device), pool=None)
    return g


def _forward_out_of_memory_from(limit: int, calls: list, device="cpu"):
    def forward(bucket):
        calls.append(bucket)
        if bucket >= limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {bucket} GiB")
        return _logits(bucket, device)
    return forward


def test_out_of_memory_capture_leaves_that_bucket_and_larger_ones_eager(fake_cuda):
    calls = []
    graphs = _graphs(_forward_out_of_memory_from(8, calls))

    assert torch.equal(graphs.run(1, 1), _logits(1))  # captured (an eager run, then the capture)
    assert 1 in graphs.graphs and calls == [1, 1]

    calls.clear()
    with pytest.warns(RuntimeWarning, match=r"bucket 8 ran out of GPU memory.*8 rows or more run eagerly"):
        with pytest.raises(torch.cuda.OutOfMemoryError):
            graphs.run(8, 3)  # the eager fallback runs out of memory too, as the step itself would
    assert graphs.eager_from == 8 and not graphs.failed
    assert 8 not in graphs.graphs

    calls.clear()
    with pytest.raises(torch.cuda.OutOfMemoryError):
        graphs.run(16, 9)
    assert calls == [16], "a bucket past the one that ran out of memory runs eagerly, no capture tried"

    replays = FakeGraph.replays
    assert torch.equal(graphs.run(1, 1), _logits(1))
    assert FakeGraph.replays == replays + 1, "bucket 1 keeps replaying its graph"
    assert torch.equal(graphs.run(4, 3), _logits(4)[:3]) and 4 in graphs.graphs, "smaller buckets still capture"
    assert not graphs.capture_all() and sorted(graphs.graphs) == [1, 2, 4]


def test_captures_refuse_unsafe_calls_on_their_own_thread_only(fake_cuda):
    graphs = _graphs(lambda bucket: _logits(bucket))
    assert graphs.capture_all()
    assert FakeGraph.capture_modes == ["thread_local"] * len(BUCKETS)


def test_a_larger_bucket_captured_before_the_failure_keeps_its_graph(fake_cuda):
    calls = []
    limit = {"bucket": 99}

    def forward(bucket):
        calls.append(bucket)
        if bucket == limit["bucket"]:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return _logits(bucket)

    graphs = _graphs(forward)
    graphs.run(16, 16)
    limit["bucket"] = 4
    with pytest.warns(RuntimeWarning, match="bucket 4 ran out of GPU memory"):
        graphs.capture(4)
    assert graphs.eager_from == 4 and 16 in graphs.graphs
    replays = FakeGraph.replays
    assert torch.equal(graphs.run(16, 10), _logits(16)[:10]) and FakeGraph.replays == replays + 1


def test_any_other_capture_failure_switches_every_graph_off(fake_cuda):
    def forward(bucket):
        if bucket == 4:
            raise RuntimeError("operation not permitted when stream is capturing")
        return _logits(bucket)

    graphs = _graphs(forward)
    graphs.run(1, 1)
    with pytest.warns(RuntimeWarning, match="CUDA graph capture failed, steps run eagerly: operation not permitted"):
        with pytest.raises(RuntimeError):
            graphs.run(4, 4)
    assert graphs.failed and graphs.graphs == {}
    replays = FakeGraph.replays
    assert torch.equal(graphs.run(1, 1), _logits(1)) and FakeGraph.replays == replays, "bucket 1 runs eagerly now"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_out_of_memory_capture_on_a_gpu_keeps_the_smaller_graphs():
    device = torch.device("cuda")
    staged = torch.zeros(max(BUCKETS), VOCAB, device=device)
    calls = []

    def forward(bucket):
        calls.append(bucket)
        if bucket >= 8:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (the test's)")
        return staged[:bucket] * 2.0 + 1.0

    graphs = StepGraphs()
    graphs.prepare(BUCKETS, forward, max(BUCKETS), device, pool=torch.cuda.graph_pool_handle())
    staged.copy_(_logits(max(BUCKETS), device)[: max(BUCKETS)])
    assert torch.equal(graphs.run(2, 2), staged[:2] * 2 + 1)
    with pytest.warns(RuntimeWarning, match="bucket 8 ran out of GPU memory"):
        assert not graphs.capture(8)
    staged.add_(1.0)  # the graph reads the staged inputs when it replays
    calls.clear()
    assert torch.equal(graphs.run(2, 2), staged[:2] * 2 + 1) and calls == [], "bucket 2 replays its graph"
    assert torch.equal(graphs.run(4, 3), staged[:3] * 2 + 1) and 4 in graphs.graphs
    torch.cuda.synchronize()
    graphs.release()
