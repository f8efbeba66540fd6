"""Hugging Face tokenizer files the tokenizers library cannot read alone (vocab.json/merges.txt,
a tokenizer_config.json beside a sentencepiece model, tokenizers that need remote code), loaded
through transformers' AutoTokenizer. transformers is imported only here, and only when such
files are loaded: it alone costs seconds of a fresh process's start."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from compiled_llm.model.tokenizer.chat_template import check_template_kwargs, pick_template
from compiled_llm.model.tokenizer.interface import END_OF_TURN_TOKENS


class TransformersBackend:
    """A transformers tokenizer, for tokenizer files the tokenizers library cannot read alone."""

    kind = "transformers"

    def __init__(self, hf: Any):
        self.hf = hf

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def chat_template(self, tools: bool = False) -> str | None:
        return pick_template(getattr(self.hf, "chat_template", None), tools)

    def token_strings(self) -> Iterable[str]:
        return self.hf.get_vocab()

    def id_to_token(self, i: int) -> str:
        return self.hf.convert_ids_to_tokens(i) or ""

    def eos_ids(self) -> list[int]:
        ids = [self.hf.eos_token_id] if self.hf.eos_token_id is not None else []
        known = set(getattr(self.hf, "all_special_tokens", ())) | set(getattr(self.hf, "added_tokens_encoder", {}))
        return ids + [self.hf.convert_tokens_to_ids(t) for t in END_OF_TURN_TOKENS if t in known]

    def describe(self) -> dict[str, Any]:
        settings = {k: v for k, v in (getattr(self.hf, "init_kwargs", None) or {}).items()
                    if k not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")}
        return {**_json_safe(settings), "tokenizer_class": type(self.hf).__name__}

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> str:
        return self.hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                           tokenize=False, **check_template_kwargs(template_kwargs))

    def save(self, directory: Path) -> None:
        self.hf.save_pretrained(str(directory))


def load_with_transformers(directory: Path) -> TransformersBackend:
    """transformers' AutoTokenizer.from_pretrained(directory)."""
    from transformers import AutoTokenizer  # seconds to import; engine loads never need it

    return TransformersBackend(AutoTokenizer.from_pretrained(str(directory)))


def _json_safe(value: Any) -> Any:
    """``value`` with what JSON cannot hold made plain: added tokens as their text, the rest as str."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return str(value)
