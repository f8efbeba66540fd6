"""Tokenizer: HF tokenizer files, a bare sentencepiece model, the presets' byte-level tokenizer,
chat templates with a plain fallback, and save/load round trips. (test_tokenizer_files.py checks
the tokenizer.json loader against transformers family by family.)

The trained tokenizers (a tokenizers-library BPE and a sentencepiece model, trained on a small
text) come from helpers/trained_tokenizers.py, which the CLI tests share."""

from __future__ import annotations

import json

import pytest

from compiled_llm.errors import CompiledLLMError
from compiled_llm.model.tokenizer import DEFAULT_SYSTEM_PROMPT, byte_level_tokenizer, load_tokenizer, plain_chat_prompt
from helpers.trained_tokenizers import chat_ids_from_transformers, train_hf_tokenizer, train_sentencepiece

TEXT = "the quick fox compiles kernels, déjà vu 🚀 \n\t end"


# --- byte-level (presets) ----------------------------------------------------------------------


def test_byte_level_ids_are_bytes_and_text_round_trips():
    tok = byte_level_tokenizer()
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT
    assert tok.vocab_size == 259


def test_byte_level_specials_and_eos():
    tok = byte_level_tokenizer()
    assert tok.encode("<|endoftext|><|im_start|><|im_end|>") == [256, 257, 258]
    assert set(tok.eos_token_ids) == {256, 258}
    # specials are dropped from text unless asked for
    assert tok.decode([104, 105, 258]) == "hi"
    assert tok.decode([104, 105, 258], skip_special_tokens=False) == "hi<|im_end|>"


def test_byte_level_chat_is_chatml_with_default_system_prompt(tmp_path):
    from transformers import AutoTokenizer

    tok = byte_level_tokenizer()
    assert tok.has_chat_template
    expected = (
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.render_chat("hello") == expected
    assert tok.encode_chat("hello") == tok.encode(expected)
    tok.save(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.encode_chat("hello") == chat_ids_from_transformers(hf, "hello", DEFAULT_SYSTEM_PROMPT)


def test_multi_turn_chat_ids(tmp_path):
    from transformers import AutoTokenizer

    tok = byte_level_tokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello 🚀"}, {"role": "user", "content": "again"}]
    ids = tok.apply_chat_template(messages)
    assert tok.decode(ids, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\nhello 🚀<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    )
    tok.save(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert ids == list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert tok.apply_chat_template(messages[:2], add_generation_prompt=False) == tok.encode(
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    )


def test_decode_ignores_ids_beyond_the_tokenizer_vocab():
    tok = byte_level_tokenizer()
    assert tok.decode([104, 5000, 105, 151000]) == "hi"


def test_byte_level_save_and_reload(tmp_path):
    tok = byte_level_tokenizer()
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again is not None and again.kind == "tokenizers"
    assert again.encode(TEXT) == tok.encode(TEXT)
    assert again.encode_chat("hi", "be brief") == tok.encode_chat("hi", "be brief")
    assert set(again.eos_token_ids) == set(tok.eos_token_ids)


# --- tokenizers-library tokenizer.json ---------------------------------------------------------


def test_tokenizer_json_loads_without_transformers(tmp_path):
    raw, hf = train_hf_tokenizer()
    hf.save_pretrained(str(tmp_path))
    tok = load_tokenizer(tmp_path)
    assert tok.kind == "tokenizers"
    assert tok.encode(TEXT) == raw.encode(TEXT).ids
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.eos_token_ids[0] == raw.token_to_id("<|im_end|>")
    system = "You are terse."
    assert tok.encode_chat("the fox", system) == chat_ids_from_transformers(hf, "the fox", system)


def test_bare_tokenizer_json_without_config(tmp_path):
    raw, _ = train_hf_tokenizer()
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok.encode(TEXT) == raw.encode(TEXT).ids


def test_vocab_and_merges_without_tokenizer_json_load_through_transformers(tmp_path):
    from transformers import AutoTokenizer

    raw, _ = train_hf_tokenizer()
    raw.model.save(str(tmp_path))  # vocab.json + merges.txt
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    tok = load_tokenizer(tmp_path)
    assert tok.kind == "transformers"
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.encode(TEXT) == hf.encode(TEXT) and tok.decode(tok.encode(TEXT)) == hf.decode(hf.encode(TEXT))
    assert tok.vocab_size == len(hf)
    tok.save(tmp_path / "engine")  # save_pretrained writes a tokenizer.json, read without transformers next time
    again = load_tokenizer(tmp_path / "engine")
    assert again.kind == "tokenizers" and again.encode(TEXT) == tok.encode(TEXT)


def test_no_chat_template_uses_plain_fallback(tmp_path):
    _, hf = train_hf_tokenizer(chat_template=None)
    hf.save_pretrained(str(tmp_path))
    tok = load_tokenizer(tmp_path)
    assert not tok.has_chat_template
    assert tok.render_chat("hi there") == f"{DEFAULT_SYSTEM_PROMPT}\n\nUser: hi there\nAssistant:"
    assert tok.encode_chat("hi there", None) == tok.encode(plain_chat_prompt("hi there", None))
    assert tok.encode_chat("hi there", None) == tok.encode("User: hi there\nAssistant:")
    with pytest.raises(CompiledLLMError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# --- sentencepiece -----------------------------------------------------------------------------


def test_sentencepiece_model_is_used_directly(tmp_path):
    import sentencepiece

    path = train_sentencepiece(tmp_path / "tokenizer.model")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    tok = load_tokenizer(tmp_path)
    assert tok.kind == "sentencepiece"
    assert tok.vocab_size == 200
    text = "the lazy dog runs fast"
    assert tok.encode(text) == [sp.bos_id()] + sp.encode(text)
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_ids == (sp.eos_id(),)
    assert not tok.has_chat_template
    assert tok.encode_chat("the dog") == tok.encode(plain_chat_prompt("the dog", DEFAULT_SYSTEM_PROMPT))


def test_sentencepiece_save_and_reload(tmp_path):
    (tmp_path / "a").mkdir()
    train_sentencepiece(tmp_path / "a" / "tokenizer.model")
    tok = load_tokenizer(tmp_path / "a")
    tok.save(tmp_path / "b")
    again = load_tokenizer(tmp_path / "b")
    assert again.kind == "sentencepiece"
    assert again.encode("the quick fox") == tok.encode("the quick fox")


def test_unloadable_hf_files_fall_back_to_sentencepiece(tmp_path):
    train_sentencepiece(tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer.json").write_text("{not json")
    tok = load_tokenizer(tmp_path)
    assert tok.kind == "sentencepiece"


# --- no tokenizer / broken tokenizer -----------------------------------------------------------


def test_directory_without_tokenizer_gives_none(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert load_tokenizer(tmp_path) is None


def test_corrupt_tokenizer_raises_one_line_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CompiledLLMError, match="cannot load the tokenizer") as e:
        load_tokenizer(tmp_path)
    assert "\n" not in str(e.value)
