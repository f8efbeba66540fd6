"""The compile tests' tools: Triton kernels compiled for Hopper (sm_90) without a GPU, and their
GPU IR (ttgir) read."""

from __future__ import annotations

import inspect
from typing import Callable


def compile_for_sm90(kernel, consts: dict, num_warps: int, arg_type: Callable[[str], str],
                     divisible: Callable[[str, str], bool], num_stages: int = 1):
    """triton.compile for sm_90 with launch-like argument types: ``arg_type(name)`` is each
    runtime argument's type, ``divisible(name, type)`` whether real launches pass it 16-divisible
    (Triton specialises them so); constexprs a launch leaves at their defaults are constexprs of
    the compiled kernel too."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = {**{p.name: p.default for p in kernel.params
                 if p.is_constexpr and p.default is not inspect.Parameter.empty}, **consts}
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        sig[name] = arg_type(name)
        if divisible(name, sig[name]):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                           "num_stages": num_stages})


def innermost_loop_bodies(ttgir: str) -> list[list[str]]:
    """The lines of each innermost scf.for body (the streaming loops)."""
    lines, bodies = ttgir.splitlines(), []
    for start, line in enumerate(lines):
        if "scf.for" not in line:
            continue
        depth, body = 0, []
        for inner in lines[start:]:
            depth += inner.count("{") - inner.count("}")
            body.append(inner)
            if depth <= 0:
                break
        if not any("scf.for" in b for b in body[1:]):
            bodies.append(body)
    return bodies


def innermost_loop_conversions(ttgir: str) -> int:
    """convert_layout ops inside innermost scf.for bodies (the streaming loops): each one a round
    trip of a tile through shared memory in every iteration."""
    return sum("ttg.convert_layout" in line for body in innermost_loop_bodies(ttgir) for line in body)
