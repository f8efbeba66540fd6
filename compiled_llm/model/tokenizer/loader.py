"""``load_tokenizer(dir)``: which backend reads the tokenizer files in a directory. A
tokenizer.json loads with the tokenizers library alone; other Hugging Face files, or a
tokenizer.json that needs transformers' own code, through transformers; a bare sentencepiece
model (or one beside Hugging Face files that neither can read) with sentencepiece."""

from __future__ import annotations

from pathlib import Path

from compiled_llm.errors import CompiledLLMError, first_line
from compiled_llm.model.tokenizer.interface import Tokenizer
from compiled_llm.model.tokenizer.sentencepiece_backend import SENTENCEPIECE_FILE, load_sentencepiece
from compiled_llm.model.tokenizer.tokenizer_json import (
    TOKENIZER_JSON,
    NeedsTransformers,
    TokenizerJsonBackend,
    load_tokenizer_json,
)
from compiled_llm.model.tokenizer.transformers_backend import TransformersBackend, load_with_transformers

# Files whose presence means "transformers can load a tokenizer from here".
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def load_tokenizer(directory: Path | str) -> Tokenizer | None:
    """The tokenizer stored in ``directory``, or None when it has no tokenizer files."""
    directory = Path(directory)
    sp_path = directory / SENTENCEPIECE_FILE
    if any((directory / f).is_file() for f in HF_TOKENIZER_FILES):
        try:
            return Tokenizer(_load_hf_files(directory))
        except Exception as e:  # tokenizers/transformers raise many types for unreadable files
            if not sp_path.is_file():
                raise CompiledLLMError(
                    f"cannot load the tokenizer in {directory}: {first_line(e, limit=None)}") from None
    if sp_path.is_file():
        return load_sentencepiece(sp_path)
    return None


def _load_hf_files(directory: Path) -> TokenizerJsonBackend | TransformersBackend:
    """tokenizer.json with the tokenizers library when it can, else transformers; when both
    fail, the tokenizers library's error."""
    fast_error = None
    if (directory / TOKENIZER_JSON).is_file():
        try:
            return load_tokenizer_json(directory)
        except NeedsTransformers:
            pass
        except Exception as e:  # transformers gets its chance; broken files fail there too
            fast_error = e
    try:
        return load_with_transformers(directory)
    except Exception:
        if fast_error is not None:
            raise fast_error from None
        raise
