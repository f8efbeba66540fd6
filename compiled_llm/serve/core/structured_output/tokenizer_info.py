"""xgrammar's view of a tokenizer: each id's token string, how those strings spell bytes, and the
ids that end a sequence (which the grammar allows once it is complete)."""

from __future__ import annotations

from typing import Sequence

import xgrammar as xgr

from compiled_llm.model.tokenizer.interface import Tokenizer

# GPT-2's byte-to-unicode alphabet: the 256 characters a byte-level BPE vocabulary spells with
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
BYTE_LEVEL_ALPHABET = frozenset(
    [chr(b) for b in _PRINTABLE] + [chr(256 + i) for i in range(256 - len(_PRINTABLE))])


def vocab_type(tokenizer: Tokenizer, tokens: Sequence[str]) -> "xgr.VocabType":
    """BYTE_FALLBACK for a vocabulary with the <0xNN> byte pieces (sentencepiece, Llama 2),
    BYTE_LEVEL for one spelled in the byte-to-unicode alphabet (GPT-2, Llama 3, Qwen), RAW
    otherwise. A small trained vocabulary may hold few of the byte tokens, so how the tokenizer
    spells a newline and a space decides too."""
    known = set(tokens)
    newline = tokenizer.token_strs(tokenizer.encode("\n", add_special_tokens=False)[:1])
    if sum(f"<0x{b:02X}>" in known for b in range(256)) >= 128 or newline == ["<0x0A>"]:
        return xgr.VocabType.BYTE_FALLBACK
    space = tokenizer.token_strs(tokenizer.encode(" ", add_special_tokens=False)[:1])
    if space == ["Ġ"] or sum(c in known for c in BYTE_LEVEL_ALPHABET) >= 128:
        # added tokens (chat markers) may fall outside the alphabet; 1% of the vocabulary may
        spelled = sum(all(c in BYTE_LEVEL_ALPHABET for c in t) for t in tokens if t)
        if spelled >= 0.99 * sum(1 for t in tokens if t) or space == ["Ġ"]:
            return xgr.VocabType.BYTE_LEVEL
    return xgr.VocabType.RAW


def is_special(tokenizer: Tokenizer, token_id: int, token: str) -> bool:
    """A marker like <|im_start|> that decoding leaves out of the text (only tokens spelled
    <...> are decoded to find out, so the vocabulary pass stays cheap)."""
    return len(token) > 2 and token[0] == "<" and token[-1] == ">" and tokenizer.decode([token_id]) == ""


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> "xgr.TokenizerInfo":
    """The TokenizerInfo of ``tokenizer`` for a model whose logits have ``vocab_size`` columns
    (ids past the tokenizer's are never allowed). ``stop_token_ids``: the engine's EOS ids."""
    tokens = tokenizer.token_strs(range(min(vocab_size, tokenizer.vocab_size)))
    kind = vocab_type(tokenizer, tokens)
    # special tokens (chat markers) are no text: the detokenizer drops them, so a grammar must
    # not take them as their spelling; xgrammar never allows an empty token
    tokens = [("" if is_special(tokenizer, i, t) else t) for i, t in enumerate(tokens)]
    prefix_space = False
    if kind == xgr.VocabType.BYTE_FALLBACK:  # a metaspace tokenizer that prepends "▁" to a text
        first = tokenizer.token_strs(tokenizer.encode("a", add_special_tokens=False)[:1])
        prefix_space = bool(first) and first[0].startswith("▁")
    stops = [int(t) for t in stop_token_ids if 0 <= int(t) < vocab_size]
    return xgr.TokenizerInfo(tokens, kind, vocab_size=vocab_size, stop_token_ids=stops or None,
                             add_prefix_space=prefix_space)
