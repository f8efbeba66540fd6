"""The per-SM timeline: one row per SM, time left to right, each tile drawn as its op's letter,
idle time as dots. ``compiled-llm inspect --timeline`` draws the scheduler's estimate;
``benchmarks/megakernel_timeline.py`` draws a step timed on the GPU (``measured``: the kernel's
``TIMED`` form stamps every instruction's wait, run and end)."""

from __future__ import annotations

import dataclasses

from compiled_llm.megakernel.schedule import Schedule

LETTERS = {"embed": "E", "qkv_rope": "Q", "attention": "A", "attention_combine": "C", "glu": "G", "lm_head": "L",
           "argmax": "S"}
LINEAR_LETTERS = {"o": "O", "down": "D", "linear": "W"}
LEGEND = ("E embed, Q norm+q/k/v+RoPE+KV store, A attention (a head's split), C attention combine, O o+residual, "
          "G norm+gate/up+activation, D down+residual, W linear, L norm+lm_head, S argmax; . idle")


def letter(op) -> str:
    if op.kind == "linear":
        return LINEAR_LETTERS.get(op.attrs.get("role"), "W")
    return LETTERS.get(op.kind, "?")


def busy_share(s: Schedule) -> float:
    """The share of SM time the estimate has busy (1.0: no SM ever idles before the step ends)."""
    total = max((i.end_us for i in s.instructions), default=0.0)
    busy = sum(i.end_us - i.start_us for i in s.instructions)
    return busy / (total * s.num_sms) if total else 0.0


def timeline(s: Schedule, width: int = 100, source: str = "estimated") -> str:
    """The schedule as text: a header (instructions, counters, the step's time, ``source`` saying
    whose), then one row per SM."""
    total = max((i.end_us for i in s.instructions), default=0.0)
    per_col = total / width if total else 1.0
    counts: dict[str, int] = {}
    for ins in s.instructions:
        key = letter(s.ops[ins.op])
        counts[key] = counts.get(key, 0) + 1
    lines = [f"megakernel: {len(s.instructions)} instructions on {s.num_sms} SMs, {s.num_counters} counters; "
             f"{source} step {total:.1f} us, SMs busy {busy_share(s):.0%} of it (1 column = {per_col:.2f} us)",
             "instructions: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
             LEGEND]
    for sm, lst in enumerate(s.sms):
        row = ["."] * width
        for index in lst:
            ins = s.instructions[index]
            a = min(width - 1, int(ins.start_us / per_col))
            b = max(a + 1, min(width, int(round(ins.end_us / per_col))))
            for c in range(a, b):
                row[c] = letter(s.ops[ins.op])
        lines.append(f"SM {sm:>3} |{''.join(row)}| {len(lst)}")
    return "\n".join(lines)


def flat_order(s: Schedule) -> list[int]:
    """The instruction each slot of the kernel's flat record array holds (SM by SM, in order):
    how a timed step's stamps are laid out."""
    return [index for lst in s.sms for index in lst]


def measured(s: Schedule, stamps) -> tuple[Schedule, dict[str, float]]:
    """(``s`` with each instruction's start and end replaced by a timed step's, in us from the
    step's first stamp; what the step's time went to). ``stamps``: (wait, run, end) ns per slot
    of the flat record array (``flat_order``), from ``triton_kernel.launch(..., stamps=)``.

    What the time went to, summed over SMs in us: ``run:<letter>`` each kind's running time,
    ``wait`` the time from an instruction's dispatch until its counters are met (waiting on
    them, after reading the op's tables and issuing the weight loads that need no counter), and
    ``step`` the step's wall time; an SM idle after its last instruction is in none of them."""
    rows = [tuple(int(v) for v in row) for row in stamps]
    if len(rows) != len(s.instructions):
        raise ValueError(f"{len(rows)} stamps for a schedule of {len(s.instructions)} instructions")
    t0 = min(r[0] for r in rows)
    times = [None] * len(rows)
    for slot, index in enumerate(flat_order(s)):
        wait, run, end = rows[slot]
        if not wait <= run <= end:
            raise ValueError(f"the stamps of {s.label(index)} are out of order ({wait}, {run}, {end})")
        times[index] = (wait, run, end)
    spent: dict[str, float] = {"wait": 0.0}
    instructions = []
    for index, ins in enumerate(s.instructions):
        wait, run, end = times[index]
        spent["wait"] += (run - wait) / 1e3
        key = "run:" + letter(s.ops[ins.op])
        spent[key] = spent.get(key, 0.0) + (end - run) / 1e3
        instructions.append(dataclasses.replace(ins, start_us=(run - t0) / 1e3, end_us=(end - t0) / 1e3))
    spent["step"] = (max(r[2] for r in rows) - t0) / 1e3
    return dataclasses.replace(s, instructions=tuple(instructions)), spent


def spent_lines(spent: dict[str, float], num_sms: int) -> list[str]:
    """``measured``'s split as text: each part's share of the SMs' time over the step."""
    total = spent["step"] * num_sms
    lines = [f"step {spent['step']:.1f} us on {num_sms} SMs ({total:.0f} SM-us)"]
    for key, us in sorted(spent.items(), key=lambda kv: -kv[1]):
        if key != "step":
            lines.append(f"  {key:<8} {us:10.1f} SM-us  {us / total:6.1%}")
    busy = sum(us for key, us in spent.items() if key.startswith("run:"))
    lines.append(f"  {'idle':<8} {total - busy - spent['wait']:10.1f} SM-us  {(total - busy - spent['wait']) / total:6.1%}"
                 "  (after an SM's last instruction, or before its first)")
    return lines
