"""A lively checkpoint for structured outputs: every byte is a token (so any JSON, regex or
grammar sentence can be spelled), and a Qwen2.5-like chat template that renders tools
(``trained_tokenizers.QWEN_TOOLS_TEMPLATE``)."""

from __future__ import annotations

from pathlib import Path

from helpers.lively import make_lively_checkpoint
from helpers.trained_tokenizers import QWEN_TOOLS_TEMPLATE, train_hf_tokenizer

def make_structured_checkpoint(out: Path, seed: int = 0):
    """A lively Qwen2 checkpoint (``helpers.lively``) whose byte-level BPE has all 256 bytes and
    merges up to 320 tokens, with the tools template; returns the transformers model."""
    _, tok = train_hf_tokenizer(vocab_size=320, chat_template=QWEN_TOOLS_TEMPLATE, all_bytes=True)
    return make_lively_checkpoint(out, seed=seed, tokenizer=tok)
