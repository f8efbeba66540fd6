"""``LLM``: the offline API, vLLM style.

    from compiled_llm import LLM, SamplingParams
    llm = LLM("tiny-qwen2")  # an engine directory, or a model source: built once, then cached
    for out in llm.generate(["Hello"], SamplingParams(max_tokens=32)):
        print(out.text)
    for delta in llm.stream("Tell me a story", SamplingParams(max_tokens=64)):
        print(delta, end="", flush=True)
    llm.chat([{"role": "user", "content": "Hi"}])  # the tokenizer's chat template

Without a SamplingParams, requests take ``get_default_sampling_params()``: vLLM's defaults with
the model's own from its generation_config.json (temperature, top_p, ...) on top.

One engine runs in this process (``EngineLoop``). With ``data_parallel_size=N`` > 1, N replicas
of it run in engine processes of their own, placed as ``compiled-llm serve`` places them
(``engine_process.dp_placement``), and this process routes each request to one
(``engine_process.sync_client``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import logging
import numbers
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from tqdm.auto import tqdm

from compiled_llm.engine.artifact import build_config, read_manifest
from compiled_llm.engine.build_config import BuildConfig, option_flags, option_text
from compiled_llm.engine.cache import cached_engine
from compiled_llm.engine.loaded_model import LoadedModel
from compiled_llm.engine.loader import is_engine_dir, load_model
from compiled_llm.errors import CompiledLLMError, InvalidOptionError, InvalidRequestError
from compiled_llm.model.placement import dtype_name
from compiled_llm.model.tokenizer import plain_chat_prompt
from compiled_llm.serve.engine_config import EngineConfig
from compiled_llm.serve.engine_loop import EngineLoop, RequestQueue
from compiled_llm.serve.kernel_warmup import warm_kernels
from compiled_llm.serve.llm_engine import EngineStats, LLMEngine
from compiled_llm.serve.outputs import RequestOutput
from compiled_llm.serve.sampling_params import SamplingParams


def _is_single_prompt(prompts: Any) -> bool:
    if isinstance(prompts, (str, bytes, dict)):
        return True
    # a bare list of token ids is one prompt
    return isinstance(prompts, (list, tuple)) and bool(prompts) and all(isinstance(t, numbers.Integral) for t in prompts)


def _as_conversations(messages: Any) -> list[list[Mapping]]:
    """``messages`` as a list of conversations, each checked: as in vLLM's ``LLM.chat``, one
    conversation (a list of {"role", "content"} dicts) or a list of conversations."""
    if not isinstance(messages, (list, tuple)):
        raise InvalidRequestError(
            f"messages must be a list of {{'role', 'content'}} dicts or a list of such lists, got {type(messages).__name__}"
        )
    batch = bool(messages) and all(isinstance(m, (list, tuple)) for m in messages)
    conversations = list(messages) if batch else [messages]
    for i, conversation in enumerate(conversations):
        _check_conversation(conversation, f"conversation {i}" if batch else "conversation")
    return [list(c) for c in conversations]


def _check_conversation(conversation: Sequence, where: str) -> None:
    if not conversation:
        raise InvalidRequestError(f"{where} is empty; give at least one message")
    for j, message in enumerate(conversation):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(
                f"{where}: message {j} must be a dict with 'role' and 'content', got {type(message).__name__}"
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"{where}: message {j} needs a 'role' string")
        if "content" not in message:
            raise InvalidRequestError(f"{where}: message {j} ({role}) has no 'content'")
        if message["content"] is None and message.get("tool_calls"):
            continue  # an assistant's calls without text
        if not isinstance(message["content"], str):
            raise InvalidRequestError(
                f"{where}: message {j} ({role}) content must be a string, got {type(message['content']).__name__}"
            )


def _template_message(message: Mapping) -> Mapping:
    """A message as chat templates read it: an assistant's calls with their arguments as dicts
    (the API carries them as JSON text), content None as ""."""
    if not message.get("tool_calls"):
        return message
    from compiled_llm.serve.openai.tool_calls import template_tool_calls

    return {**message, "content": message.get("content") or "", "tool_calls": template_tool_calls(message["tool_calls"])}


def _constrained(sampling_params, structured_outputs, count: int, defaults) -> list[SamplingParams]:
    """Each request's SamplingParams under ``structured_outputs`` (a tool_choice's grammar)."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * count
    out = []
    for params in sampling_params:
        params = defaults() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams or a list of them, got "
                                      f"{type(params).__name__}")
        if params.structured_outputs is not None:
            raise InvalidRequestError("tool_choice 'required' or naming a function constrains the output to tool "
                                      "calls; give sampling params without structured_outputs")
        out.append(dataclasses.replace(params, structured_outputs=structured_outputs))
    return out


def _plain_transcript(conversation: Sequence[Mapping], add_generation_prompt: bool) -> str:
    """The prompt ``run --chat`` uses for a tokenizer without a chat template
    (``plain_chat_prompt``). It can say one user turn after an optional system message and
    ends where the assistant starts, so any other conversation is refused."""
    roles = [m["role"] for m in conversation]
    if add_generation_prompt and roles in (["user"], ["system", "user"]):
        system = conversation[0]["content"] if roles[0] == "system" else None
        return plain_chat_prompt(conversation[-1]["content"], system)
    raise InvalidRequestError(
        "the model's tokenizer has no chat template; without one, chat takes only one user message "
        "(after an optional system message) and add_generation_prompt=True"
    )


# LLM's keywords for how a SOURCE is built: BuildConfig's fields, but max_model_len, which is the
# engine option (the runtime's limit; a SOURCE is built for the model's maximum)
BUILD_KEYWORDS = tuple(f.name for f in dataclasses.fields(BuildConfig)
                       if f.name not in {g.name for g in dataclasses.fields(EngineConfig)})


def build_keywords(options: dict) -> dict:
    """The build options among LLM's keyword ``options`` (taken out of it) that were given:
    None is "not given", and a torch.dtype or torch.device is given by its name."""
    given = {}
    for name in BUILD_KEYWORDS:
        value = options.pop(name, None)
        if isinstance(value, torch.dtype):
            value = dtype_name(value)
        elif isinstance(value, torch.device):
            value = str(value)
        if value is not None:
            given[name] = value
    return given


def check_built_with(engine_dir, asked: BuildConfig, given: Iterable[str]) -> None:
    """An engine directory is built once: every build option ``given`` must be what it was
    built with ("auto" matches any dtype and device)."""
    built = build_config(read_manifest(Path(engine_dir)))
    for name, want, was in asked.mismatches(built, given):
        raise InvalidOptionError(
            f"{engine_dir} was built with {name} {option_text(was)}, not {option_text(want)}; build it with "
            f"'compiled-llm build SOURCE {' '.join(option_flags(name, want))}', or pass its source instead")


def one_engine(config: EngineConfig) -> EngineConfig:
    """``config``, refused when it asks for data-parallel replicas: ``from_loaded`` serves a model
    loaded in this process, as one engine; replicas load their own copies."""
    if config.data_parallel_size != 1:
        size = config.data_parallel_size
        raise InvalidOptionError(
            f"data_parallel_size {size}: from_loaded serves the model loaded in this process as one engine; "
            f"replicas load their own: LLM(ENGINE_DIR, data_parallel_size={size})")
    return config


def load_replica(model: str, options: dict, placement, log_level: int | None = None) -> LLMEngine:
    """A data-parallel replica's engine, made in its engine process: ``LLM(model, **options)``'s
    (``options`` say data_parallel_size 1) on its share of the machine (``placement``, a
    ``dp_placement.ReplicaPlacement``). ``log_level``: the ``compiled_llm`` logger's level in the
    process that started it, when that one writes its records (to stderr, here too)."""
    placement.apply()
    if log_level is not None:
        own = logging.getLogger("compiled_llm")
        own.setLevel(log_level)
        if not own.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(message)s"))
            own.addHandler(handler)
    return LLM(model, **options).engine


def _progress_bar(total: int, use_tqdm: bool):
    """A bar over ``total`` requests, or None (disable=None: none when stderr is no terminal)."""
    return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True, disable=None) if use_tqdm else None


class _NotOneEngineError(InvalidOptionError, AttributeError):
    """An LLM over data-parallel replicas asked for its one engine: a one-line option error, and an
    AttributeError, so that ``hasattr(llm, "engine")`` and ``getattr(llm, "engine", None)`` work."""


class LLM:
    """Load a model and serve batches of requests with continuous batching.

    ``model`` is an engine directory (made by ``compiled-llm build``) or a model source (a
    checkpoint directory, a preset such as "tiny-qwen2", a hub id):

    - ``LLM(ENGINE_DIR)`` loads the engine;
    - ``LLM(SOURCE)`` takes the compiled path too: the source is built into the engine cache
      (``compiled_llm.engine.cache``, ``~/.cache/compiled_llm`` or ``$COMPILED_LLM_CACHE_DIR``)
      on first use and loaded from there afterwards, in this and any later process;
    - the build keywords are ``BuildConfig``'s fields (but ``max_model_len``, the engine option
      below), with vLLM's names where vLLM has the option: ``dtype`` and ``device`` ("auto":
      cuda when available; the checkpoint's float16/bfloat16 on a GPU, float32 on a CPU),
      ``quantization`` ("int8", "int4": weight-only quantized linear layers),
      ``tensor_parallel_size`` N (sharded over N ranks; loading the engine starts N - 1 worker
      processes, one per GPU, gloo on a CPU, which ``shutdown()`` or the end of this process
      stops), ``pipeline_parallel_size`` N (the layers split into N stages, each its own
      process or TP group of processes), ``disabled_passes``, ``kernel_prefs``, ``dump_ir``. A SOURCE is built so, each set
      of options into a cache entry of its own; an engine directory must have been built with
      every option given (None, the default, gives none; "auto" matches any dtype and device).
      ``device`` is also where the engine runs;
    - ``enforce_eager=True`` decodes without CUDA graphs. For a SOURCE it also skips the
      build: the eager spec program runs in the runtime (the uncompiled model, for checking
      the runtime against the reference loop);
    - ``LLM.from_loaded`` serves an already loaded model (a config, params and a program).

    The other keyword arguments are the engine's options, ``EngineConfig``'s fields
    (``max_num_seqs``, ``max_num_batched_tokens``, ``gpu_memory_utilization``, ...), with its
    defaults; an unknown name is refused.

    ``data_parallel_size=N`` > 1 runs N replicas of the engine, each in an engine process of its
    own (and its tensor-parallel ranks), placed as ``compiled-llm serve --data-parallel-size N``
    places them: replica i on GPUs i*TP*PP..(i+1)*TP*PP-1 of those visible, on a CPU each with its
    share of the cores. This process loads no weights: each request goes to the replica likely
    to hold its prompt's prefix in cache, else to the least loaded, and ``generate``, ``chat``
    and ``stream`` work as with one engine. What is one engine's (``engine``, ``stats``,
    ``engine_loop``) is refused in one line; ``replica_stats()`` and ``capture_cuda_graphs()``
    reach every replica. ``shutdown()``, or the end of this process, stops them. Their processes
    are spawned, which imports the ``__main__`` module again: a script makes such an LLM under
    ``if __name__ == "__main__":``, as multiprocessing requires.
    """

    _replicas = None  # the SyncClient over data-parallel replicas, when there are replicas

    def __init__(self, model: str, **options):
        given = build_keywords(options)
        config = EngineConfig.from_options(options)
        build = BuildConfig.from_options(given)  # bad values fail before anything loads
        if is_engine_dir(model):
            check_built_with(model, build, given)
        elif config.enforce_eager:
            for name in given:
                if name not in ("dtype", "device") and getattr(build, name) != getattr(BuildConfig(), name):
                    raise InvalidOptionError(f"{name} needs the compiled path: with enforce_eager a SOURCE runs the "
                                             "eager model on its original weights, unbuilt")
        elif config.data_parallel_size == 1:  # replicas build it where they run (once: the cache locks)
            model = cached_engine(str(model), build, warm_up=warm_kernels)
        if config.data_parallel_size > 1:
            self._start_replicas(str(model), {**given, **options, "data_parallel_size": 1}, config, build, given)
            return
        self._init_engine(load_model(model, dtype=build.dtype, device=build.device), config)

    def _start_replicas(self, model: str, options: dict, config: EngineConfig, build: BuildConfig,
                        given: Iterable[str]) -> None:
        from compiled_llm.serve.engine_process.dp_placement import engine_world_size, replica_placements
        from compiled_llm.serve.engine_process.sync_client import SyncClient

        placements = replica_placements(config.data_parallel_size, build.device,
                                        engine_world_size(model, build, given))
        own = logging.getLogger("compiled_llm")
        level = own.getEffectiveLevel() if own.handlers else None
        self._replicas = SyncClient.start_processes(
            [functools.partial(load_replica, model, options, placement, level) for placement in placements])
        # an LLM dropped unshut stops its replicas with it (the client stops them at exit too)
        weakref.finalize(self, self._replicas.shutdown).atexit = False
        self.model = dataclasses.replace(self._replicas.info.model, tokenizer=self._replicas.tokenizer)

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, **engine_options) -> "LLM":
        """An LLM over an already loaded model (tests, benchmarks: a config + params + program)."""
        self = cls.__new__(cls)
        self._init_engine(loaded, one_engine(EngineConfig.from_options(engine_options)))
        return self

    def _init_engine(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.model = loaded
        self.engine = LLMEngine(loaded, config)
        self._loop = EngineLoop(self.engine)

    def shutdown(self) -> None:
        """Stop a tensor-parallel engine's worker processes, or the data-parallel replicas' engine
        processes, now (otherwise they stop with this process); nothing can be generated
        afterwards."""
        if self._replicas is not None:
            self._replicas.shutdown()
            return
        self.engine.shutdown()

    def __getattr__(self, name: str):
        # reached when an attribute is missing, or a property raised AttributeError (the error
        # below is one): over replicas, the in-process engine's, and what only it has
        if name in ("engine", "_loop", "stats", "engine_loop") and self._replicas is not None:
            raise self._not_one_engine("engine" if name == "_loop" else name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _not_one_engine(self, what: str) -> InvalidOptionError:
        return _NotOneEngineError(
            f"{what} is one engine's, and this LLM runs {self._replicas.num_replicas} data-parallel replicas in engine "
            "processes of their own; replica_stats() and capture_cuda_graphs() reach every replica")

    @property
    def tokenizer(self):
        return self.engine.tokenizer if self._replicas is None else self._replicas.tokenizer

    @property
    def stats(self) -> EngineStats:
        if self._replicas is not None:
            raise self._not_one_engine("stats")
        return self.engine.stats

    @property
    def engine_loop(self) -> EngineLoop:
        """The loop that owns the engine (async front ends submit through it)."""
        if self._replicas is not None:
            raise self._not_one_engine("engine_loop")
        return self._loop

    @property
    def data_parallel_size(self) -> int:
        """The engine replicas serving this LLM."""
        return 1 if self._replicas is None else self._replicas.num_replicas

    def replica_stats(self) -> list[EngineStats | None]:
        """Each replica's counters (its engine's ``stats``), in replica order, None for a replica
        that has died; ``[stats]`` for one engine."""
        if self._replicas is None:
            return [self.stats]
        return self._replicas.call("stats")

    def capture_cuda_graphs(self) -> bool:
        """Capture every CUDA graph bucket now, in every replica, instead of each on first use (a
        benchmark's steady state); a replica running requests captures once it has none. False
        when graphs are off."""
        if self._replicas is None:
            return self.engine.capture_cuda_graphs()
        return any(bool(captured) for captured in self._replicas.call("capture_cuda_graphs"))

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's generation defaults applied (its
        generation_config.json's temperature, top_p, top_k, min_p, repetition_penalty and
        max_new_tokens, as vLLM's ``--generation-config auto``): what ``generate``, ``stream``
        and ``chat`` use when given no SamplingParams."""
        return SamplingParams(**self.model.generation_defaults)

    def _validate(self, prompts, sampling_params) -> list[tuple]:
        """Every request of a call checked before any is queued."""
        if _is_single_prompt(prompts):
            prompts = [prompts]
        if not isinstance(prompts, Iterable):
            raise InvalidRequestError(
                f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}"
            )
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params = [self.get_default_sampling_params() if sp is None else sp for sp in sampling_params]
            if len(params) != len(prompts):
                raise InvalidRequestError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        else:
            raise InvalidRequestError(f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}")
        validate = self.engine.validate if self._replicas is None else self._replicas.validator.validate
        return [validate(p, sp) for p, sp in zip(prompts, params)]

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``; ``sampling_params`` None is
        ``get_default_sampling_params()``. Safe to call from several threads at once."""
        requests = self._validate(prompts, sampling_params)
        if self._replicas is not None:
            return self._generate_on_replicas(requests, use_tqdm)
        finished: collections.deque[RequestQueue] = collections.deque()
        queues = self._loop.submit(requests, notify=finished.append)
        index = {id(q): i for i, q in enumerate(queues)}
        results: list[RequestOutput | None] = [None] * len(queues)
        left = len(queues)
        bar = _progress_bar(len(queues), use_tqdm)
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

    def _generate_on_replicas(self, requests: list[tuple], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(requests)
        if not requests:
            return results  # type: ignore[return-value]
        submission = self._replicas.submit(requests)
        left = len(requests)
        bar = _progress_bar(len(requests), use_tqdm)
        try:
            while left:
                for index, out in submission.take():  # not streamed: each output is its request's last
                    results[index] = out
                    left -= 1
                    if bar is not None:
                        bar.update(1)
        except BaseException:
            submission.abort()  # leave nothing half-run behind
            raise
        finally:
            if bar is not None:
                bar.close()
        return results  # type: ignore[return-value]

    def chat(
        self,
        messages: Sequence[Mapping] | Sequence[Sequence[Mapping]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping | None = None,
        tools: Sequence[Mapping] | None = None,
        tool_choice: str | Mapping | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a list
        of them, one output each, as vLLM's ``LLM.chat``: each conversation is rendered with the
        tokenizer's chat template and generated like a ``generate`` prompt (its
        ``prompt`` is the rendered text). ``chat_template_kwargs`` are extra template variables
        (e.g. ``{"enable_thinking": False}``), as vLLM's. A tokenizer without a template takes
        what ``run --chat`` takes: one user message after an optional system message.

        ``tools`` (OpenAI's function definitions) go to the template, as transformers'
        ``apply_chat_template(tools=...)``; assistant messages may carry ``tool_calls`` (their
        content None) and "tool" messages answer them. Each completion's ``tool_calls`` are
        then the calls its text makes, as the server's ``message.tool_calls``: read in the
        format the template implies (hermes ``<tool_call>`` tags, Llama 3.1's JSON; a template
        that implies none gives none). ``tool_choice`` is the server's: "auto" (the default with
        tools), "none" (nothing parsed), "required" or ``{"type": "function", "function":
        {"name": ...}}`` (decoded under a grammar of the tools' schemas, as structured outputs:
        the sampling params must ask for no other)."""
        kwargs = dict(chat_template_kwargs or {})
        tools = [dict(t) for t in tools] if tools else None
        plan = self._tool_plan(tools, tool_choice) if tools or tool_choice is not None else None
        prompts = [self._chat_prompt(c, add_generation_prompt, kwargs, tools) for c in _as_conversations(messages)]
        if plan is not None and plan.structured_outputs is not None:
            sampling_params = _constrained(sampling_params, plan.structured_outputs, len(prompts),
                                           self.get_default_sampling_params)
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        if plan is not None:
            for out in outputs:
                for completion in out.outputs:
                    _, calls = plan.parse(completion.text)
                    completion.tool_calls = [call.openai() for call in calls] or None
        return outputs

    def _tool_plan(self, tools: list[dict] | None, tool_choice):
        # the server's tool handling, imported only when a chat has tools (it brings the web stack)
        from compiled_llm.serve.openai.serving import ApiError
        from compiled_llm.serve.openai.tool_calls import plan_tools
        from compiled_llm.serve.openai.tool_parsers import PARSERS, parser_for_template

        tok = self.tokenizer
        template = tok.chat_template_text(tools=True) if tok is not None and tok.has_chat_template else None
        name = parser_for_template(template)
        try:
            return plan_tools(tools or [], tool_choice, True, lambda: PARSERS[name] if name else None)
        except ApiError as e:
            raise InvalidRequestError(e.message) from None

    def _chat_prompt(self, conversation: list[Mapping], add_generation_prompt: bool,
                     template_kwargs: dict | None = None, tools: list[dict] | None = None) -> dict:
        tok = self.tokenizer
        if tok is None:
            raise InvalidRequestError("chat needs a tokenizer, and this model has none")
        if not tok.has_chat_template:
            if tools:
                raise InvalidRequestError("the model's tokenizer has no chat template, so it cannot render tools")
            text = _plain_transcript(conversation, add_generation_prompt)
            return {"prompt_token_ids": tok.encode(text), "prompt": text}
        conversation = [_template_message(m) for m in conversation]
        try:
            ids = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                          template_kwargs=template_kwargs, tools=tools)
        except CompiledLLMError as e:  # the template refused the conversation (its raise_exception)
            raise InvalidRequestError(str(e)) from None
        # The text the ids spell: the rendered template wherever the tokenizer covers every
        # byte, as real checkpoints' byte-level BPEs do (Tokenizer renders conversations to ids only).
        return {"prompt_token_ids": ids, "prompt": tok.decode(ids, skip_special_tokens=False)}

    def stream(self, prompt: str | dict, sampling_params: SamplingParams | None = None) -> "TextStream":
        """Text deltas of one request as they are generated. The request starts at once;
        closing the stream (or dropping it) aborts it. Safe to use from several threads, and
        several streams can be read in any order."""
        (request,) = self._validate(prompt, sampling_params)
        if self._replicas is not None:
            return TextStream(_ReplicaRequest(self._replicas.submit([request], stream=True)))
        (queue,) = self._loop.submit([request], stream=True)
        return TextStream(_LoopRequest(self._loop, queue))


def _signature() -> inspect.Signature:
    """``LLM(model, *, <each build keyword>=None, **engine_options)``: what ``__init__`` takes."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in BUILD_KEYWORDS]
    params.append(inspect.Parameter("engine_options", inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params)


LLM.__init__.__signature__ = _signature()


class TextStream:
    """An iterator of one request's text deltas; ``output`` is its latest RequestOutput (the
    final one, with token ids and finish reason, once the iterator is exhausted)."""

    def __init__(self, request: "_LoopRequest | _ReplicaRequest"):
        self._request = request
        self._closed = False
        self.output: RequestOutput | None = None

    @property
    def request_id(self) -> str:
        return self._request.request_id

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        while not self._closed and (self.output is None or not self.output.finished):
            try:
                self.output = self._request.next_output()
            except BaseException:
                self.close()
                raise
            if self.output.delta_text:
                return self.output.delta_text
        self._request.settle()
        raise StopIteration

    def close(self) -> None:
        """Abort the request unless it has finished."""
        self._closed = True
        if not self._request.closed:
            self._request.abort()

    def __del__(self):
        if not self._request.closed:  # a finalizer may run anywhere, so only queue the abort
            self._request.abort(now=False)


class _LoopRequest:
    """One request of the engine in this process, as a TextStream reads it."""

    def __init__(self, loop: EngineLoop, queue: RequestQueue):
        self._loop = loop
        self._queue = queue

    @property
    def request_id(self) -> str:
        return self._queue.request_id

    @property
    def closed(self) -> bool:
        return self._queue.closed

    def next_output(self) -> RequestOutput:
        self._loop.wait(self._queue.ready)
        return self._queue.get_nowait()

    def settle(self) -> None:
        self._loop.settle()

    def abort(self, now: bool = True) -> None:
        self._loop.abort(self._queue.request_id, now=now)


class _ReplicaRequest:
    """One request on a data-parallel replica (a ``Submission`` of one), as a TextStream reads it:
    each output folds everything that has arrived since the previous one."""

    def __init__(self, submission):
        self._submission = submission

    @property
    def request_id(self) -> str:
        return self._submission.request_ids[0]

    @property
    def closed(self) -> bool:
        return self._submission.finished

    def next_output(self) -> RequestOutput:
        ((_, out),) = self._submission.take()
        return out

    def settle(self) -> None:
        pass

    def abort(self, now: bool = True) -> None:  # never waits, so a finalizer may call it
        self._submission.abort()
