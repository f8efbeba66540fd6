"""PassManager: runs passes in order, timing each, counting its matches and dumping the IR
(readable graph code + op histogram) before the first pass and after every pass.

Stage files in ``ir/``: ``NN_<stage>.py`` (graph code, written when ``dump_code``) and
``NN_<stage>.ops.json`` (op histogram, always). Stage 00 is ``captured``; stage k is the IR after
pass k, which is also the IR before pass k+1.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

from torch.fx import GraphModule

from compiled_llm.passes.base import Pass, PassContext


@dataclasses.dataclass(frozen=True)
class PassResult:
    name: str
    matches: int
    seconds: float
    ops_before: int
    ops_after: int
    ir_before: str  # stage name
    ir_after: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def op_name(target) -> str:
    if hasattr(target, "name") and callable(target.name):
        return target.name()  # OpOverload: "aten::linear", "cllm::rms_norm"...
    return getattr(target, "__name__", str(target))


def op_histogram(gm: GraphModule) -> dict[str, int]:
    """{op: calls} over the graph's call_function nodes, sorted by count then name. Tuple
    indexing (getitem) is not an op: it only names one output of a multi-output op."""
    c = Counter(
        op_name(n.target) for n in gm.graph.nodes
        if n.op == "call_function" and n.target is not operator.getitem
    )
    return dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


def total_ops(hist: dict[str, int]) -> int:
    return sum(hist.values())


def stage_name(index: int, name: str) -> str:
    return f"{index:02d}_{name}"


class PassManager:
    def __init__(self, passes: Sequence[Pass], ir_dir: Path | None = None, dump_code: bool = True,
                 on_pass: Callable[[PassResult], None] | None = None):
        self.passes = list(passes)
        self.ir_dir = Path(ir_dir) if ir_dir is not None else None
        self.dump_code = dump_code
        self.on_pass = on_pass
        self.histograms: dict[str, dict[str, int]] = {}

    def _dump(self, gm: GraphModule, stage: str) -> dict[str, int]:
        hist = op_histogram(gm)
        self.histograms[stage] = hist
        if self.ir_dir is not None:
            self.ir_dir.mkdir(parents=True, exist_ok=True)
            (self.ir_dir / f"{stage}.ops.json").write_text(json.dumps(hist, indent=1) + "\n")
            if self.dump_code:
                (self.ir_dir / f"{stage}.py").write_text(gm.code.strip() + "\n")
        return hist

    def run(self, gm: GraphModule, ctx: PassContext) -> list[PassResult]:
        before_stage = stage_name(0, "captured")
        before = self._dump(gm, before_stage)
        results = []
        for i, p in enumerate(self.passes, start=1):
            t0 = time.perf_counter()
            matches = int(p.run(gm, ctx))
            seconds = time.perf_counter() - t0
            after_stage = stage_name(i, p.name)
            after = self._dump(gm, after_stage)
            r = PassResult(p.name, matches, seconds, total_ops(before), total_ops(after), before_stage, after_stage)
            results.append(r)
            if self.on_pass is not None:
                self.on_pass(r)
            before, before_stage = after, after_stage
        return results
