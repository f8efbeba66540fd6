"""How a post-pass program runs: as is (portable, any device) or through Inductor (CUDA).

Both take ``(params, batch, kv_cache) -> logits``. The Inductor program is ``torch.compile`` of
the flat graph module; at build time it is warmed on a few batch shapes and the compiled result
is saved with ``torch.compiler.save_cache_artifacts()`` so that a load on the same kind of
machine calls ``torch.compiler.load_cache_artifacts()`` first and Inductor hits its caches
instead of compiling again. Whether a saved result fits this machine is decided by
``machine_fingerprint`` (torch, Triton, GPU arch) in ``artifact.load_engine``.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from compiled_llm.graph.export import FlatProgram
from compiled_llm.graph.spec import PackedBatch

PORTABLE = "portable"
INDUCTOR = "inductor"
BACKENDS = (PORTABLE, INDUCTOR)


class PortableProgram:
    """The post-pass graph run op by op (every cllm:: op through its chosen provider)."""

    kind = PORTABLE

    def __init__(self, gm: torch.fx.GraphModule, param_names: list[str]):
        self.module = FlatProgram(gm, param_names)
        self.param_names = list(param_names)
        self._run = FlatProgram(with_direct_calls(gm), param_names)

    def __call__(self, params: dict[str, Tensor], batch: PackedBatch, kv_cache: Tensor) -> Tensor:
        return self._run(params, *batch, kv_cache)


def with_direct_calls(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of gm whose kernel-provider ops call their Python functions directly (see
    providers.direct_implementations); gm itself, which is what gets saved, is untouched."""
    from compiled_llm.kernels.providers import direct_implementations

    direct = direct_implementations()
    if not any(n.op == "call_function" and n.target in direct for n in gm.graph.nodes):
        return gm
    out = copy.deepcopy(gm)
    for node in out.graph.nodes:
        if node.op == "call_function" and node.target in direct:
            node.target = direct[node.target]
    out.recompile()
    return out


class InductorProgram:
    """torch.compile of the flat graph. Batch dims are marked dynamic so one compiled graph
    serves every token/sequence count above 1 (dynamo specialises 1, so decode of one
    sequence gets its own graph); weights stay static shapes."""

    kind = INDUCTOR

    def __init__(self, gm: torch.fx.GraphModule, param_names: list[str]):
        from compiled_llm.piecewise import compile_pieces

        # Inductor may mutate the graph it is handed: give it a copy. Only the pure pieces
        # between KV-cache writes are compiled (see piecewise.py); dynamic=True so one compiled
        # piece serves every token count instead of one recompile per bucket.
        pieces = compile_pieces(copy.deepcopy(gm), lambda m: torch.compile(m, fullgraph=True, dynamic=True))
        self.module = FlatProgram(pieces, param_names)
        self.param_names = list(param_names)

    def __call__(self, params: dict[str, Tensor], batch: PackedBatch, kv_cache: Tensor) -> Tensor:
        return self.module(params, *batch, kv_cache)


def machine_fingerprint(device: torch.device | str) -> dict[str, str | None]:
    """What a saved Inductor result depends on."""
    device = torch.device(device)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    arch = None
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        arch = f"sm_{major}{minor}"
    return {"torch": torch.__version__, "triton": triton_version, "gpu_arch": arch}


def fingerprint_mismatch(saved: dict, current: dict) -> str | None:
    """A one-line reason the saved result does not fit this machine, or None."""
    for key in ("torch", "triton", "gpu_arch"):
        if saved.get(key) != current.get(key):
            return f"{key} is {current.get(key)} here but the engine was compiled with {saved.get(key)}"
    return None


def warm_shapes() -> list[list[tuple[int, int]]]:
    """Batches (one (num_cached, new_tokens) per sequence) the build warms the compiled program
    on: decode of 1 and of 4 sequences, and a mixed prefill."""
    return [[(3, 1)], [(3, 1), (7, 1), (1, 1), (12, 1)], [(0, 5), (0, 11), (4, 1)]]


def warm(program, params: dict[str, Tensor], config, device, dtype) -> None:
    """Run the program on ``warm_shapes`` so every graph the runtime needs first is compiled."""
    from compiled_llm.graph.batch import ScheduledSeq, pack_batch
    from compiled_llm.graph.spec import kv_cache_shape

    block = 16
    kv = torch.zeros(kv_cache_shape(config, 16, block), dtype=dtype, device=device)
    for shape in warm_shapes():
        seqs = []
        for i, (cached, new) in enumerate(shape):
            seqs.append(ScheduledSeq([1 + i] * new, cached, [i]))
        with torch.no_grad():
            program(params, pack_batch(seqs, block, device), kv)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def save_compiled(path) -> bool:
    """Write the compile caches produced so far in this process to ``path``; False if none."""
    result = torch.compiler.save_cache_artifacts()
    if result is None:
        return False
    data, _info = result
    with open(path, "wb") as f:
        f.write(data)
    return True


def load_compiled(path) -> None:
    """Hand a saved compile cache to Inductor before compiling, so it hits instead of compiling."""
    with open(path, "rb") as f:
        torch.compiler.load_cache_artifacts(f.read())
