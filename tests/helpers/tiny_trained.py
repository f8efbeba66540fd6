"""A tiny model trained on the CPU by benchmarks/train_synthetic_lm.py (tiny-qwen2 shapes, a
32-state chain, 40 steps): real logit margins in seconds, for the accuracy scripts' tests."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import train_synthetic_lm as tsl  # noqa: E402


def train_tiny(out: Path, num_prompts: int) -> Path:
    rc = tsl.main(["--preset", "tiny-qwen2", "--out", str(out), "--device", "cpu", "--steps", "40", "--batch", "16",
                   "--seq-len", "48", "--states", "32", "--lr", "1e-2", "--log-every", "20",
                   "--num-prompts", str(num_prompts)])
    assert rc == 0
    return out
