"""A Hugging Face ``tokenizer.json`` in the tokenizers library alone, set up as transformers'
AutoTokenizer sets up the same files (tokenizer_config.json, special_tokens_map.json and
chat_template.jinja read as it reads them; the classes of our families' checkpoints reproduced
where they change what tokenizer.json says), so loading an engine's tokenizer never imports
transformers. Saving writes what transformers would load (through transformers when it is
installed, else the same files from what the backend holds)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from tokenizers import AddedToken
from tokenizers import Tokenizer as RawTokenizer

from compiled_llm.model.tokenizer.chat_template import pick_template, render_chat_template
from compiled_llm.model.tokenizer.interface import END_OF_TURN_TOKENS

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

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


class TokenizerJsonBackend:
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

    def chat_template(self, tools: bool = False) -> str | None:
        return pick_template(self.templates, tools)

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
        ids += [self._token_id(t) for t in END_OF_TURN_TOKENS if t in known]
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

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> str:
        return render_chat_template(self.chat_template(tools=bool(tools)), messages, add_generation_prompt, self.named,
                                    template_kwargs, tools)

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


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization: drop the spaces a WordPiece decode leaves before punctuation."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


# --- loading -------------------------------------------------------------------------------------


class NeedsTransformers(Exception):
    """These tokenizer files need transformers' own code."""


def load_tokenizer_json(directory: Path) -> TokenizerJsonBackend:
    """What transformers' AutoTokenizer.from_pretrained(directory) builds for a directory with a
    tokenizer.json (TokenizersBackend.from_pretrained and __init__), without transformers."""

    config_path = directory / TOKENIZER_CONFIG
    config = _read_json(config_path) if config_path.is_file() else {}
    if not isinstance(config, dict):
        raise ValueError(f"{TOKENIZER_CONFIG} is not a JSON object")
    auto_map = config.get("auto_map")
    if (isinstance(auto_map, dict) and auto_map.get("AutoTokenizer")) or isinstance(auto_map, (list, tuple)):
        raise NeedsTransformers  # a tokenizer class from the checkpoint's own code
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
    return TokenizerJsonBackend(raw, named_text, extra, _read_chat_templates(directory, config), clean_up, directory,
                                tokenizer_class)


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


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
        raise NeedsTransformers
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
