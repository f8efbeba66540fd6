"""The per-SM timeline ``compiled-llm inspect --timeline`` shows: one row per SM, time left to
right on the scheduler's estimate, each tile drawn as its op's letter, idle time as dots."""

from __future__ import annotations

from compiled_llm.megakernel.schedule import Schedule

LETTERS = {"embed": "E", "qkv_rope": "Q", "attention": "A", "glu": "G", "lm_head": "L", "argmax": "S"}
LINEAR_LETTERS = {"o": "O", "down": "D", "linear": "W"}
LEGEND = ("E embed, Q norm+q/k/v+RoPE+KV store, A attention, O o+residual, G norm+gate/up+activation, "
          "D down+residual, W linear, L norm+lm_head, S argmax; . idle")


def letter(op) -> str:
    if op.kind == "linear":
        return LINEAR_LETTERS.get(op.attrs.get("role"), "W")
    return LETTERS.get(op.kind, "?")


def busy_share(s: Schedule) -> float:
    """The share of SM time the estimate has busy (1.0: no SM ever idles before the step ends)."""
    total = max((i.end_us for i in s.instructions), default=0.0)
    busy = sum(i.end_us - i.start_us for i in s.instructions)
    return busy / (total * s.num_sms) if total else 0.0


def timeline(s: Schedule, width: int = 100) -> str:
    """The schedule as text: a header (instructions, counters, the estimated step), then one row
    per SM."""
    total = max((i.end_us for i in s.instructions), default=0.0)
    per_col = total / width if total else 1.0
    counts: dict[str, int] = {}
    for ins in s.instructions:
        key = letter(s.ops[ins.op])
        counts[key] = counts.get(key, 0) + 1
    lines = [f"megakernel: {len(s.instructions)} instructions on {s.num_sms} SMs, {s.num_counters} counters; "
             f"estimated step {total:.1f} us, SMs busy {busy_share(s):.0%} of it (1 column = {per_col:.2f} us)",
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
