"""torch.cuda's stream and graph calls ``StepGraphs`` makes, as CPU no-ops, for the CPU tests
of graph capture: a graph "replays" by counting, and records the mode it was captured in.

    @pytest.fixture
    def fake_cuda(monkeypatch):
        use_fake_cuda(monkeypatch)
"""

from __future__ import annotations

import contextlib

import torch


class FakeGraph:
    replays = 0
    capture_modes: list[str] = []  # each capture's capture_error_mode, in order

    def capture_begin(self, pool=None, capture_error_mode="global"):
        FakeGraph.capture_modes.append(capture_error_mode)

    def capture_end(self):
        pass

    def replay(self):
        FakeGraph.replays += 1


class FakeStream:
    def __init__(self, device=None):
        pass

    def wait_stream(self, other):
        pass


def use_fake_cuda(monkeypatch) -> None:
    FakeGraph.replays = 0
    FakeGraph.capture_modes = []
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
