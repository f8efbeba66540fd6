"""Is a schedule safe to run? Every tile ordered after every tile whose output it reads, nothing
written twice, nothing read that no tile writes, and no SM waiting forever.

"Ordered after" is what the GPU guarantees and nothing more: a tile runs after its own SM's
earlier tiles, and after every tile that bumps a counter it waits on, once the wait's value is
the number of tiles that bump that counter (a value below it says only that some of them have
ended, not which). Counters only grow, so whether the SMs can all finish does not depend on
the order they run in: one simulated run answers it for every order.

``check_schedule`` raises ScheduleError (one line, naming the tiles) for the first problem it
finds, and returns the order of that run.
"""

from __future__ import annotations

from compiled_llm.errors import EngineError
from compiled_llm.megakernel import tiling
from compiled_llm.megakernel.schedule import Schedule, kv_layer

# what each kind's op must carry: (inputs, outputs, attrs, weight roles)
_SHAPE = {
    "embed": (0, 1, ("cols",), ("weight",)),
    "qkv_rope": (1, 2, ("num_heads", "num_kv_heads", "head_dim", "eps", "norm_eps"), ("weight",)),
    "attention": (2, 1, ("num_heads", "num_kv_heads", "head_dim", "layer", "scale", "sliding_window", "softcap",
                         "splits"), ()),
    "attention_combine": (1, 1, ("num_heads", "head_dim", "splits"), ()),
    "glu": (1, 1, ("cols", "eps", "activation"), ("norm", "weight")),
    "linear": (None, 1, ("cols",), ("weight",)),
    "lm_head": (1, 3, ("cols", "eps"), ("norm", "weight")),
    "argmax": (2, 1, (), ()),
}


class ScheduleError(EngineError):
    """A schedule that may compute the wrong thing, or never finish."""


def check_ops(s: Schedule) -> None:
    """Each op carries what its kind reads (a malformed one would fail deep in the interpreter)."""
    for k, op in enumerate(s.ops):
        shape = _SHAPE.get(op.kind)
        if shape is None:
            raise ScheduleError(f"op {k} is of kind {op.kind!r}, which the megakernel does not have")
        n_in, n_out, attrs, roles = shape
        if (n_in is not None and len(op.inputs) != n_in) or len(op.outputs) != n_out \
                or (op.kind == "linear" and len(op.inputs) not in (1, 2)):
            raise ScheduleError(f"op {k} ({op.label}) reads or writes the wrong number of buffers")
        missing = [a for a in attrs if a not in op.attrs] + [r for r in roles if r not in op.params]
        if missing:
            raise ScheduleError(f"op {k} ({op.label}) lacks {missing[0]}")
        for a in ("cols", "num_heads", "num_kv_heads", "head_dim", "splits"):
            if a in attrs and (type(op.attrs[a]) is not int or op.attrs[a] < 1):
                raise ScheduleError(f"op {k} ({op.label}) has {a} {op.attrs[a]!r}, not a positive integer")
        if "splits" in attrs and op.attrs["splits"] > tiling.MAX_SPLITS:  # the kernel's combine holds that many
            raise ScheduleError(f"op {k} ({op.label}) has {op.attrs['splits']} splits, more than {tiling.MAX_SPLITS}")
        if op.kind == "attention" and (type(op.attrs["layer"]) is not int or op.attrs["layer"] < 0):
            raise ScheduleError(f"op {k} ({op.label}) has layer {op.attrs['layer']!r}, not a layer's index")
        if op.kind in ("qkv_rope", "attention") and op.attrs["num_heads"] % op.attrs["num_kv_heads"]:
            raise ScheduleError(f"op {k} ({op.label}) has query heads that do not group over its KV heads")
        _check_tiling(s, k, op)


def _check_tiling(s: Schedule, k: int, op) -> None:
    """The op's buffers are as wide as its kind makes them, and its tiles cover its output."""
    cols = {b.name: b.cols for b in s.buffers}
    a = op.attrs
    want: dict[str, int] = {}
    if op.kind in ("qkv_rope", "attention"):
        nh, nkv, hd = a["num_heads"], a["num_kv_heads"], a["head_dim"]
        kv = op.outputs[1] if op.kind == "qkv_rope" else op.inputs[1]
        if kv_layer(kv) is None or (op.kind == "attention" and kv_layer(kv) != a["layer"]):
            raise ScheduleError(f"op {k} ({op.label}) names {kv} as its layer's KV cache")
        q = op.outputs[0] if op.kind == "qkv_rope" else op.inputs[0]
        want = {q: nh * hd, kv: 2 * nkv}
        tiles, width = (nh + 2 * nkv, hd) if op.kind == "qkv_rope" else (nh * a["splits"], hd + 2)
        if op.kind == "attention":
            want[op.outputs[0]] = nh * a["splits"] * (hd + 2)
    elif op.kind == "attention_combine":
        nh, hd = a["num_heads"], a["head_dim"]
        want = {op.inputs[0]: nh * a["splits"] * (hd + 2), op.outputs[0]: nh * hd}
        tiles, width = nh, hd
    elif op.kind == "argmax":
        want = {op.inputs[1]: cols[op.inputs[0]], op.outputs[0]: 1}
        tiles, width = 1, 1
    else:
        want = {op.outputs[0]: a["cols"]}
        if op.kind == "linear" and len(op.inputs) == 2:
            want[op.inputs[1]] = a["cols"]
        if op.kind == "lm_head":
            want.update({op.outputs[1]: op.tiles, op.outputs[2]: op.tiles})
        tiles, width = -(-a["cols"] // op.tile_cols), op.tile_cols
    for name, n in want.items():
        if cols.get(name) != n:
            raise ScheduleError(f"op {k} ({op.label}) needs {name} {n} wide, not {cols.get(name)}")
    partials = op.outputs[0] if op.kind == "attention" else op.inputs[0] if op.kind == "attention_combine" else None
    if partials is not None and s.buffer(partials).dtype != "float32":  # the kernel stores and reads them as fp32
        raise ScheduleError(f"op {k} ({op.label}) needs {partials} of float32, not {s.buffer(partials).dtype}")
    if (op.tiles, op.tile_cols) != (tiles, width):
        raise ScheduleError(f"op {k} ({op.label}) has {op.tiles} tiles of {op.tile_cols}; its output takes {tiles} "
                            f"of {width}")


def check_matches_program(s: Schedule, gm, shapes: dict[str, tuple[int, ...]]) -> None:
    """The schedule's buffers and ops are what the program's decode step lowers to for its number
    of SMs: only the placement and ordering of the tiles (which check_schedule proves) come from
    the schedule's file, so a file whose ops compute something else than the program is refused."""
    from compiled_llm.megakernel.lowering import NotCovered, lower_decode

    try:
        derived = lower_decode(gm, shapes, s.num_sms)
    except NotCovered as e:
        raise ScheduleError(f"the program has no megakernel form ({e})") from None
    if derived.buffers != s.buffers or derived.logits != s.logits or derived.tokens != s.tokens:
        raise ScheduleError("its buffers are not those of the program's decode step")
    if len(derived.ops) != len(s.ops):
        raise ScheduleError(f"it has {len(s.ops)} ops, the program's decode step {len(derived.ops)}")
    for k, (mine, theirs) in enumerate(zip(s.ops, derived.ops)):
        if mine != theirs:
            raise ScheduleError(f"op {k} ({mine.label}) is not the program's {theirs.label} ({theirs.name})")


def check_weights(s: Schedule, shapes: dict[str, tuple[int, ...]], num_layers: int) -> None:
    """Every weight an op reads is one the engine holds, shaped as the op reads it, and every KV
    layer one the cache has: a schedule that disagrees with its weights is refused at load, not
    at its first step."""
    cols = {b.name: b.cols for b in s.buffers}
    for k, op in enumerate(s.ops):
        a = op.attrs
        width = cols[op.inputs[0]] if op.inputs else None
        want: dict[str, tuple] = {}
        if op.kind == "embed":
            want = {"weight": (None, a["cols"])}
        elif op.kind == "qkv_rope":
            nh, nkv, hd = a["num_heads"], a["num_kv_heads"], a["head_dim"]
            rows = (nh + 2 * nkv) * hd
            want = {"weight": (rows, width), "bias": (rows,), "q_norm": (hd,), "k_norm": (hd,), "norm": (width,),
                    "cos_sin": (None, hd)}
            if kv_layer(op.outputs[1]) >= num_layers:
                raise ScheduleError(f"op {k} ({op.label}) stores into layer {kv_layer(op.outputs[1])} of a "
                                    f"{num_layers}-layer cache")
        elif op.kind == "attention" and a["layer"] >= num_layers:
            raise ScheduleError(f"op {k} ({op.label}) reads layer {a['layer']} of a {num_layers}-layer cache")
        elif op.kind in ("glu", "linear", "lm_head"):
            want = {"weight": ((2 if op.kind == "glu" else 1) * a["cols"], width), "bias": (a["cols"],),
                    "norm": (width,)}
        for role, name in op.params.items():
            if role not in want:
                raise ScheduleError(f"op {k} ({op.label}) names a weight for {role!r}, which its kind does not read")
            shape = shapes.get(name)
            if shape is None:
                raise ScheduleError(f"op {k} ({op.label}) reads weight {name!r}, which the engine does not hold")
            if len(shape) != len(want[role]) or any(w is not None and w != d for w, d in zip(want[role], shape)):
                raise ScheduleError(f"op {k} ({op.label}) reads {name} as {role} of shape {want[role]}, not {shape}")


def run_order(s: Schedule) -> list[int]:
    """The order one run of the SMs takes (each SM as far as it can, in turn), or a
    ScheduleError naming an SM that waits forever."""
    head = [0] * s.num_sms
    counters = [0] * s.num_counters
    order: list[int] = []
    progress = True
    while progress:
        progress = False
        for sm, lst in enumerate(s.sms):
            while head[sm] < len(lst):
                ins = s.instructions[lst[head[sm]]]
                if any(counters[c] < v for c, v in ins.waits):
                    break
                for c in ins.bumps:
                    counters[c] += 1
                order.append(lst[head[sm]])
                head[sm] += 1
                progress = True
    for sm, lst in enumerate(s.sms):
        if head[sm] < len(lst):
            index = lst[head[sm]]
            c, v = next((c, v) for c, v in s.instructions[index].waits if counters[c] < v)
            raise ScheduleError(f"deadlock: SM {sm} waits forever at {s.label(index)} (counter {c} stays at "
                                f"{counters[c]}, it waits for {v})")
    return order


def check_schedule(s: Schedule) -> list[int]:
    """Raise ScheduleError for a schedule that is not safe (see the module docstring); returns
    the order of one run."""
    check_ops(s)
    n = len(s.instructions)
    seen = sorted(i for lst in s.sms for i in lst)
    if seen != list(range(n)):
        raise ScheduleError("the SMs' lists do not hold every instruction exactly once")
    for sm, lst in enumerate(s.sms):
        for i in lst:
            if s.instructions[i].sm != sm:
                raise ScheduleError(f"{s.label(i)} is in SM {sm}'s list but says SM {s.instructions[i].sm}")
    tiles = {(ins.op, ins.tile) for ins in s.instructions}
    if len(tiles) != n or len(tiles) != sum(op.tiles for op in s.ops):
        raise ScheduleError("the instructions do not cover every tile of every op exactly once")
    bumpers: list[list[int]] = [[] for _ in range(s.num_counters)]
    for i, ins in enumerate(s.instructions):
        for c in ins.bumps:
            bumpers[c].append(i)
    for i, ins in enumerate(s.instructions):
        for c, v in ins.waits:
            if v < len(bumpers[c]):
                raise ScheduleError(f"{s.label(i)} waits for counter {c} to reach {v} of its {len(bumpers[c])} "
                                    "bumps, which does not say which tiles have ended")
    order = run_order(s)

    prev_on_sm = [None] * n
    for lst in s.sms:
        for a, b in zip(lst, lst[1:]):
            prev_on_sm[b] = a
    ancestors = [0] * n
    behind: dict[int, int] = {}  # counter -> its bumpers and their ancestors (all ended before any waiter)
    for i in order:
        covered = 0
        p = prev_on_sm[i]
        if p is not None:
            covered |= ancestors[p] | (1 << p)
        for c, _ in s.instructions[i].waits:
            if c not in behind:
                behind[c] = 0
                for b in bumpers[c]:
                    behind[c] |= ancestors[b] | (1 << b)
            covered |= behind[c]
        ancestors[i] = covered

    cols = {b.name: b.cols for b in s.buffers}
    access = [tiling.access(s.ops[ins.op], ins.tile, cols) for ins in s.instructions]
    for i, (_, written) in enumerate(access):
        for r in written:
            if r.buffer not in cols or not 0 <= r.start < r.stop <= cols[r.buffer]:
                raise ScheduleError(f"{s.label(i)} writes {r}, outside the buffer")
    writes = tiling.writers(w for _, w in access)
    for buffer, lst in writes.items():
        for (a0, a1, a), (b0, b1, b) in zip(lst, lst[1:]):
            if b0 < a1:
                raise ScheduleError(f"{s.label(a)} and {s.label(b)} both write {buffer}[{b0}:{min(a1, b1)}]")
    for i, (read, _) in enumerate(access):
        for r in read:
            if r.buffer not in cols or not 0 <= r.start < r.stop <= cols[r.buffer]:
                raise ScheduleError(f"{s.label(i)} reads {r}, outside the buffer")
            covered_to = r.start
            for w0, w1, w in writes.get(r.buffer, []):
                if w1 <= r.start or w0 >= r.stop:
                    continue
                if w0 > covered_to:
                    break
                if not ancestors[i] >> w & 1:
                    raise ScheduleError(f"{s.label(i)} reads {r.buffer}[{max(w0, r.start)}:{min(w1, r.stop)}], "
                                        f"which {s.label(w)} writes, without waiting for it")
                covered_to = max(covered_to, w1)
            if covered_to < r.stop:
                raise ScheduleError(f"{s.label(i)} reads {r.buffer}[{covered_to}:{r.stop}], which no instruction writes")
    return order
