"""The built-in presets' tokenizer, made in code: 256 byte tokens plus ChatML specials, so any
text encodes and a preset can be saved like a checkpoint."""

from __future__ import annotations

from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers

from compiled_llm.model.tokenizer.interface import Tokenizer
from compiled_llm.model.tokenizer.tokenizer_json import TokenizerJsonBackend

# ChatML, the template Qwen models use; the presets' byte-level tokenizer carries it.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BYTE_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_level_tokenizer() -> Tokenizer:
    """A tokenizer that needs no files: byte-level BPE without merges, so token id b is byte b
    (0..255), then <|endoftext|>=256, <|im_start|>=257, <|im_end|>=258; ChatML chat template.
    Any text round-trips exactly."""

    raw = RawTokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(list(BYTE_SPECIAL_TOKENS))
    named = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    return Tokenizer(TokenizerJsonBackend(raw, named, [], CHATML_TEMPLATE))


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
