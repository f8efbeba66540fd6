"""Run a small Python script as the ranks of a torch.distributed group, each its own process
(argv: rank, the group's file store, then the caller's arguments), with this tree importable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_ranks(tmp_path: Path, source: str, *args: str, world: int = 2, timeout: float = 60) -> list[tuple[int, str]]:
    """(exit status, output) of each rank; none is left running."""
    script = tmp_path / "rank.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(tmp_path / "store"), *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(world)]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, out) for p, out in zip(procs, outs)]
