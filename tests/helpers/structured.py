"""A lively checkpoint for structured outputs: every byte is a token (so any JSON, regex or
grammar sentence can be spelled), and a Qwen2.5-like chat template that renders tools."""

from __future__ import annotations

from pathlib import Path

from helpers.lively import make_lively_checkpoint
from helpers.trained_tokenizers import train_hf_tokenizer

# Qwen2.5's way with tools, cut down: the tools' JSON in the system turn, an assistant's calls
# with tool_call.arguments | tojson, tool answers in <tool_response>.
QWEN_LIKE_TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
For each call, return <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.content %}{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls or [] %}{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def make_structured_checkpoint(out: Path, seed: int = 0):
    """A lively Qwen2 checkpoint (``helpers.lively``) whose byte-level BPE has all 256 bytes and
    merges up to 320 tokens, with the tools template; returns the transformers model."""
    _, tok = train_hf_tokenizer(vocab_size=320, chat_template=QWEN_LIKE_TOOLS_TEMPLATE, all_bytes=True)
    return make_lively_checkpoint(out, seed=seed, tokenizer=tok)
