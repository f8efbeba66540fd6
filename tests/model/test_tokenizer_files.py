"""load_tokenizer on Hugging Face tokenizer files reads them with the tokenizers library and jinja2
only, and gives exactly what transformers' AutoTokenizer gives: encode, decode, EOS ids, vocab
size and chat rendering, for tokenizers of the GPT-2, Llama 2, Llama 3, Qwen2.5 and Qwen3 kinds
written by transformers itself (small vocabularies trained here, the families' real pipelines,
special tokens and chat templates), for files in the older layout checkpoints on the Hub carry,
and for the presets' byte-level tokenizer after save."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from compiled_llm.model.tokenizer import DEFAULT_SYSTEM_PROMPT, Tokenizer, byte_level_tokenizer, load_tokenizer
from compiled_llm.model.tokenizer.chat_template import render_chat_template
from compiled_llm.model.tokenizer.transformers_backend import TransformersBackend
from helpers.trained_tokenizers import corpus

# --- chat templates as the checkpoints ship them ------------------------------------------------

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

LLAMA32_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

QWEN3_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# Qwen2.5's ChatML with the {% generation %} markers TRL's training templates add.
GENERATION_TAG_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{% if message.role == 'assistant' %}{% generation %}{{ message.content + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message.content + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|vision_start|>",
                 "<|vision_pad|>"]

TRAINING_EXTRA = ["déjà vu über café naïve", "東京 日本語 中文 한국어", "emoji 🚀🔥😀 party", "tabs\tand  spaces   runs\n\nnew",
                  "don't we're I'm it's 12345 3.14"]


# --- tokenizers of each family, written by transformers ------------------------------------------


def _train(pre_tokenizer, vocab_size: int = 420) -> tuple[dict, list]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre_tokenizer, pre_tokenizers.ByteLevel) else []
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False)
    raw.train_from_iterator(corpus() + TRAINING_EXTRA * 30, trainer=trainer)
    model = json.loads(raw.to_str())["model"]
    return model["vocab"], [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def _byte_level_vocab(first: list[str]) -> tuple[dict, list]:
    from tokenizers import pre_tokenizers

    trained, merges = _train(pre_tokenizers.ByteLevel(add_prefix_space=False))
    vocab = {t: i for i, t in enumerate(first)}
    for tok in trained:
        vocab.setdefault(tok, len(vocab))
    return vocab, merges


def make_gpt2(out: Path, force_clean_up: bool = False) -> None:
    from transformers import GPT2Tokenizer

    vocab, merges = _byte_level_vocab([])
    vocab["<|endoftext|>"] = len(vocab)  # last, as in GPT-2
    kw = {"clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True} if force_clean_up else {}
    GPT2Tokenizer(vocab=vocab, merges=merges, clean_up_tokenization_spaces=True, **kw).save_pretrained(out)


def make_gpt2_hub(out: Path) -> None:
    """GPT-2 as the Hub has it: a tokenizer_config.json naming no class or token, so AutoTokenizer
    takes GPT2Tokenizer (and its <|endoftext|> defaults) from config.json's model_type."""
    from transformers import GPT2Config

    make_gpt2(out)
    (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    GPT2Config(vocab_size=len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"])).save_pretrained(out)


def make_llama2(out: Path) -> None:
    """Metaspace BPE with byte fallback: <unk> <s> </s>, the 256 <0xXX> byte tokens, then pieces."""
    from tokenizers import pre_tokenizers
    from transformers import LlamaTokenizer

    trained, merges = _train(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False), 320)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for tok in trained:
        vocab.setdefault(tok, len(vocab))
    LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, chat_template=LLAMA2_TEMPLATE).save_pretrained(out)


def make_llama2_hub(out: Path) -> None:
    """What older transformers wrote for Llama 2 (the Hub's files): the normalizer-based
    tokenizer.json of LlamaConverter, AddedToken dicts and the template in tokenizer_config.json."""
    make_llama2(out)
    tj = json.loads((out / "tokenizer.json").read_text())
    tj["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    tj["pre_tokenizer"] = None
    tj["model"]["unk_token"] = "<unk>"
    tj["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                            {"Sequence": {"id": "A", "type_id": 0}}],
                            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    (out / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    dict_token = lambda t: {"__type": "AddedToken", "content": t, "lstrip": False, "normalized": False,  # noqa: E731
                            "rstrip": False, "single_word": False}
    config = {
        "add_bos_token": True, "add_eos_token": False, "bos_token": dict_token("<s>"), "eos_token": dict_token("</s>"),
        "unk_token": dict_token("<unk>"), "pad_token": None, "clean_up_tokenization_spaces": False, "legacy": False,
        "model_max_length": 1000000000000000019884624838656, "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizer",
        "chat_template": (out / "chat_template.jinja").read_text(),
        "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in tj["added_tokens"]},
    }
    (out / "chat_template.jinja").unlink()
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


def make_llama2_hub_with(**settings):
    """Llama 2 Hub files with other LlamaTokenizer settings (legacy, add_prefix_space)."""

    def make(out: Path) -> None:
        make_llama2_hub(out)
        config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**config, **settings}, ensure_ascii=False))

    return make


def make_llama2_bare_config(out: Path) -> None:
    """Older Llama files whose tokenizer_config.json names the class only: LlamaTokenizer's own
    <s> </s> <unk> defaults apply."""
    make_llama2_hub(out)
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizerFast"}))


def make_llama3(out: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab, merges = _byte_level_vocab([])
    raw = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    raw.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIALS])
    bos = raw.token_to_id("<|begin_of_text|>")
    raw.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)]),
    ])
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                            clean_up_tokenization_spaces=True, chat_template=LLAMA32_TEMPLATE).save_pretrained(out)


def make_llama3_legacy_special_map(out: Path) -> None:
    """Named tokens only in special_tokens_map.json (dicts), the template in the config."""
    make_llama3(out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    special = {k: {"content": config.pop(k), "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
               for k in ("bos_token", "eos_token")}
    config["chat_template"] = (out / "chat_template.jinja").read_text()
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "chat_template.jinja").unlink()
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def _make_qwen(out: Path, template: str, non_special: list[str]) -> None:
    from transformers import Qwen2Tokenizer

    vocab, merges = _byte_level_vocab(["<|endoftext|>"])
    del vocab["<|endoftext|>"]  # Qwen's specials come after the byte-level vocab
    vocab = {t: i for i, t in enumerate(vocab)}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         unk_token=None, bos_token=None, extra_special_tokens=QWEN_SPECIALS, chat_template=template)
    tok.add_tokens(non_special)
    tok.save_pretrained(out)


def make_qwen25(out: Path) -> None:
    _make_qwen(out, QWEN25_TEMPLATE, ["<tool_call>", "</tool_call>"])


def make_qwen3(out: Path) -> None:
    _make_qwen(out, QWEN3_TEMPLATE, ["<tool_call>", "</tool_call>", "<think>", "</think>"])


def make_qwen25_hub(out: Path) -> None:
    """Qwen2.5's files as the Hub has them: additional_special_tokens, added_tokens_decoder and
    the template in tokenizer_config.json, errors/split_special_tokens, bos/unk null."""
    make_qwen25(out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    tj = json.loads((out / "tokenizer.json").read_text())
    config["additional_special_tokens"] = config.pop("extra_special_tokens")
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in tj["added_tokens"]}
    config.update(chat_template=(out / "chat_template.jinja").read_text(), errors="replace", split_special_tokens=False,
                  clean_up_tokenization_spaces=False, model_max_length=131072, bos_token=None, unk_token=None)
    config.pop("backend", None)
    (out / "chat_template.jinja").unlink()
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


def make_qwen2_declared_fast(out: Path) -> None:
    """A Qwen2 checkpoint whose tokenizer_config.json names PreTrainedTokenizerFast (AutoTokenizer
    still uses Qwen2Tokenizer for model_type qwen2) and lists an extra special token that the
    files mark non-special (Qwen2Tokenizer makes it special)."""
    from transformers import Qwen2Config

    make_qwen25_hub(out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tj = json.loads((out / "tokenizer.json").read_text())
    for t in tj["added_tokens"]:
        if t["content"] == "<|object_ref_start|>":
            t["special"] = False
            config["added_tokens_decoder"][str(t["id"])]["special"] = False
    (out / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    Qwen2Config(vocab_size=len(tj["model"]["vocab"]) + len(tj["added_tokens"])).save_pretrained(out)


def make_byte_level(out: Path) -> None:
    byte_level_tokenizer().save(out)


def make_generation_tag(out: Path) -> None:
    _make_qwen(out, GENERATION_TAG_TEMPLATE, [])


FAMILIES = {
    "gpt2": make_gpt2,
    "gpt2-clean-up": lambda out: make_gpt2(out, force_clean_up=True),
    "gpt2-hub": make_gpt2_hub,
    "llama2": make_llama2,
    "llama2-hub": make_llama2_hub,
    "llama2-bare-config": make_llama2_bare_config,
    "llama2-hub-legacy": make_llama2_hub_with(legacy=True),
    "llama2-hub-no-prefix-space": make_llama2_hub_with(add_prefix_space=False),
    "llama3": make_llama3,
    "llama3-special-tokens-map": make_llama3_legacy_special_map,
    "qwen2.5": make_qwen25,
    "qwen2.5-hub": make_qwen25_hub,
    "qwen2-declared-fast": make_qwen2_declared_fast,
    "qwen3": make_qwen3,
    "byte-level": make_byte_level,
    "generation-tag": make_generation_tag,
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    dirs = {}
    for name, make in FAMILIES.items():
        dirs[name] = root / name
        dirs[name].mkdir()
        make(dirs[name])
    return dirs


def auto_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


# --- what must match ------------------------------------------------------------------------------

TEXTS = [
    "", "hello world", "the quick brown fox jumps over a lazy dog", "  leading spaces", "trailing   ", " x",
    "tabs\tand\nnewlines\n\n\n  indented", "déjà vu naïve café über", "東京 日本語 中文 한국어", "emoji 🚀🔥😀 and 👩‍👩‍👧 zwj",
    "combining e\u0301 vs é (NFC)", "\u00a0nbsp \u200b zero-width \u2028 sep", "don't we're I'm it's THEY'LL",
    "Hello , world . How are you ? Fine !", "numbers 1234567 3.14159 -42", "x" * 120, "   \n \t ",
    "<|im_start|>user\nhi<|im_end|>\n", "a<|im_end|>b", "  <|im_end|>  <|endoftext|>", "<s>[INST] hi [/INST]", "hi </s> there",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", "<think>\nhmm\n</think>\n\nok",
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "<unk> <|reserved_special_token_0|> <|vision_pad|>",
]

CHATS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "the fox? 🚀"}],
    [{"role": "system", "content": "Be nice.\n"}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "déjà vu\n\tindented  "}],
    [{"role": "user", "content": "say <|im_end|> and </s> and <|eot_id|>"}, {"role": "assistant", "content": "ok <|im_end|>"},
     {"role": "user", "content": "again"}],
    [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>\nreasoning\n</think>\n\nanswer one"},
     {"role": "user", "content": "q2"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "why", "tool_calls": None}],
]


def old_eos_ids(hf) -> tuple[int, ...]:
    """EOS ids as the transformers-backed Tokenizer computed them."""
    return tuple(dict.fromkeys(int(i) for i in TransformersBackend(hf).eos_ids()))


def hf_chat_ids(hf, messages, add_generation_prompt=True) -> list[int]:
    return list(hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False))


def assert_same_as_transformers(tok: Tokenizer, hf, seed: int = 0) -> None:
    assert tok.vocab_size == len(hf)
    assert tok.eos_token_ids == old_eos_ids(hf)
    assert tok.has_chat_template == bool(hf.chat_template)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=True), text
        assert tok._backend.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (text, skip)
    rng = random.Random(seed)
    for _ in range(200):  # any ids: specials, added tokens, bytes that are not whole characters
        ids = [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (ids, skip)
    if not tok.has_chat_template:
        return
    for system in (DEFAULT_SYSTEM_PROMPT, "You are terse.", None):
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "hi there 🚀"}]
        assert tok.render_chat("hi there 🚀", system) == hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert tok.encode_chat("hi there 🚀", system) == hf_chat_ids(hf, msgs)
    for chat in CHATS:
        for add_generation_prompt in (True, False):
            try:
                want = hf.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=False)
            except Exception:  # e.g. Llama 2's template wants alternating roles
                with pytest.raises(Exception):
                    tok.apply_chat_template(chat, add_generation_prompt)
                continue
            assert tok._backend.render_chat(chat, add_generation_prompt) == want
            assert tok.apply_chat_template(chat, add_generation_prompt) == hf_chat_ids(hf, chat, add_generation_prompt)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loads_without_transformers_as_transformers_does(family_dirs, family):
    tok = load_tokenizer(family_dirs[family])
    assert tok.kind == "tokenizers"
    assert_same_as_transformers(tok, auto_tokenizer(family_dirs[family]))


def test_families_have_what_the_checks_need(family_dirs):
    """The fixtures are what they claim: BOS from the post-processor where the family adds one,
    non-special added tokens kept by decode, specials skipped, clean-up where it is forced."""
    llama2, llama3 = load_tokenizer(family_dirs["llama2"]), load_tokenizer(family_dirs["llama3"])
    assert llama2.encode("hi")[0] == 1 and llama2.eos_token_ids == (2,)
    assert llama3.encode("hi")[0] == llama3._backend.raw.token_to_id("<|begin_of_text|>")
    assert "Today Date:" in llama3.render_chat("hi")
    qwen3 = load_tokenizer(family_dirs["qwen3"])
    think = qwen3.encode("<think>")
    assert len(think) == 1 and qwen3.decode(think) == "<think>"
    assert qwen3.decode(qwen3.encode("a<|im_end|>")) == "a"
    assert set(qwen3.eos_token_ids) == {qwen3.encode("<|im_end|>")[0], qwen3.encode("<|endoftext|>")[0]}
    gpt2, forced = load_tokenizer(family_dirs["gpt2"]), load_tokenizer(family_dirs["gpt2-clean-up"])
    text = "Hello , world ."
    assert gpt2.decode(gpt2.encode(text)) == text  # BPE: transformers ignores clean_up_tokenization_spaces
    assert forced.decode(forced.encode(text)) == "Hello, world."
    assert load_tokenizer(family_dirs["gpt2-hub"]).eos_token_ids == gpt2.eos_token_ids != ()
    declared_fast = load_tokenizer(family_dirs["qwen2-declared-fast"])
    assert declared_fast.decode(declared_fast.encode("a<|object_ref_start|>")) == "a"
    assert load_tokenizer(family_dirs["llama2-bare-config"]).eos_token_ids == (2,)
    hub = load_tokenizer(family_dirs["llama2-hub"])
    assert hub.encode("<s>[INST] hi") == llama2.encode("<s>[INST] hi")  # tokenized like transformers' LlamaTokenizer


def test_load_path_imports_no_transformers(family_dirs):
    dirs = [str(d) for d in family_dirs.values()]
    code = (
        "import sys\n"
        "from compiled_llm.model.tokenizer import load_tokenizer\n"
        f"for d in {dirs!r}:\n"
        "    t = load_tokenizer(d); t.encode('hi'); t.decode([1, 2]); t.encode_chat('hi')\n"
        "    if t.has_chat_template: t.apply_chat_template([{'role': 'user', 'content': 'a'}, "
        "{'role': 'assistant', 'content': 'b'}, {'role': 'user', 'content': 'c'}])\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


@pytest.mark.parametrize("family", ["llama2-hub", "llama3", "qwen2.5-hub", "qwen3", "byte-level"])
def test_save_writes_files_the_fast_loader_reads(family_dirs, family, tmp_path):
    """An engine's tokenizer: save (transformers' save_pretrained) from a fast-loaded source."""
    load_tokenizer(family_dirs[family]).save(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file() and (tmp_path / "tokenizer_config.json").is_file()
    again = load_tokenizer(tmp_path)
    assert again.kind == "tokenizers"
    assert_same_as_transformers(again, auto_tokenizer(family_dirs[family]))


@pytest.mark.parametrize("family", ["llama2-hub", "llama3", "qwen3", "gpt2-clean-up"])
def test_save_without_transformers_writes_equivalent_files(family_dirs, family, tmp_path, monkeypatch):
    from compiled_llm.model.tokenizer.tokenizer_json import TokenizerJsonBackend

    def no_transformers(self):
        raise ImportError("no transformers")

    monkeypatch.setattr(TokenizerJsonBackend, "_as_transformers", no_transformers)
    load_tokenizer(family_dirs[family]).save(tmp_path)
    want = auto_tokenizer(family_dirs[family])
    assert_same_as_transformers(load_tokenizer(tmp_path), want)
    assert_same_as_transformers(load_tokenizer(tmp_path), auto_tokenizer(tmp_path))


def test_in_memory_byte_level_matches_its_transformers_twin():
    from transformers import PreTrainedTokenizerFast

    from compiled_llm.model.tokenizer.byte_level import CHATML_TEMPLATE

    tok = byte_level_tokenizer()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok._backend.raw, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 chat_template=CHATML_TEMPLATE)
    assert_same_as_transformers(tok, hf)


def test_template_environment_matches_transformers():
    """Globals, filters, whitespace control and the sandbox, rendered by both."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = (
        "{%- set ns = namespace(n=0) -%}\n"
        "{% for m in messages %}\n"
        "  {% if loop.index0 > 5 %}{% break %}{% endif %}\n"
        "  {% set ns.n = ns.n + 1 %}\n"
        "  {{ m.role }}: {{ m.content | tojson }} {{ m | tojson(indent=2, sort_keys=True) }}\n"
        "  {{ dict(a=1, b=m.role) | tojson }} {{ dict.fromkeys(['x']) | tojson }}\n"
        "{% endfor %}\n"
        "{{ ns.n }} {{ bos_token }}|{{ eos_token }}|{{ strftime_now('%Y') }}|{{ tools }}|{{ documents }}\n"
        "{% generation %}gen {{ add_generation_prompt }}{% endgeneration %}"
    )
    messages = [{"role": "user", "content": "<b>\"q\"</b> é 🚀"}, {"role": "assistant", "content": "a", "thinking": "t"}]
    variables = {"bos_token": "<s>", "eos_token": "</s>"}
    want, _ = render_jinja_template([messages], chat_template=template, add_generation_prompt=True, **variables)
    assert render_chat_template(template, messages, True, variables) == want[0]
    from compiled_llm.errors import CompiledLLMError

    for bad, message in (("{{ raise_exception('nope') }}", "nope"), ("{% set ns = namespace(_x=1) %}", "underscore"),
                         ("{{ messages.__class__.__mro__ }}", "unsafe")):
        with pytest.raises(CompiledLLMError, match=message):
            render_chat_template(bad, messages, True, variables)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_describe_names_the_class_special_tokens_and_template_transformers_loads(family_dirs, family):
    """What /tokenizer_info serves, as vLLM's gives it from transformers' tokenizer."""
    info = load_tokenizer(family_dirs[family]).describe()
    hf = auto_tokenizer(family_dirs[family])
    assert info["tokenizer_class"] == type(hf).__name__
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert info.get(name) == getattr(hf, name), name
    assert info.get("chat_template") == (hf.chat_template or None)
    json.dumps(info)  # served as JSON as it is
