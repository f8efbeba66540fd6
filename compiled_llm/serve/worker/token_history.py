"""Each runner row's tokens on the device, for the penalties the sampler applies.

Presence, frequency and repetition penalties need, per row, which tokens its prompt holds and how
often each appears in its output. Rebuilding that from the host every step would copy every
running request's tokens every step; instead each row's tokens live in one device buffer
[rows, max_model_len] (a few MiB, made on the first request that asks for a penalty). A row is
filled once, when a request with penalties takes it; after that each step appends the row's
sampled token on the device, in stream order, so a step queued ahead already sees the token of
the step before it. A step's counts and prompt mask are scattered from the buffer on the device.
"""

from __future__ import annotations

import torch
from torch import Tensor


class TokenHistory:
    def __init__(self, max_rows: int, max_len: int, vocab_size: int, device: torch.device):
        self.max_rows = max_rows
        self.max_len = max_len
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.tokens: Tensor | None = None  # [rows, max_len] int64, made on first use
        self.lengths: Tensor | None = None  # [rows] int64: tokens held (prompt + output)
        self.prompt_lens: Tensor | None = None  # [rows] int64

    def _ensure(self) -> None:
        if self.tokens is None:
            self.tokens = torch.zeros(self.max_rows, self.max_len, dtype=torch.int64, device=self.device)
            self.lengths = torch.zeros(self.max_rows, dtype=torch.int64, device=self.device)
            self.prompt_lens = torch.zeros(self.max_rows, dtype=torch.int64, device=self.device)

    def fill(self, row: int, token_ids: list[int], prompt_len: int) -> None:
        """Row ``row`` now holds a request whose tokens so far are ``token_ids``."""
        self._ensure()
        host = torch.tensor(token_ids, dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        self.tokens[row, : len(token_ids)].copy_(host, non_blocking=True)
        self.lengths[row] = len(token_ids)
        self.prompt_lens[row] = prompt_len

    def append(self, rows: Tensor, ids: Tensor) -> None:
        """Append each row's sampled id (rows [S], ids [S], both on the device). A row past its
        end (a step queued ahead for a request that has just finished) overwrites its last slot:
        that row is refilled before it is used again."""
        if self.tokens is None:
            return
        at = self.lengths[rows].clamp(max=self.max_len - 1)
        self.tokens[rows, at] = ids
        self.lengths[rows] = at + 1

    def counts_and_prompt_mask(self, rows: Tensor, width: int) -> tuple[Tensor, Tensor]:
        """(output-token counts [S, V] int32, prompt mask [S, V] bool) of ``rows``, looking at
        their first ``width`` tokens (the longest request's length, known on the host)."""
        self._ensure()
        width = max(1, min(width, self.max_len))
        V = self.vocab_size
        tokens = self.tokens[rows, :width]
        cols = torch.arange(width, device=self.device)[None, :]
        prompt = cols < self.prompt_lens[rows, None]
        output = (cols < self.lengths[rows, None]) & ~prompt
        # out-of-range entries go to a spare column V, dropped afterwards
        spare = torch.full_like(tokens, V)
        counts = torch.zeros(len(rows), V + 1, dtype=torch.int32, device=self.device)
        counts.scatter_add_(1, torch.where(output, tokens, spare), torch.ones_like(tokens, dtype=torch.int32))
        mask = torch.zeros(len(rows), V + 1, dtype=torch.bool, device=self.device)
        mask.scatter_(1, torch.where(prompt, tokens, spare), True)
        return counts[:, :V], mask[:, :V]
