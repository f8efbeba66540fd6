"""A byte-level BPE tokenizer of a real model's size, for benchmarks that depend on the
vocabulary (grammar-constrained decoding: xgrammar's masks and compile times scale with it).

No tokenizer can be downloaded here, so one is trained: byte-level BPE (GPT-2's alphabet, as
Qwen2 and Llama 3 use) on the text this machine has (the Python standard library's sources and
docstrings), up to ``--vocab-size`` tokens plus Qwen2's specials, saved with transformers like a
checkpoint's tokenizer.

    python benchmarks/bench_tokenizer.py OUT_DIR [--vocab-size 151643]
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus(limit_bytes: int):
    """Text files of the standard library, up to ``limit_bytes`` in all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        total += len(text)
        yield text
        if total >= limit_bytes:
            return


def train(out: Path, vocab_size: int, limit_bytes: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size + len(QWEN2_SPECIALS), special_tokens=QWEN2_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(corpus(limit_bytes), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.save_pretrained(str(out))
    print(f"{len(tok)} tokens -> {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab-size", type=int, default=151_643)
    parser.add_argument("--corpus-mb", type=int, default=60)
    args = parser.parse_args()
    train(args.out, args.vocab_size, args.corpus_mb << 20)
