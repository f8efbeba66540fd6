"""Reading Triton's GPU IR (ttgir) in the compile tests."""

from __future__ import annotations


def innermost_loop_conversions(ttgir: str) -> int:
    """convert_layout ops inside innermost scf.for bodies (the streaming loops): each one a round
    trip of a tile through shared memory in every iteration."""
    lines, count = ttgir.splitlines(), 0
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
            count += sum("ttg.convert_layout" in b for b in body)
    return count
