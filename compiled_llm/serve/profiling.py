"""``--profile DIR``: a torch.profiler chrome trace of the run, with the engine's steps labelled
schedule / forward / sample, and on a GPU a CUDA memory snapshot (open it at
https://pytorch.org/memory_viz)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

TRACE_FILE = "trace.json"
MEMORY_FILE = "memory_snapshot.pickle"


@contextlib.contextmanager
def profile_engine(out_dir: str | Path | None, engine, device: torch.device):
    if out_dir is None:
        yield
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.device(device).type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    engine.set_profile_labels(True)
    try:
        with torch.profiler.profile(activities=activities) as prof:
            yield
    finally:
        engine.set_profile_labels(False)
    prof.export_chrome_trace(str(out / TRACE_FILE))
    written = [out / TRACE_FILE]
    if cuda:
        torch.cuda.memory._dump_snapshot(str(out / MEMORY_FILE))
        torch.cuda.memory._record_memory_history(enabled=None)
        written.append(out / MEMORY_FILE)
    print("profile: " + ", ".join(str(p) for p in written), file=sys.stderr)
