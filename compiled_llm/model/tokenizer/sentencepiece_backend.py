"""A bare sentencepiece ``tokenizer.model`` (or one the Hugging Face files beside it cannot
load), read with the sentencepiece library."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Iterable

import sentencepiece

from compiled_llm.errors import CompiledLLMError
from compiled_llm.model.tokenizer.interface import Tokenizer

SENTENCEPIECE_FILE = "tokenizer.model"


class SentencePieceBackend:
    kind = "sentencepiece"

    def __init__(self, sp: Any, model_path: Path):
        self.sp = sp
        self.model_path = model_path

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def chat_template(self, tools: bool = False) -> None:
        return None

    def token_strings(self) -> Iterable[str]:
        return (self.sp.id_to_piece(i) for i in range(self.sp.get_piece_size()))

    def id_to_token(self, i: int) -> str:
        return self.sp.id_to_piece(i)

    def eos_ids(self) -> list[int]:
        return [self.sp.eos_id()] if self.sp.eos_id() >= 0 else []

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"tokenizer_class": "SentencePieceProcessor"}
        for name, i in (("bos_token", self.sp.bos_id()), ("eos_token", self.sp.eos_id()), ("unk_token", self.sp.unk_id())):
            if i >= 0:
                info[name] = self.sp.id_to_piece(i)
        return info

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = list(self.sp.encode(text))
        # sentencepiece-only checkpoints are Llama-style: BOS starts every prompt
        return ([self.sp.bos_id()] if add_special_tokens and self.sp.bos_id() >= 0 else []) + ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if not (self.sp.is_control(i) or self.sp.is_unknown(i))]
        return self.sp.decode(ids)

    def save(self, directory: Path) -> None:
        shutil.copyfile(self.model_path, directory / SENTENCEPIECE_FILE)


def load_sentencepiece(path: Path) -> Tokenizer:
    """The tokenizer of a sentencepiece model file; a one-line error when it cannot be read."""
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.Load(str(path))
    except (OSError, RuntimeError) as e:
        raise CompiledLLMError(f"cannot read sentencepiece model {path}: {e}") from None
    return Tokenizer(SentencePieceBackend(sp, path))
