"""Text <-> token ids, one small interface (``Tokenizer``, ``interface.py``) over the tokenizers a
checkpoint may carry, each backend in its own module:

- ``tokenizer_json.py``: a Hugging Face ``tokenizer.json`` with the ``tokenizers`` library alone,
  tokenizer_config.json, special_tokens_map.json and chat_template.jinja read the way
  transformers' AutoTokenizer reads them. Loading an engine's tokenizer therefore never imports
  transformers, which alone costs seconds of a fresh process's start.
- ``transformers_backend.py``: other Hugging Face tokenizer files (vocab.json/merges.txt, a
  tokenizer_config.json beside a sentencepiece model, tokenizers that need remote code) through
  transformers' AutoTokenizer.
- ``sentencepiece_backend.py``: a bare sentencepiece ``tokenizer.model`` (or one the above cannot
  load) with the sentencepiece library.
- ``byte_level.py``: the built-in presets' tokenizer, made in code (``byte_level_tokenizer``).

``chat_template.py`` renders chat templates with jinja2, in a sandbox, the way transformers'
``apply_chat_template`` renders them, and holds the plain prompt used when there is none.

Engines copy tokenizers by ``Tokenizer.save(dir)`` (transformers' save_pretrained, so an engine
holds tokenizer.json, tokenizer_config.json and chat_template.jinja as transformers understood
them); ``load_tokenizer(dir)`` (``loader.py``) reads them back.
"""

from compiled_llm.model.tokenizer.byte_level import byte_level_tokenizer
from compiled_llm.model.tokenizer.chat_template import DEFAULT_SYSTEM_PROMPT, plain_chat_prompt
from compiled_llm.model.tokenizer.interface import Tokenizer
from compiled_llm.model.tokenizer.loader import load_tokenizer

__all__ = ["DEFAULT_SYSTEM_PROMPT", "Tokenizer", "byte_level_tokenizer", "load_tokenizer", "plain_chat_prompt"]
