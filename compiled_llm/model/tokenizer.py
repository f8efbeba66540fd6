"""Text <-> token ids, one small interface over the tokenizers a checkpoint may carry.

- A Hugging Face ``tokenizer.json`` loads with the ``tokenizers`` library alone (``_TokenizerFile``):
  tokenizer_config.json, special_tokens_map.json and chat_template.jinja are read the way
  transformers' AutoTokenizer reads them, and chat templates render with jinja2 the way its
  ``apply_chat_template`` renders them. Loading an engine's tokenizer therefore never imports
  transformers, which alone costs seconds of a fresh process's start.
- Other Hugging Face tokenizer files (vocab.json/merges.txt, a tokenizer_config.json beside a
  sentencepiece model, tokenizers that need remote code) load through transformers' AutoTokenizer.
- A bare sentencepiece ``tokenizer.model`` (or one the above cannot load) goes straight to the
  sentencepiece library.
- Built-in presets get a byte-level tokenizer made in code (``byte_level_tokenizer``): 256 byte
  tokens plus ChatML specials, so any text encodes and the preset can be saved like a checkpoint.

Engines copy tokenizers by ``Tokenizer.save(dir)`` (transformers' save_pretrained, so an engine
holds tokenizer.json, tokenizer_config.json and chat_template.jinja as transformers understood
them); ``load_tokenizer(dir)`` reads them back.
"""

from __future__ import annotations

import functools
import json
import shutil
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

import jinja2
import jinja2.ext
import sentencepiece
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer

from compiled_llm.errors import CompiledLLMError

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Files whose presence means "transformers can load a tokenizer from here".
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
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
# tokenizer knows them as special or added tokens.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")

# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES).
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# The named special tokens that transformers' tokenizer classes of our families default to when
# tokenizer_config.json leaves them out (an explicit null stays null).
_CLASS_SPECIAL_TOKEN_DEFAULTS = {
    "GPT2Tokenizer": {"unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
    "Qwen2Tokenizer": {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    "LlamaTokenizer": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
}
# The class AutoTokenizer picks from a checkpoint's config.json when tokenizer_config.json names none.
_MODEL_TYPE_TOKENIZER_CLASS = {
    "gpt2": "GPT2Tokenizer",
    "llama": "LlamaTokenizer",
    **dict.fromkeys(("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"), "Qwen2Tokenizer"),
}


def plain_chat_prompt(user_text: str, system_prompt: str | None) -> str:
    """The prompt used when a tokenizer has no chat template: a readable transcript that ends
    where the assistant should start writing."""
    head = f"{system_prompt}\n\n" if system_prompt else ""
    return f"{head}User: {user_text}\nAssistant:"


def _one_turn(user_text: str, system_prompt: str | None) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": user_text}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


class Tokenizer:
    """Text <-> ids over one backend: a tokenizer.json read with the tokenizers library
    (kind "tokenizers"), a transformers tokenizer ("transformers") or a sentencepiece model
    ("sentencepiece")."""

    def __init__(self, backend: Any):
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
        return self._backend.render_chat(_one_turn(user_text, system_prompt), add_generation_prompt=True)

    def encode_chat(self, user_text: str, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT) -> list[int]:
        """Token ids of a one-turn chat ready for the assistant's answer."""
        if not self.has_chat_template:
            return self.encode(plain_chat_prompt(user_text, system_prompt))
        return self.apply_chat_template(_one_turn(user_text, system_prompt))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a whole conversation (``{"role", "content"}`` dicts) through the chat
        template: transformers' ``apply_chat_template(messages, tokenize=True)``."""
        if not self.has_chat_template:
            raise CompiledLLMError("this tokenizer has no chat template")
        text = self._backend.render_chat(list(messages), add_generation_prompt=add_generation_prompt)
        # The template writes its own BOS/specials, so none are added on top.
        return self._backend.encode(text, add_special_tokens=False)

    # -- files ---------------------------------------------------------------------------------
    def save(self, directory: Path | str) -> None:
        """Write the tokenizer files into ``directory`` so ``load_tokenizer`` reloads it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(directory)


# --- backends ------------------------------------------------------------------------------------


class _TokenizerFile:
    """A tokenizer.json in the tokenizers library, set up as transformers' TokenizersBackend sets
    up the same files: special and added tokens from the config, chat template, decode clean-up."""

    kind = "tokenizers"

    def __init__(
        self,
        raw: Any,
        named: dict[str, str],
        extra: list[str],
        chat_template: str | dict[str, str] | None,
        clean_up_spaces: bool = False,
        source_dir: Path | None = None,
        tokenizer_class: str = "",
    ):
        self.raw = raw  # tokenizers.Tokenizer
        self.tokenizer_class = tokenizer_class  # the transformers class it stands for ("": TokenizersBackend)
        self.named = named  # bos_token/eos_token/... -> token text; also the template's variables
        self.extra = extra  # extra (additional) special tokens
        self.templates = chat_template
        self.clean_up_spaces = clean_up_spaces
        self.source_dir = source_dir
        self.all_special_tokens = list(dict.fromkeys([*named.values(), *extra]))

    @property
    def vocab_size(self) -> int:
        return self.raw.get_vocab_size(with_added_tokens=True)

    def chat_template(self) -> str | None:
        return _pick_template(self.templates)

    def _token_id(self, token: str) -> int | None:
        """transformers' convert_tokens_to_ids: the token's id, else the unknown token's."""
        i = self.raw.token_to_id(token)
        if i is None and self.named.get("unk_token") is not None:
            i = self.raw.token_to_id(self.named["unk_token"])
        return i

    def token_strings(self) -> Iterable[str]:
        return self.raw.get_vocab(with_added_tokens=True)

    def id_to_token(self, i: int) -> str:
        return self.raw.id_to_token(i) or ""

    def eos_ids(self) -> list[int]:
        eos = self.named.get("eos_token")
        ids = [self._token_id(eos)] if eos is not None else []
        known = set(self.all_special_tokens) | {t.content for t in self.raw.get_added_tokens_decoder().values()}
        ids += [self._token_id(t) for t in _END_OF_TURN_TOKENS if t in known]
        return [i for i in ids if i is not None]

    def describe(self) -> dict[str, Any]:
        # transformers 5 loads PreTrainedTokenizerFast files (and those that name no class) as TokenizersBackend
        cls = self.tokenizer_class if self.tokenizer_class not in ("", "PreTrainedTokenizer") else "TokenizersBackend"
        info: dict[str, Any] = {"tokenizer_class": cls, **self.named}
        if self.extra:
            info["extra_special_tokens"] = list(self.extra)
        info["clean_up_tokenization_spaces"] = self.clean_up_spaces
        return info

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.raw.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        text = self.raw.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self.clean_up_spaces else text

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return render_chat_template(self.chat_template(), messages, add_generation_prompt, self.named)

    def save(self, directory: Path) -> None:
        # transformers writes what it would itself load (the build may use transformers); without
        # it, write the same files from what this backend holds.
        try:
            hf = self._as_transformers()
        except Exception:  # transformers missing, or unable to read what the tokenizers library reads
            self._write_files(directory)
        else:
            hf.save_pretrained(str(directory))

    def _as_transformers(self) -> Any:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast  # seconds to import; engine loads never need it

        if self.source_dir is not None:
            return AutoTokenizer.from_pretrained(str(self.source_dir))
        kw: dict[str, Any] = {"extra_special_tokens": self.extra} if self.extra else {}
        return PreTrainedTokenizerFast(tokenizer_object=self.raw, chat_template=self.templates, **self.named, **kw)

    def _write_files(self, directory: Path) -> None:
        self.raw.save(str(directory / TOKENIZER_JSON))
        config: dict[str, Any] = {"tokenizer_class": "TokenizersBackend", **self.named}
        if self.extra:
            config["extra_special_tokens"] = self.extra
        if self.clean_up_spaces:  # only set when the model is not BPE or the config forces it
            config["clean_up_tokenization_spaces"] = True
            config["clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"] = True
        if self.raw.encode_special_tokens:
            config["split_special_tokens"] = True
        (directory / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        templates = {"default": self.templates} if isinstance(self.templates, str) else dict(self.templates or {})
        for name, template in templates.items():
            path = directory / (CHAT_TEMPLATE_FILE if name == "default" else f"{CHAT_TEMPLATE_DIR}/{name}.jinja")
            path.parent.mkdir(exist_ok=True)
            path.write_text(template, encoding="utf-8")


class _Transformers:
    """A transformers tokenizer, for tokenizer files the tokenizers library cannot read alone."""

    kind = "transformers"

    def __init__(self, hf: Any):
        self.hf = hf

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def chat_template(self) -> str | None:
        return _pick_template(getattr(self.hf, "chat_template", None))

    def token_strings(self) -> Iterable[str]:
        return self.hf.get_vocab()

    def id_to_token(self, i: int) -> str:
        return self.hf.convert_ids_to_tokens(i) or ""

    def eos_ids(self) -> list[int]:
        ids = [self.hf.eos_token_id] if self.hf.eos_token_id is not None else []
        known = set(getattr(self.hf, "all_special_tokens", ())) | set(getattr(self.hf, "added_tokens_encoder", {}))
        return ids + [self.hf.convert_tokens_to_ids(t) for t in _END_OF_TURN_TOKENS if t in known]

    def describe(self) -> dict[str, Any]:
        settings = {k: v for k, v in (getattr(self.hf, "init_kwargs", None) or {}).items()
                    if k not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")}
        return {**_json_safe(settings), "tokenizer_class": type(self.hf).__name__}

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def save(self, directory: Path) -> None:
        self.hf.save_pretrained(str(directory))


class _SentencePiece:
    kind = "sentencepiece"

    def __init__(self, sp: Any, model_path: Path):
        self.sp = sp
        self.model_path = model_path

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def chat_template(self) -> None:
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


# --- loading -------------------------------------------------------------------------------------


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


class _NeedsTransformers(Exception):
    """These tokenizer files need transformers' own code."""


def load_tokenizer(directory: Path | str) -> Tokenizer | None:
    """The tokenizer stored in ``directory``, or None when it has no tokenizer files."""
    directory = Path(directory)
    sp_path = directory / SENTENCEPIECE_FILE
    if any((directory / f).is_file() for f in HF_TOKENIZER_FILES):
        try:
            return Tokenizer(_load_hf_files(directory))
        except Exception as e:  # tokenizers/transformers raise many types for unreadable files
            if not sp_path.is_file():
                first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise CompiledLLMError(f"cannot load the tokenizer in {directory}: {first_line}") from None
    if sp_path.is_file():
        return _load_sentencepiece(sp_path)
    return None


def _load_hf_files(directory: Path) -> _TokenizerFile | _Transformers:
    fast_error = None
    if (directory / TOKENIZER_JSON).is_file():
        try:
            return _load_tokenizer_json(directory)
        except _NeedsTransformers:
            pass
        except Exception as e:  # transformers gets its chance; broken files fail there too
            fast_error = e
    try:
        from transformers import AutoTokenizer  # seconds to import; engine loads never need it

        return _Transformers(AutoTokenizer.from_pretrained(str(directory)))
    except Exception:
        if fast_error is not None:
            raise fast_error from None
        raise


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _load_tokenizer_json(directory: Path) -> _TokenizerFile:
    """What transformers' AutoTokenizer.from_pretrained(directory) builds for a directory with a
    tokenizer.json (TokenizersBackend.from_pretrained and __init__), without transformers."""

    config_path = directory / TOKENIZER_CONFIG
    config = _read_json(config_path) if config_path.is_file() else {}
    if not isinstance(config, dict):
        raise ValueError(f"{TOKENIZER_CONFIG} is not a JSON object")
    auto_map = config.get("auto_map")
    if (isinstance(auto_map, dict) and auto_map.get("AutoTokenizer")) or isinstance(auto_map, (list, tuple)):
        raise _NeedsTransformers  # a tokenizer class from the checkpoint's own code
    tokenizer_class = _tokenizer_class(directory, config)

    json_path = directory / TOKENIZER_JSON
    if tokenizer_class == "LlamaTokenizer":
        text = json_path.read_text(encoding="utf-8")
        if '"ByteLevel"' in text:  # Llama 3 style files that name LlamaTokenizer: transformers reads them as they are
            raw = RawTokenizer.from_str(text)
            file_added = raw.get_added_tokens_decoder()
        else:
            raw, file_added = _llama_tokenizer(json.loads(text), config)
    else:
        raw = RawTokenizer.from_file(str(json_path))
        file_added = raw.get_added_tokens_decoder()

    # tokenizer_config.json as TokenizersBackend._from_pretrained reads it
    config = dict(config)
    if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    if "added_tokens_decoder" in config:
        added = {int(i): _added_token(t) for i, t in config["added_tokens_decoder"].items()}
    else:  # older files: special_tokens_map.json's tokens win, tokenizer.json's added tokens
        special_map_path = directory / SPECIAL_TOKENS_MAP
        special_map = _read_json(special_map_path) if special_map_path.is_file() else {}
        for key, value in special_map.items():
            if isinstance(value, dict) and key != "extra_special_tokens":
                value = _added_token({**value, "special": True})
            elif key == "extra_special_tokens" and isinstance(value, list):
                value = list(dict.fromkeys([*(config.get("extra_special_tokens") or []), *map(_token_text, value)]))
            config[key] = value
        if "additional_special_tokens" in config and "extra_special_tokens" not in config:
            config["extra_special_tokens"] = config.pop("additional_special_tokens")
        added = dict(file_added)
    for key, value in _CLASS_SPECIAL_TOKEN_DEFAULTS.get(tokenizer_class, {}).items():
        config.setdefault(key, value)

    named: dict[str, Any] = {k: _added_token(config[k]) for k in _SPECIAL_TOKEN_KEYS if config.get(k) is not None}
    for key, value in config.items():  # model-specific named tokens, e.g. image_token
        if key not in _SPECIAL_TOKEN_KEYS and key.endswith("_token") and isinstance(value, (str, dict)):
            named[key] = _added_token(value)
    extra = config.get("extra_special_tokens") or []
    if isinstance(extra, dict):
        named.update({k: _added_token(v) for k, v in extra.items()})
        extra = []
    extra = [_token_text(t) for t in extra]

    _add_config_tokens(raw, added, named, extra)
    named_text = {k: _token_text(v) for k, v in named.items()}
    if tokenizer_class == "Qwen2Tokenizer":  # Qwen2Tokenizer.__init__ adds every special token again

        raw.add_tokens([AddedToken(t, special=True) for t in dict.fromkeys([*named_text.values(), *extra])])
    raw.encode_special_tokens = bool(config.get("split_special_tokens", False))
    # transformers encodes a prompt without the truncation or padding a tokenizer.json may carry
    raw.no_truncation()
    raw.no_padding()

    # transformers leaves BPE output alone even when the config asks for clean-up
    clean_up = bool(config.get("clean_up_tokenization_spaces", False)) and (
        type(raw.model).__name__ != "BPE"
        or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
    )
    return _TokenizerFile(raw, named_text, extra, _read_chat_templates(directory, config), clean_up, directory,
                          tokenizer_class)


def _tokenizer_class(directory: Path, config: dict) -> str:
    """The transformers class AutoTokenizer loads these files with (for what it changes on top of
    tokenizer.json), without "Fast": tokenizer_config.json's, else the checkpoint config's."""
    declared = config.get("tokenizer_class")
    model_config = {}
    if (directory / "config.json").is_file():  # a checkpoint; an engine's tokenizer directory has none
        try:
            model_config = _read_json(directory / "config.json")
        except ValueError:
            pass
    model_type = model_config.get("model_type") if isinstance(model_config, dict) else None
    if not declared:
        declared = (model_config.get("tokenizer_class") if isinstance(model_config, dict) else None) or (
            _MODEL_TYPE_TOKENIZER_CLASS.get(model_type)
        )
    elif model_type == "qwen2":  # AutoTokenizer overrides what Qwen2 checkpoints declare
        declared = "Qwen2Tokenizer"
    return str(declared or "").removesuffix("Fast")


_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def _added_token(value: Any) -> Any:
    """A token of tokenizer_config.json: text, or a serialized AddedToken made into one."""
    if isinstance(value, dict) and "content" in value:
        return AddedToken(**{k: v for k, v in value.items() if k in _ADDED_TOKEN_FIELDS})
    return value


def _token_text(token: Any) -> str:
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token.content if hasattr(token, "content") else str(token)


def _add_config_tokens(raw: Any, added: dict[int, Any], named: dict[str, Any], extra: list[str]) -> None:
    """TokenizersBackend.__init__: the config's added tokens (in id order), then the named and
    extra special tokens the tokenizer does not have yet, named ones marked special."""

    to_add = [tok for _, tok in sorted(added.items())]
    known = {t.content for t in raw.get_added_tokens_decoder().values()} | {_token_text(t) for t in to_add}
    for tok in [*named.values(), *extra]:
        if _token_text(tok) not in known:
            to_add.append(tok)
            known.add(_token_text(tok))
    named_text = {_token_text(t) for t in named.values()}
    tokens = []
    for tok in to_add:
        if isinstance(tok, str):
            tok = AddedToken(tok, special=True)
        elif not tok.special and tok.content in named_text:
            tok.special = True
        tokens.append(tok)
    if tokens:
        raw.add_tokens(tokens)


def _llama_tokenizer(tokenizer_json: dict, config: dict) -> tuple[Any, dict[int, Any]]:
    """transformers' LlamaTokenizer keeps only the vocab, merges and post-processor of a
    tokenizer.json and builds the rest itself: byte-fallback BPE behind a Metaspace pre-tokenizer
    (no normalizer), so files written by older converters tokenize the way transformers does.
    Returns the tokenizer without added tokens and the file's added tokens."""

    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise _NeedsTransformers
    add_prefix_space = config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    prepend = ("always" if config.get("legacy", False) else "first") if add_prefix_space else "never"
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if add_prefix_space:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    file_added = {
        int(t["id"]): AddedToken(**{k: v for k, v in t.items() if k != "id"})
        for t in tokenizer_json.get("added_tokens") or []
    }
    rebuilt = {
        **tokenizer_json,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": prepend, "split": False},
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
            "vocab": model["vocab"], "merges": model.get("merges") or [],
        },
    }
    return RawTokenizer.from_str(json.dumps(rebuilt)), file_added


def _read_chat_templates(directory: Path, config: dict) -> str | dict[str, str] | None:
    """chat_template.jinja and additional_chat_templates/*.jinja win over the config's
    ``chat_template`` (a string, or a list of {"name", "template"})."""
    templates = {}
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (directory / CHAT_TEMPLATE_DIR).is_dir():
        for path in sorted((directory / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    template = config.get("chat_template")
    if isinstance(template, (list, tuple)):
        return {t["name"]: t["template"] for t in template}
    return template


def _pick_template(templates: str | dict[str, str] | None) -> str | None:
    """The template a chat without tools uses: the only one, or the one named "default"."""
    if isinstance(templates, dict):
        templates = templates.get("default")
    return templates if isinstance(templates, str) and templates else None


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization: drop the spaces a WordPiece decode leaves before punctuation."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def _load_sentencepiece(path: Path) -> Tokenizer:
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.Load(str(path))
    except (OSError, RuntimeError) as e:
        raise CompiledLLMError(f"cannot read sentencepiece model {path}: {e}") from None
    return Tokenizer(_SentencePiece(sp, path))


# --- chat templates ------------------------------------------------------------------------------


# Where a message's reasoning may be, the first being the name templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat_template(
    template: str, messages: Sequence[dict[str, Any]], add_generation_prompt: bool, variables: dict[str, str]
) -> str:
    """Render a Hugging Face chat template as transformers' apply_chat_template(tokenize=False)
    does: messages without their None fields, the reasoning under its usual names, and the
    named special tokens (``bos_token``, ``eos_token``, ...) as template variables."""

    chat = []
    for message in messages:
        message = {k: _plain(v) for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:  # templates read reasoning_content, gpt-oss ones thinking
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    try:
        return _compile_chat_template(template).render(
            messages=chat, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.TemplateError as e:
        raise CompiledLLMError(f"chat template: {e}") from None
    except Exception as e:  # a template is untrusted code: a range too big, recursion, 1 + "a", ...
        text = str(e).strip()
        raise CompiledLLMError(f"chat template: {type(e).__name__}: {text.splitlines()[0][:200] if text else ''}") from None


# The most items one ``*`` or ``+`` in a chat template may make, and the most bits ``**`` may:
# far above any prompt, far below what would let a (tampered) template allocate gigabytes.
MAX_TEMPLATE_ITEMS = 1 << 24
MAX_TEMPLATE_POWER_BITS = 1 << 16


class _ChatTemplateSandbox(ImmutableSandboxedEnvironment):
    """jinja's sandbox bounds ``range``; this also bounds repetition, concatenation and powers."""

    intercepted_binops = frozenset(("*", "+", "**"))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        sized = (str, list, tuple)
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, sized) and isinstance(n, int) and len(seq) * n > MAX_TEMPLATE_ITEMS:
                    raise jinja2.exceptions.SecurityError("the chat template repeats a value too many times")
        elif operator == "+":
            if isinstance(left, sized) and isinstance(right, sized) and len(left) + len(right) > MAX_TEMPLATE_ITEMS:
                raise jinja2.exceptions.SecurityError("the chat template builds a value that is too long")
        elif isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0 and (
                right * left.bit_length() > MAX_TEMPLATE_POWER_BITS):
            raise jinja2.exceptions.SecurityError("the chat template raises a number to too high a power")
        return super().call_binop(context, operator, left, right)


def _plain(value: Any) -> Any:
    """Only plain JSON data reaches a template (chat templates are untrusted code)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    for t in (str, int, float):
        if isinstance(value, t):
            return t(value)
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=16)
def _compile_chat_template(template: str) -> Any:
    """transformers' chat template environment: a sandbox with trim_blocks and lstrip_blocks, loop
    controls, the ``{% generation %}`` tag, and the globals and filters templates rely on."""


    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}`` marks assistant text for training masks; rendering keeps it as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # unlike jinja's own tojson: no HTML escaping, and json.dumps' options
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:  # dict() and dict.fromkeys() without access to the type itself
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
            )

    class TemplateNamespace(jinja2.utils.Namespace):  # no dunder attributes on namespaces
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = _ChatTemplateSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)


# --- built-in ------------------------------------------------------------------------------------


def byte_level_tokenizer() -> Tokenizer:
    """A tokenizer that needs no files: byte-level BPE without merges, so token id b is byte b
    (0..255), then <|endoftext|>=256, <|im_start|>=257, <|im_end|>=258; ChatML chat template.
    Any text round-trips exactly."""

    raw = RawTokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(list(BYTE_SPECIAL_TOKENS))
    named = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    return Tokenizer(_TokenizerFile(raw, named, [], CHATML_TEMPLATE))


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
