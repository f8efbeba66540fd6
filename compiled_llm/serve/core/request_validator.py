"""Everything that can be wrong with a request, checked before it is queued: the prompt's form
and tokens, its length against the model and the KV cache, and its sampling parameters.

The engine checks with one of these (``LLMEngine.validate``), and so does the server's front end,
in its own process, from the limits the engine reported (``EngineInfo``): a bad request is
refused with its one-line reason before it reaches the engine.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Mapping

from compiled_llm.errors import InvalidRequestError
from compiled_llm.serve.core.block_manager import cdiv, window_blocks
from compiled_llm.serve.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class RequestValidator:
    tokenizer: Any  # compiled_llm.model.tokenizer.Tokenizer, or None
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    # whether the program yields the logits of chosen rows (engine/program.py), which
    # prompt_logprobs needs
    yields_chosen_rows: bool = True
    # a model whose every layer slides gives back the blocks behind its window (block_manager),
    # so a sequence holds at most a window's blocks and one step's (of up to max_step_tokens)
    kv_window: int | None = None
    max_step_tokens: int = 1

    def prompt_token_ids(self, prompt: Any, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text, {"prompt_token_ids": [...]} or a list
        of ids; a text gets the tokenizer's special tokens (BOS) unless ``add_special_tokens``
        is False. A text too long to fit the model in any tokenization is refused untokenized."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "text prompt given but the model has no tokenizer; pass {'prompt_token_ids': [...]}"
                )
            self._check_text(prompt)
            return prompt, self.tokenizer.encode(prompt, add_special_tokens)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" not in prompt:
                raise InvalidRequestError("a dict prompt needs a 'prompt_token_ids' list")
            ids = prompt["prompt_token_ids"]
            text = prompt.get("prompt")
        elif isinstance(prompt, (list, tuple)):
            ids, text = prompt, None
        elif isinstance(prompt, (bytes, bytearray)):
            raise InvalidRequestError("prompt is bytes; decode it to a str first")
        else:
            raise InvalidRequestError(
                f"a prompt is a string, a list of token ids or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
            )
        if not isinstance(ids, (list, tuple)):
            raise InvalidRequestError("prompt_token_ids must be a list of integers")
        if all(type(t) is int for t in ids):  # the common case, checked without the ABC machinery
            return text, list(ids)
        if any(not isinstance(t, numbers.Integral) or isinstance(t, bool) for t in ids):
            raise InvalidRequestError("prompt_token_ids must be a list of integers")
        return text, [int(t) for t in ids]

    def blocks_needed(self, context: int) -> int:
        """The most KV-cache blocks a sequence of ``context`` tokens holds at once."""
        whole = cdiv(context, self.block_size)
        if self.kv_window is None:
            return whole
        return min(whole, window_blocks(self.kv_window, self.block_size, min(self.max_step_tokens, context)))

    def _check_text(self, text: str) -> None:
        if len(text) > self.max_model_len:  # shorter texts are cheap to tokenize and count
            limit = self.max_model_len * self.tokenizer.max_text_bytes_per_token
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > limit:
                raise InvalidRequestError(
                    f"prompt of {size} bytes cannot fit the model's max length of {self.max_model_len} tokens"
                )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequestError(
                f"prompt is not valid UTF-8 text: {text[e.start]!r} at position {e.start} (a lone surrogate)"
            ) from None

    def validate(self, prompt: Any, params: SamplingParams | None) -> tuple[str | None, list[int], SamplingParams]:
        """(text, prompt ids, params) of a request that can be served, or InvalidRequestError."""
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params)  # re-runs its validation
        text, ids = self.prompt_token_ids(prompt)
        n = len(ids)
        if n == 0:
            raise InvalidRequestError("prompt is empty; give at least one token")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise InvalidRequestError(f"prompt token id {bad} is outside the model's vocabulary (0..{self.vocab_size - 1})")
        bad = next((t for t in params.stop_token_ids or () if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            # a stop id is a logits column (min_tokens masks it on the device)
            raise InvalidRequestError(f"stop token id {bad} is outside the model's vocabulary (0..{self.vocab_size - 1})")
        if params.prompt_logprobs is not None and not self.yields_chosen_rows:
            raise InvalidRequestError("prompt_logprobs is not supported by this engine: its program yields only each "
                                      "sequence's last logits")
        if n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt of {n} tokens + max_tokens {params.max_tokens} exceeds the model's max length of {self.max_model_len} tokens"
            )
        need = self.blocks_needed(n + params.max_tokens)
        if need > self.num_blocks:
            raise InvalidRequestError(
                f"request needs {need} KV-cache blocks ({n} + {params.max_tokens} tokens) but the cache has only {self.num_blocks}"
            )
        if params.n > self.max_num_seqs:
            raise InvalidRequestError(f"n = {params.n} exceeds max_num_seqs ({self.max_num_seqs})")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer, and this model has none")
        bad = next((t for t in params.logit_bias or () if t >= self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"logit_bias token id {bad} is outside the model's vocabulary "
                                      f"(0..{self.vocab_size - 1})")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured outputs need a tokenizer, and this model has none")
            # a function-level import: xgrammar loads with the first structured request
            from compiled_llm.serve.core.structured_output.grammar_check import check_structured_outputs

            check_structured_outputs(params.structured_outputs)
            start = params.structured_outputs.start_after_token_id
            if start is not None and start >= self.vocab_size:
                raise InvalidRequestError(f"start_after_token_id {start} is outside the model's vocabulary "
                                          f"(0..{self.vocab_size - 1})")
        return text, ids, params
