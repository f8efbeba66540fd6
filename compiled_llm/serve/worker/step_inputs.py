"""A step's inputs: one pinned host buffer and one device buffer with the same byte layout.

Fields, each 16-byte aligned: tok, pos, slot (int64, one per token), sl (int32, one per
sequence), qsl (int32, sequences + 1), then the block table (int32, sequences x width) last.
The host side is filled through numpy views; ``copy_in`` sends the used part of every field to
the device with non-blocking copies. When the unused field tails are small (the decode buffers,
sized for the largest CUDA-graph bucket), the whole used prefix goes over in one copy: each
separate small copy costs about a microsecond of device time plus its gap, on the critical path
of every decode step. On a CPU the program reads the host buffer itself.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from compiled_llm.model.spec import PackedBatch

FIELDS = (("tok", torch.int64), ("pos", torch.int64), ("slot", torch.int64), ("sl", torch.int32),
          ("qsl", torch.int32), ("bt", torch.int32))
# Unused bytes that may ride along so that a step's inputs go over in one copy.
ONE_COPY_SLACK_BYTES = 64 * 1024


def _counts(max_tokens: int, max_seqs: int, width: int) -> dict[str, int]:
    return {"tok": max_tokens, "pos": max_tokens, "slot": max_tokens, "sl": max_seqs, "qsl": max_seqs + 1,
            "bt": max_seqs * width}


def _layout(counts: dict[str, int]) -> tuple[dict[str, int], int]:
    """Each field's byte offset, 16-byte aligned, and the buffer's size in bytes."""
    offset, end = {}, 0
    for name, dtype in FIELDS:
        end = -(-end // 16) * 16
        offset[name] = end
        end += counts[name] * dtype.itemsize
    return offset, end


def step_inputs_bytes(max_tokens: int, max_seqs: int, width: int) -> int:
    """The bytes of a ``StepInputs``' device buffer (its host buffer has as many, pinned)."""
    return _layout(_counts(max_tokens, max_seqs, width))[1]


class StepInputs:
    def __init__(self, max_tokens: int, max_seqs: int, width: int, device: torch.device):
        self.max_tokens, self.max_seqs, self.width = max_tokens, max_seqs, width
        self.counts = _counts(max_tokens, max_seqs, width)
        self.offset, end = _layout(self.counts)
        self.on_device = torch.device(device).type == "cuda"
        host_bytes = torch.zeros(end, dtype=torch.uint8)
        self.host_bytes = host_bytes.pin_memory() if self.on_device else host_bytes
        self.dev_bytes = torch.zeros(end, dtype=torch.uint8, device=device) if self.on_device else self.host_bytes
        self.host = {name: self._view(self.host_bytes, name, dt) for name, dt in FIELDS}
        self.np = {name: t.numpy() for name, t in self.host.items()}
        self.dev = {name: self._view(self.dev_bytes, name, dt) for name, dt in FIELDS}

    def _view(self, buf: Tensor, name: str, dtype: torch.dtype) -> Tensor:
        start = self.offset[name]
        return buf[start: start + self.counts[name] * dtype.itemsize].view(dtype)

    def fits(self, num_tokens: int, num_seqs: int, width: int) -> bool:
        return num_tokens <= self.max_tokens and num_seqs <= self.max_seqs and width <= self.width

    # ---- filling ------------------------------------------------------------------------------

    def pad_tokens(self, start: int, end: int) -> None:
        """Token rows start..end-1 belong to no sequence: they read token 0 and write nowhere."""
        self.np["tok"][start:end] = 0
        self.np["pos"][start:end] = 0
        self.np["slot"][start:end] = -1

    def pad_seqs(self, start: int, end: int, width: int, seq_len: int) -> None:
        """Sequence rows start..end-1 are padding of one query token each, attending to the first
        ``seq_len`` (0 or 1) tokens of block 0."""
        self.np["sl"][start:end] = seq_len
        self.np["qsl"][start: end + 1] = np.arange(start, end + 1, dtype=np.int32)
        self.block_table(end, width)[start:end] = 0

    def block_table(self, num_seqs: int, width: int) -> np.ndarray:
        return self.np["bt"][: num_seqs * width].reshape(num_seqs, width)

    def used(self, num_tokens: int, num_seqs: int, width: int) -> dict[str, np.ndarray]:
        """Copies of the filled part of every field (what a tensor-parallel peer is sent)."""
        counts = {"tok": num_tokens, "pos": num_tokens, "slot": num_tokens, "sl": num_seqs,
                  "qsl": num_seqs + 1, "bt": num_seqs * width}
        return {name: self.np[name][:n].copy() for name, n in counts.items()}

    def fill_used(self, used: dict[str, np.ndarray]) -> None:
        for name, values in used.items():
            self.np[name][: len(values)] = values

    # ---- to the device ------------------------------------------------------------------------

    def copy_in(self, num_tokens: int, num_seqs: int, width: int) -> None:
        if not self.on_device:
            return
        used = {"tok": num_tokens, "pos": num_tokens, "slot": num_tokens, "sl": num_seqs,
                "qsl": num_seqs + 1, "bt": num_seqs * width}
        prefix = self.offset["bt"] + used["bt"] * 4
        used_bytes = sum(used[name] * dtype.itemsize for name, dtype in FIELDS)
        if prefix - used_bytes <= ONE_COPY_SLACK_BYTES:
            self.dev_bytes[:prefix].copy_(self.host_bytes[:prefix], non_blocking=True)
            return
        for name, n in used.items():
            self.dev[name][:n].copy_(self.host[name][:n], non_blocking=True)

    def views(self, num_tokens: int, num_seqs: int, width: int) -> PackedBatch:
        """The device-side batch of the first num_tokens tokens and num_seqs sequences."""
        d = self.dev
        return PackedBatch(
            token_ids=d["tok"][:num_tokens],
            positions=d["pos"][:num_tokens],
            query_start_loc=d["qsl"][: num_seqs + 1],
            seq_lens=d["sl"][:num_seqs],
            block_tables=d["bt"][: num_seqs * width].view(num_seqs, width),
            slot_mapping=d["slot"][:num_tokens],
        )
