"""Tokenizers trained here on a small text, for tests that need real tokenizer files: a
tokenizers-library byte-level BPE (wrapped for transformers) and a sentencepiece BPE model, what
transformers itself renders for a chat, and a Qwen-like chat template that renders tools."""

from __future__ import annotations

import io
import random
from pathlib import Path

from compiled_llm.model.tokenizer.byte_level import CHATML_TEMPLATE

# Qwen2.5's way with tools, cut down: the tools' JSON in the system turn, an assistant's calls
# with tool_call.arguments | tojson, tool answers in <tool_response>.
QWEN_TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
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

WORDS = (
    "the quick brown fox jumps over a lazy dog while the model engine compiles graphs into "
    "fused kernels and runs tokens fast on every device with paged caches"
).split()


def corpus(n_lines: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(n_lines)]


def train_hf_tokenizer(vocab_size: int = 200, chat_template: str | None = CHATML_TEMPLATE, all_bytes: bool = True):
    """A byte-level BPE trained with the tokenizers library, wrapped for transformers.
    ``all_bytes=False`` keeps only the corpus' characters, so every id is below ``vocab_size``
    (for checkpoints with a small vocab)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if all_bytes else [],
        show_progress=False,
    )
    raw.train_from_iterator(corpus(), trainer=trainer)
    kw = {"chat_template": chat_template} if chat_template else {}
    return raw, PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", **kw)


def train_sentencepiece(path: Path, vocab_size: int = 200) -> Path:
    """Train a sentencepiece BPE model on the corpus and write it to ``path``."""
    import sentencepiece

    buf = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_writer=buf, vocab_size=vocab_size,
        model_type="bpe", minloglevel=2,
    )
    path.write_bytes(buf.getvalue())
    return path


def chat_ids_from_transformers(hf_tok, user: str, system: str) -> list[int]:
    """What transformers itself gives for the chat (list in 4.x, BatchEncoding in 5.x)."""
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    out = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)
