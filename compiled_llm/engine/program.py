"""How a post-pass program runs: its graph executed op by op, every ``cllm::`` op through the
kernel provider the build chose.

An engine holds no compiled host code: Triton kernels are its only compiled part (shipped in the
engine, see kernel_cache.py), and the graph between them is a few dozen launches per layer that
CUDA graphs replay. An Inductor backend existed before; it matched this one's decode speed, cost
30-50 s more to the first token, and could only be reloaded by unpickling its cache or re-tracing
the program, so it was removed (see BENCHMARKS.md).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from compiled_llm.errors import EngineError, first_line
from compiled_llm.graph.export import FlatProgram
from compiled_llm.graph.logits_rows import with_logits_rows, yields_chosen_rows
from compiled_llm.model.spec import PackedBatch
from compiled_llm.kernels import registry


class PortableProgram:
    """``(params, batch, kv_cache) -> logits`` over a post-pass flat graph module.

    Its first call is also the last check of the engine: the loader checks program.json against
    the program's schema and the weights' headers against the config, but whether every shape
    in the program fits the weights (a view to a size the tensor does not have) shows only when
    it runs. A first call that fails, or returns anything but 2-D logits, is a one-line
    EngineError naming program.json rather than a traceback from inside an op; later calls run
    unchecked."""

    def __init__(self, gm: torch.fx.GraphModule, param_names: list[str]):
        self.module = FlatProgram(gm, param_names)
        self.param_names = list(param_names)
        self._run = FlatProgram(with_direct_calls(gm), param_names)
        self._rows_gm: torch.fx.GraphModule | None = None  # made on first use (graph/logits_rows.py)
        self.yields_chosen_rows = yields_chosen_rows(gm)
        self._checked = False

    def __call__(self, params: dict[str, Tensor], batch: PackedBatch, kv_cache: Tensor) -> Tensor:
        if self._checked:
            return self._run(params, *batch, kv_cache)
        return self._first_call(params, batch, kv_cache)

    def _first_call(self, params: dict[str, Tensor], batch: PackedBatch, kv_cache: Tensor) -> Tensor:
        if kv_cache.is_cuda and (torch.cuda.is_current_stream_capturing() or torch.cuda.get_sync_debug_mode()):
            # a CUDA graph capture (or its trial run): its failures are the capture's to handle
            # (serve/worker/cuda_graphs.py), and the next eager call is checked
            return self._run(params, *batch, kv_cache)
        try:
            logits = self._run(params, *batch, kv_cache)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError, ValueError, IndexError, KeyError) as e:
            raise EngineError(f"program.json does not run on the engine's weights ({first_line(e)}); "
                              "rebuild the engine") from None
        if not isinstance(logits, Tensor) or logits.dim() != 2 or not logits.is_floating_point():
            raise EngineError(f"program.json returns {_described(logits)}, not logits; rebuild the engine")
        self._checked = True
        return logits

    def logits_of_rows(self, params: dict[str, Tensor], batch: PackedBatch, kv_cache: Tensor, rows: Tensor) -> Tensor:
        """The step's logits of token rows ``rows`` (int64), in that order."""
        if self._rows_gm is None:
            self._rows_gm = with_logits_rows(self._run.gm)
        out = self._rows_gm(*[params[n] for n in self.param_names], *batch, kv_cache, rows)
        return out[0] if isinstance(out, (tuple, list)) else out


def _described(value) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dim()}-D {str(value.dtype).removeprefix('torch.')} tensor"
    return f"a {type(value).__name__}"


def with_direct_calls(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of gm whose kernel-provider calls call the provider's Python function directly
    (``registry.direct_calls``: the function its op runs, kept by the registry when the kernel
    was registered); gm itself, which is what gets saved, is untouched. A call passing keyword
    arguments keeps the op (the functions take positional ones; the passes and the exporter
    pass none)."""
    direct = registry.direct_calls()

    def redirected(node: torch.fx.Node) -> bool:
        return node.op == "call_function" and not node.kwargs and node.target in direct

    if not any(redirected(n) for n in gm.graph.nodes):
        return gm
    out = copy.deepcopy(gm)
    for node in out.graph.nodes:
        if redirected(node):
            node.target = direct[node.target]
    out.recompile()
    return out
