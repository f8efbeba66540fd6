"""An Inductor engine carries its compiled result: a load in a fresh process with an empty
Inductor cache hits the engine's saved cache and compiles nothing (CPU here; the GPU check is
benchmarks/gpu_build_check.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from compiled_llm.build import build_engine

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import json, sys
sys.path.insert(0, {bench!r})
from gpu_build_check import load_once
print(json.dumps(load_once({engine!r})))
"""


def test_fresh_process_load_compiles_nothing(tmp_path):
    engine = tmp_path / "engine"
    build_engine("tiny-qwen2", engine, dtype="float32", device="cpu", backend="inductor", progress=False)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "empty_inductor_cache")}
    code = CHILD.format(bench=str(ROOT / "benchmarks"), engine=str(engine))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["backend"] == "inductor"
    assert report["fxgraph_hit"] > 0
    assert report["fxgraph_miss"] == 0, report
