"""Text <-> token ids, one small interface over the tokenizers a checkpoint may carry.

- Hugging Face tokenizer files (tokenizer.json / tokenizer_config.json / vocab.json) load
  through transformers' AutoTokenizer, chat template included.
- A bare sentencepiece ``tokenizer.model`` (or one AutoTokenizer cannot load) goes straight
  to the sentencepiece library.
- Built-in presets get a byte-level tokenizer made in code (``byte_level_tokenizer``): 256 byte
  tokens plus ChatML specials, so any text encodes and the preset can be saved like a checkpoint.

Engines copy tokenizers by ``Tokenizer.save(dir)``; ``load_tokenizer(dir)`` reads them back.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Sequence

from compiled_llm.errors import CompiledLLMError

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Files whose presence means "transformers can load a tokenizer from here".
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
SENTENCEPIECE_FILE = "tokenizer.model"

# ChatML, the template Qwen models use; the presets' byte-level tokenizer carries it.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BYTE_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Tokens that end a turn in common chat vocabularies (Qwen, Llama 3); counted as EOS when the
# tokenizer knows them as special tokens.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")


def plain_chat_prompt(user_text: str, system_prompt: str | None) -> str:
    """The prompt used when a tokenizer has no chat template: a readable transcript that ends
    where the assistant should start writing."""
    head = f"{system_prompt}\n\n" if system_prompt else ""
    return f"{head}User: {user_text}\nAssistant:"


class Tokenizer:
    """Either a transformers tokenizer (``hf``) or a sentencepiece processor (``sp``)."""

    def __init__(self, hf: Any = None, sp: Any = None, sp_model_path: Path | None = None):
        if (hf is None) == (sp is None):
            raise ValueError("Tokenizer wraps exactly one of a transformers or a sentencepiece tokenizer")
        self.hf = hf
        self.sp = sp
        self._sp_model_path = sp_model_path
        self.eos_token_ids: tuple[int, ...] = self._find_eos_ids()

    # -- queries -------------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        return "transformers" if self.hf is not None else "sentencepiece"

    @property
    def vocab_size(self) -> int:
        """Number of ids this tokenizer can decode (specials included)."""
        return len(self.hf) if self.hf is not None else self.sp.get_piece_size()

    @property
    def has_chat_template(self) -> bool:
        return self.hf is not None and bool(getattr(self.hf, "chat_template", None))

    def _find_eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        if self.hf is not None:
            if self.hf.eos_token_id is not None:
                ids.append(int(self.hf.eos_token_id))
            specials = set(getattr(self.hf, "all_special_tokens", ())) | set(
                getattr(self.hf, "added_tokens_encoder", {}).keys()
            )
            for tok in _END_OF_TURN_TOKENS:
                if tok in specials:
                    ids.append(int(self.hf.convert_tokens_to_ids(tok)))
        elif self.sp.eos_id() >= 0:
            ids.append(int(self.sp.eos_id()))
        return tuple(dict.fromkeys(ids))  # ordered, no duplicates

    # -- text <-> ids --------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of a plain prompt, with the special tokens (e.g. BOS) the tokenizer adds
        to every input, as vLLM does for text prompts."""
        if self.hf is not None:
            return list(self.hf.encode(text, add_special_tokens=True))
        ids = list(self.sp.encode(text))
        # sentencepiece-only checkpoints are Llama-style: BOS starts every prompt
        return ([self.sp.bos_id()] if self.sp.bos_id() >= 0 else []) + ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # A model's vocab can be larger than its tokenizer's (padded embeddings, random-weight
        # presets): ids the tokenizer does not know decode to nothing instead of failing.
        n = self.vocab_size
        ids = [int(i) for i in ids if 0 <= int(i) < n]
        if self.hf is not None:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        if skip_special_tokens:
            ids = [i for i in ids if not (self.sp.is_control(i) or self.sp.is_unknown(i))]
        return self.sp.decode(ids)

    def render_chat(self, user_text: str, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT) -> str:
        """The chat prompt as text: the tokenizer's template, or ``plain_chat_prompt``."""
        if not self.has_chat_template:
            return plain_chat_prompt(user_text, system_prompt)
        messages = [{"role": "user", "content": user_text}]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
        return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode_chat(self, user_text: str, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT) -> list[int]:
        """Token ids of a one-turn chat ready for the assistant's answer."""
        text = self.render_chat(user_text, system_prompt)
        if self.has_chat_template:
            # The template writes its own BOS/specials; this is what apply_chat_template(tokenize=True) does.
            return list(self.hf.encode(text, add_special_tokens=False))
        return self.encode(text)

    # -- files ---------------------------------------------------------------------------------
    def save(self, directory: Path | str) -> None:
        """Write the tokenizer files into ``directory`` so ``load_tokenizer`` reloads it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.hf is not None:
            self.hf.save_pretrained(str(directory))
        else:
            shutil.copyfile(self._sp_model_path, directory / SENTENCEPIECE_FILE)


def _load_sentencepiece(path: Path) -> Tokenizer:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.Load(str(path))
    except (OSError, RuntimeError) as e:
        raise CompiledLLMError(f"cannot read sentencepiece model {path}: {e}") from None
    return Tokenizer(sp=sp, sp_model_path=path)


def load_tokenizer(directory: Path | str) -> Tokenizer | None:
    """The tokenizer stored in ``directory``, or None when it has no tokenizer files."""
    directory = Path(directory)
    has_hf = any((directory / f).is_file() for f in HF_TOKENIZER_FILES)
    sp_path = directory / SENTENCEPIECE_FILE
    if has_hf:
        from transformers import AutoTokenizer

        try:
            return Tokenizer(hf=AutoTokenizer.from_pretrained(str(directory)))
        except Exception as e:  # transformers raises many types for unreadable tokenizer files
            if not sp_path.is_file():
                first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise CompiledLLMError(f"cannot load the tokenizer in {directory}: {first_line}") from None
    if sp_path.is_file():
        return _load_sentencepiece(sp_path)
    return None


def byte_level_tokenizer() -> Tokenizer:
    """A tokenizer that needs no files: byte-level BPE without merges, so token id b is byte b
    (0..255), then <|endoftext|>=256, <|im_start|>=257, <|im_end|>=258; ChatML chat template.
    Any text round-trips exactly."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(list(BYTE_SPECIAL_TOKENS))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )
    return Tokenizer(hf=hf)


def _byte_vocab() -> dict[str, int]:
    """GPT-2's byte -> printable-character map, with each byte's id equal to its value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {chars[b]: b for b in range(256)}
