"""``LLM``: the offline API, vLLM style.

    from compiled_llm import LLM, SamplingParams
    llm = LLM("tiny-qwen2")  # an engine directory, or a model source: built once, then cached
    for out in llm.generate(["Hello"], SamplingParams(max_tokens=32)):
        print(out.text)
    for delta in llm.stream("Tell me a story", SamplingParams(max_tokens=64)):
        print(delta, end="", flush=True)
"""

from __future__ import annotations

import collections
import numbers
from typing import Any, Iterable, Sequence

from tqdm.auto import tqdm

from compiled_llm.engine.cache import cached_engine
from compiled_llm.engine.loaded_model import LoadedModel
from compiled_llm.engine.loader import is_engine_dir, load_model
from compiled_llm.errors import InvalidRequestError
from compiled_llm.serve.engine_config import EngineConfig
from compiled_llm.serve.engine_loop import EngineLoop, RequestQueue
from compiled_llm.serve.llm_engine import LLMEngine
from compiled_llm.serve.outputs import RequestOutput
from compiled_llm.serve.sampling import SamplingParams


def _is_single_prompt(prompts: Any) -> bool:
    if isinstance(prompts, (str, bytes, dict)):
        return True
    # a bare list of token ids is one prompt
    return isinstance(prompts, (list, tuple)) and bool(prompts) and all(isinstance(t, numbers.Integral) for t in prompts)


class LLM:
    """Load a model and serve batches of requests with continuous batching.

    ``model`` is an engine directory (made by ``compiled-llm build``) or a model source (a
    checkpoint directory, a preset such as "tiny-qwen2", a hub id):

    - ``LLM(ENGINE_DIR)`` loads the engine;
    - ``LLM(SOURCE)`` takes the compiled path too: the source is built into the engine cache
      (``compiled_llm.engine.cache``, ``~/.cache/compiled_llm`` or ``$COMPILED_LLM_CACHE_DIR``)
      on first use and loaded from there afterwards, in this and any later process. ``dtype``
      and ``device`` ("auto" or None: cuda when available; the checkpoint's float16/bfloat16
      on a GPU, float32 on a CPU) are part of the cached engine's key;
    - ``enforce_eager=True`` decodes without CUDA graphs. For a SOURCE it also skips the
      build: the eager spec program runs in the runtime (the uncompiled model, for checking
      the runtime against the reference loop);
    - ``LLM.from_loaded`` serves an already loaded model (a config, params and a program).

    The other keyword arguments are the engine's options, ``EngineConfig``'s fields
    (``max_num_seqs``, ``max_num_batched_tokens``, ``gpu_memory_utilization``, ...), with its
    defaults; an unknown name is refused.
    """

    def __init__(self, model: str, dtype=None, device=None, **engine_options):
        config = EngineConfig.from_options(engine_options)
        if not config.enforce_eager and not is_engine_dir(model):
            model = cached_engine(str(model), dtype=dtype, device=device)
        self._init_engine(load_model(model, dtype=dtype, device=device), config)

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, **engine_options) -> "LLM":
        """An LLM over an already loaded model (tests, benchmarks: a config + params + program)."""
        self = cls.__new__(cls)
        self._init_engine(loaded, EngineConfig.from_options(engine_options))
        return self

    def _init_engine(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.model = loaded
        self.engine = LLMEngine(loaded, config)
        self._loop = EngineLoop(self.engine)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def stats(self):
        return self.engine.stats

    def _validate(self, prompts, sampling_params) -> list[tuple]:
        """Every request of a call checked before any is queued."""
        if _is_single_prompt(prompts):
            prompts = [prompts]
        if not isinstance(prompts, Iterable):
            raise InvalidRequestError(
                f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}"
            )
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequestError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        else:
            raise InvalidRequestError(f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}")
        return [self.engine.validate(p, sp) for p, sp in zip(prompts, params)]

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. Safe to call from several threads at once."""
        requests = self._validate(prompts, sampling_params)
        finished: collections.deque[RequestQueue] = collections.deque()
        queues = self._loop.submit(requests, notify=finished.append)
        index = {id(q): i for i, q in enumerate(queues)}
        results: list[RequestOutput | None] = [None] * len(queues)
        left = len(queues)
        bar = None
        if use_tqdm:
            # disable=None: no bar when stderr is not a terminal
            bar = tqdm(total=len(queues), desc="requests", unit="req", dynamic_ncols=True, disable=None)
        try:
            while left:
                self._loop.wait(lambda: bool(finished))
                queue = finished.popleft()
                results[index[id(queue)]] = queue.get_nowait()
                left -= 1
                if bar is not None:
                    bar.update(1)
        except BaseException:
            for q in queues:  # leave nothing half-run behind
                if not q.closed:
                    self._loop.abort(q.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        self._loop.settle()
        return results  # type: ignore[return-value]

    def stream(self, prompt: str | dict, sampling_params: SamplingParams | None = None) -> "TextStream":
        """Text deltas of one request as they are generated. The request starts at once;
        closing the stream (or dropping it) aborts it. Safe to use from several threads, and
        several streams can be read in any order."""
        (request,) = self._validate(prompt, sampling_params)
        (queue,) = self._loop.submit([request], stream=True)
        return TextStream(self._loop, queue)


class TextStream:
    """An iterator of one request's text deltas; ``output`` is its latest RequestOutput (the
    final one, with token ids and finish reason, once the iterator is exhausted)."""

    def __init__(self, loop: EngineLoop, queue: RequestQueue):
        self._loop = loop
        self._queue = queue
        self._closed = False
        self.output: RequestOutput | None = None

    @property
    def request_id(self) -> str:
        return self._queue.request_id

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        while not self._closed and (self.output is None or not self.output.finished):
            try:
                self._loop.wait(self._queue.ready)
                self.output = self._queue.get_nowait()
            except BaseException:
                self.close()
                raise
            if self.output.delta_text:
                return self.output.delta_text
        self._loop.settle()
        raise StopIteration

    def close(self) -> None:
        """Abort the request unless it has finished."""
        self._closed = True
        if not self._queue.closed:
            self._loop.abort(self._queue.request_id)

    def __del__(self):
        if not self._queue.closed:  # a finalizer may run anywhere, so only queue the abort
            self._loop.abort(self._queue.request_id, now=False)
