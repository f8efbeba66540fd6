"""benchmarks/tp_agreement.py on a tiny model trained on the CPU (tiny-qwen2 shapes, float32):
the sharded engine's greedy picks (2 gloo ranks), and the megakernel engine's (its schedule run by
the interpreter), are the unsharded per-op engine's at every position."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.tiny_trained import train_tiny

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("trained"), num_prompts=4)


def agreement(trained, *options: str) -> dict:
    # its own process, as it is run: a tensor-parallel engine starts the process's group
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "tp_agreement.py"), str(trained), "--device", "cpu",
                           "--prompts", "4", "--tokens", "16", *options], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    assert proc.stdout.strip(), proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and report["pass"]
    assert report["steps"] == 4 * 16
    assert report["agree"] == report["steps"] and report["identical"] == 4
    return report


def test_two_ranks_agree_with_one_at_every_position(trained):
    assert agreement(trained)["tensor_parallel_size"] == 2


def test_the_megakernel_engine_agrees_with_the_per_op_engine_at_every_position(trained):
    report = agreement(trained, "--decode-backend", "megakernel")
    assert report["decode_backend"] == "megakernel" and report["tensor_parallel_size"] == 1
    assert report["schedule_steps"] >= 15  # the four prompts' decode steps, batched, ran the schedule
