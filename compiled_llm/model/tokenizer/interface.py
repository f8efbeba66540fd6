"""The ``Tokenizer`` every caller uses (text <-> ids, chat prompts, saving), and the few methods
each backend under it provides (``TokenizerBackend``)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

from compiled_llm.errors import CompiledLLMError
from compiled_llm.model.tokenizer.chat_template import DEFAULT_SYSTEM_PROMPT, one_turn_chat, plain_chat_prompt

# Tokens that end a turn in common chat vocabularies (Qwen, Llama 3); a backend counts them as
# EOS when the tokenizer knows them as special or added tokens.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")


class TokenizerBackend(Protocol):
    """One tokenizer library's tokenizer, as ``Tokenizer`` uses it."""

    kind: str  # "tokenizers", "transformers" or "sentencepiece"

    @property
    def vocab_size(self) -> int: ...
    def chat_template(self, tools: bool = False) -> str | None: ...
    def token_strings(self) -> Iterable[str]: ...
    def id_to_token(self, i: int) -> str: ...
    def eos_ids(self) -> list[int]: ...
    def describe(self) -> dict[str, Any]: ...
    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...
    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> str: ...
    def save(self, directory: Path) -> None: ...


class Tokenizer:
    """Text <-> ids over one backend: a tokenizer.json read with the tokenizers library
    (kind "tokenizers"), a transformers tokenizer ("transformers") or a sentencepiece model
    ("sentencepiece")."""

    def __init__(self, backend: TokenizerBackend):
        self._backend = backend
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in backend.eos_ids()))

    # -- queries -------------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        return self._backend.kind

    @property
    def vocab_size(self) -> int:
        """Number of ids this tokenizer can decode (base vocab plus added tokens, as len() of a
        transformers tokenizer)."""
        return self._backend.vocab_size

    @property
    def has_chat_template(self) -> bool:
        return self._backend.chat_template() is not None

    def chat_template_text(self, tools: bool = False) -> str | None:
        """The template a chat uses (with ``tools``: a "tool_use" template where there is one)."""
        return self._backend.chat_template(tools)

    @functools.cached_property
    def max_text_bytes_per_token(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token stands for: four times the
        longest token string (byte-level and metaspace symbols are longer than the byte they
        stand for, and the 4 covers normalizers that compose characters). A text longer than
        this times a length limit cannot fit the limit, so it is refused untokenized."""
        return 4 * max((len(t.encode("utf-8", "surrogatepass")) for t in self._backend.token_strings()), default=1)

    # -- text <-> ids --------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a plain prompt, with the special tokens (e.g. BOS) the tokenizer adds
        to every input, as vLLM does for text prompts (unless ``add_special_tokens`` is False)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's token string in the vocabulary's own alphabet (transformers'
        convert_ids_to_tokens: "Ġworld" for a byte-level BPE); "" for an id it does not know."""
        n = self.vocab_size
        return [self._backend.id_to_token(int(i)) if 0 <= int(i) < n else "" for i in ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # A model's vocab can be larger than its tokenizer's (padded embeddings, random-weight
        # presets): ids the tokenizer does not know decode to nothing instead of failing.
        n = self.vocab_size
        return self._backend.decode([int(i) for i in ids if 0 <= int(i) < n], skip_special_tokens)

    def describe(self) -> dict[str, Any]:
        """The tokenizer's settings as vLLM's /tokenizer_info gives them (what transformers keeps
        as ``init_kwargs``: its class, its named special tokens, ...), its chat template included."""
        info = dict(self._backend.describe())
        template = self._backend.chat_template()
        if template is not None:
            info["chat_template"] = template
        return info

    def render_chat(self, user_text: str, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT) -> str:
        """The chat prompt as text: the tokenizer's template, or ``plain_chat_prompt``."""
        if not self.has_chat_template:
            return plain_chat_prompt(user_text, system_prompt)
        return self._backend.render_chat(one_turn_chat(user_text, system_prompt), add_generation_prompt=True)

    def encode_chat(self, user_text: str, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT) -> list[int]:
        """Token ids of a one-turn chat ready for the assistant's answer."""
        if not self.has_chat_template:
            return self.encode(plain_chat_prompt(user_text, system_prompt))
        return self.apply_chat_template(one_turn_chat(user_text, system_prompt))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            template_kwargs: dict[str, Any] | None = None,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a whole conversation (``{"role", "content"}`` dicts) through the chat
        template: transformers' ``apply_chat_template(messages, tools=tools, tokenize=True,
        **template_kwargs)`` (extra template variables such as ``enable_thinking``; reserved names
        are refused)."""
        if not self.has_chat_template:
            raise CompiledLLMError("this tokenizer has no chat template")
        text = self._backend.render_chat(list(messages), add_generation_prompt=add_generation_prompt,
                                         template_kwargs=template_kwargs, tools=tools)
        # The template writes its own BOS/specials, so none are added on top.
        return self._backend.encode(text, add_special_tokens=False)

    # -- files ---------------------------------------------------------------------------------
    def save(self, directory: Path | str) -> None:
        """Write the tokenizer files into ``directory`` so ``load_tokenizer`` reloads it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(directory)
