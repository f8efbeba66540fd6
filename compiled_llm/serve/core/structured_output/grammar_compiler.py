"""Grammars compiled against the engine's vocabulary on worker threads, never on the step loop,
and cached by what they depend on (``StructuredOutputsParams.key``): a request whose grammar is
new waits for its compile while the others keep running; one whose grammar is cached (or being
compiled for another request) pays nothing more.

The first compile also builds xgrammar's view of the tokenizer (a pass over the vocabulary);
later ones reuse it."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import threading
import time
from typing import Sequence

import xgrammar as xgr

from compiled_llm.model.tokenizer.interface import Tokenizer
from compiled_llm.serve.core.structured_output.grammar_check import ebnf_of_choice, json_safe_string_lengths
from compiled_llm.serve.core.structured_output.grammar_matcher import GrammarMatcher
from compiled_llm.serve.core.structured_output.tokenizer_info import tokenizer_info
from compiled_llm.serve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled grammars kept (least recently asked for goes first); a JSON schema's is ~0.1-1 MB
MAX_CACHED_GRAMMARS = 512
COMPILE_THREADS = 2


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 threads: int = COMPILE_THREADS, max_cached: int = MAX_CACHED_GRAMMARS):
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_token_ids = tuple(stop_token_ids)
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()  # the cache
        self._compiler_lock = threading.Lock()  # the first compile's pass over the vocabulary
        self._compiler: xgr.GrammarCompiler | None = None
        self._quote_ids: frozenset[int] = frozenset()
        self._cache: collections.OrderedDict[tuple, concurrent.futures.Future] = collections.OrderedDict()
        self._max_cached = max_cached
        self.compile_s: dict[tuple, float] = {}  # seconds each cached grammar took to compile
        self.live_matchers = 0  # matchers made and not yet released (a finished sequence releases its own)

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A new sequence's matcher of ``params``' grammar (compiled once for all of them)."""
        self.live_matchers += 1
        return GrammarMatcher(self.compile(params), on_release=self._released, dormant_until=params.start_after_token_id,
                              quote_ids=self._quote_ids_of_vocabulary)

    def _quote_ids_of_vocabulary(self) -> frozenset[int]:
        """The ids whose text holds a double quote (made with the first compile)."""
        return self._quote_ids

    def _released(self) -> None:
        self.live_matchers -= 1

    def compile(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """The compiled grammar of ``params``, as a future: done at once when it is cached."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, params, key)
            self._cache[key] = future
            while len(self._cache) > self._max_cached:
                old, _ = self._cache.popitem(last=False)
                self.compile_s.pop(old, None)
            return future

    def _xgrammar_compiler(self) -> xgr.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                info = tokenizer_info(self._tokenizer, self.vocab_size, self._stop_token_ids)
                self._quote_ids = frozenset(i for i, t in enumerate(info.decoded_vocab) if b'"' in t)
                # our own cache holds the results; xgrammar's would hold them twice
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile(self, params: StructuredOutputsParams, key: tuple) -> xgr.CompiledGrammar:
        compiler = self._xgrammar_compiler()
        t0 = time.perf_counter()
        kind = params.kind
        if kind == "json":
            grammar = compiler.compile_json_schema(json.dumps(json_safe_string_lengths(params.schema)),
                                                   any_whitespace=not params.disable_any_whitespace,
                                                   strict_mode=True)
        elif kind == "json_object":  # an object, as OpenAI's json_object promises (not any JSON value)
            grammar = compiler.compile_json_schema('{"type": "object"}', any_whitespace=not params.disable_any_whitespace,
                                                   strict_mode=False)
        elif kind == "regex":
            grammar = compiler.compile_regex(params.regex)
        elif kind == "choice":
            grammar = compiler.compile_grammar(ebnf_of_choice(params.choice))
        else:
            grammar = compiler.compile_grammar(params.grammar)
        elapsed = time.perf_counter() - t0
        self.compile_s[key] = elapsed
        logger.debug("compiled a %s grammar in %.1f ms", kind, 1e3 * elapsed)
        return grammar

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
