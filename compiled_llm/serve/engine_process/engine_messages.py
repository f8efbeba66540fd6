"""What the engine process and the server's front end say to each other, in plain tuples.

From the front end (each one a message):

    ("add", [(request_id, prompt text | None, prompt ids, SamplingParams), ...], stream)
    ("abort", [request_id, ...])
    ("call", call_id, method)              one of ``engine_core.CALLS``: the engine's stats, or
                                           its CUDA graphs captured (LLM's, between requests)
    ("shutdown",)

From the engine process:

    ("ready", EngineInfo, tokenizer, EngineSnapshot)
                                           once the engine has loaded
    ("failed", message)                    instead, when it could not load
    ("step", outputs, errors, scheduled, EngineSnapshot)
                                           after each step, or after commands that changed
                                           something: the outputs that changed (``EncodedOutput``),
                                           (request_id, kind, message) for requests that failed,
                                           the ids that have left the waiting queue, and counters
    ("called", call_id, error | None, value)
                                           a call's answer: its value, or why it failed

A request that is not streamed is in one "step" message only, the one of the step that finished
it (``LLMEngine`` reports it then only): it costs the front end once, whatever its length.
An output travels as what is new since the request's previous one: each completion's deltas,
never the whole text or token list again, so a stream of n tokens costs O(n) on the wire and not
O(n^2). ``OutputAssembler`` (front end) adds the deltas up into the ``RequestOutput``s the engine
returned (and detokenizes, see there); ``LLMEngine.step_deltas`` makes them on the engine side.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

from compiled_llm.engine.loaded_model import LoadedModel
from compiled_llm.errors import EngineError, InvalidRequestError
from compiled_llm.serve.core.detokenizer import IncrementalDetokenizer
from compiled_llm.serve.outputs import CompletionOutput, RequestOutput
from compiled_llm.serve.sampling_params import SamplingParams
from compiled_llm.serve.core.sequence import RequestMetrics
from compiled_llm.serve.core.text_pieces import TextPieces


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What the front end needs to know of the loaded engine: to name it, to validate requests
    and to apply its generation defaults, without loading it."""

    name: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    generation_defaults: dict
    device: str
    num_speculative_tokens: int = 0  # 0: the engine does not speculate
    kv_window: int | None = None  # RequestValidator's: set when every layer slides
    max_step_tokens: int = 1
    yields_chosen_rows: bool = True  # RequestValidator's: prompt_logprobs can be served
    # the loaded model without its weights (``described``): what LLM's ``model`` is over replicas
    model: LoadedModel | None = None

    @classmethod
    def of(cls, engine) -> "EngineInfo":
        model = engine.model
        return cls(
            name=str(model.name),
            vocab_size=model.config.vocab_size,
            max_model_len=engine.max_model_len,
            block_size=engine.config.block_size,
            num_blocks=engine.num_blocks,
            max_num_seqs=engine.config.max_num_seqs,
            generation_defaults=dict(model.generation_defaults),
            device=str(engine.device),
            num_speculative_tokens=engine.config.speculative.num_speculative_tokens if engine.config.speculative else 0,
            kv_window=engine.validator.kv_window,
            max_step_tokens=engine.validator.max_step_tokens,
            yields_chosen_rows=engine.validator.yields_chosen_rows,
            model=described(model),
        )


def described(model: LoadedModel) -> LoadedModel:
    """``model`` without its weights and program (they stay with the engine) and its tokenizer
    (which travels on its own): its name, config, dtype, device, manifest and generation
    defaults, for a front end in another process."""
    return dataclasses.replace(model, params={}, program=None, tokenizer=None)


class EngineSnapshot(NamedTuple):
    """The engine's gauges now and its counters so far (the server's metrics)."""

    running: int  # sequences in the running batch
    waiting: int  # sequences waiting to be scheduled
    kv_cache_usage: float  # fraction of KV-cache blocks held by requests
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int
    # speculative decoding (all 0 without it): sequence-steps that verified drafts, the draft
    # tokens they proposed, those accepted, and accepted drafts by position in the draft
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    steps: int = 0  # engine steps run (the iteration_tokens histogram)

    @classmethod
    def of(cls, engine) -> "EngineSnapshot":
        sched, bm, st = engine.scheduler, engine.block_manager, engine.stats
        spec = engine.speculator.stats if engine.speculator is not None else None
        return cls(len(sched.running), len(sched.waiting), 1.0 - bm.num_free_blocks / bm.num_blocks,
                   st.prefill_tokens, st.generated_tokens, sched.num_preemptions,
                   bm.stats.queried_tokens, bm.stats.hit_tokens,
                   *((spec.drafting_seqs, spec.draft_tokens, spec.accepted_tokens, tuple(spec.accepted_per_position))
                     if spec is not None else (0, 0, 0, ())), st.steps)


# ---- outputs -------------------------------------------------------------------------------------------

# (index, delta_text, delta_token_ids, finish_reason, stop_reason, cumulative_logprob, delta_logprobs)
EncodedCompletion = tuple
# (request_id, finished, metrics when finished else None, prompt_logprobs when new else None,
#  [EncodedCompletion, ...])
EncodedOutput = tuple


def encode_output(out: RequestOutput) -> EncodedOutput:
    """A ``RequestOutput`` as what is new in it (``LLMEngine.step_deltas`` makes these directly;
    this is for the other outputs, an abort's)."""
    completions = [
        (c.index, c.delta_text, list(c.delta_token_ids), c.finish_reason, c.stop_reason, c.cumulative_logprob,
         c.delta_logprobs)
        for c in out.outputs
    ]
    return (out.request_id, out.finished, out.metrics if out.finished else None,
            out.prompt_logprobs, completions)


@dataclasses.dataclass(eq=False)
class _Completion:
    index: int
    wants_logprobs: bool
    detokenizer: IncrementalDetokenizer | None  # when the front end detokenizes
    text: TextPieces = dataclasses.field(default_factory=TextPieces)  # the engine's text, without one
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)


class OutputAssembler:
    """One request's outputs rebuilt from its encoded deltas, as ``LLMEngine.step`` returns
    them: ``text``, ``token_ids`` and ``logprobs`` whole (copies once finished), the deltas new.
    ``take`` folds every delta since the previous output into one, so a reader that falls behind
    catches up in one output.

    The engine detokenizes only requests with stop strings (a stop string must end its sequence
    at the token that completes it). For the others this side does (``engine_params``): its
    incremental detokenizer then decodes each new window once per output, not once per token,
    and the engine's steps carry no text work at all."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer=None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        here = tokenizer is not None and params.detokenize and not params.stop
        self._completions = [
            _Completion(i, params.logprobs is not None, IncrementalDetokenizer(tokenizer) if here else None)
            for i in range(params.n)
        ]
        self._prompt_logprobs = None
        self._metrics = RequestMetrics(0.0)  # replaced by the engine's when the request finishes

    @staticmethod
    def engine_params(params: SamplingParams, tokenizer) -> SamplingParams:
        """The parameters the engine runs the request with: without detokenizing when this side
        does it."""
        if tokenizer is not None and params.detokenize and not params.stop:
            return dataclasses.replace(params, detokenize=False)
        return params

    def take(self, items: Sequence[EncodedOutput]) -> RequestOutput:
        """One output for ``items``, the request's encoded outputs since the previous call."""
        changed: dict[int, list] = {}  # index -> [token ids, engine text, logprobs, last completion]
        for _, _, metrics, prompt_logprobs, completions in items:
            if metrics is not None:
                self._metrics = metrics
            if prompt_logprobs is not None:
                self._prompt_logprobs = prompt_logprobs
            for comp in completions:
                entry = changed.setdefault(comp[0], [[], [], [], None])
                entry[0].extend(comp[2])
                entry[1].append(comp[1])
                if comp[6]:
                    entry[2].extend(comp[6])
                entry[3] = comp
        outputs = []
        for index in sorted(changed):
            delta_ids, texts, delta_logprobs, last = changed[index]
            _, _, _, finish_reason, stop_reason, cumulative, _ = last
            c = self._completions[index]
            done = finish_reason is not None
            c.token_ids.extend(delta_ids)
            if c.detokenizer is not None:
                if delta_ids:
                    c.detokenizer.add_tokens(delta_ids)
                if done:
                    c.detokenizer.finalize()
                delta_text = c.detokenizer.take_delta(done)
                text = c.detokenizer.snapshot()
            else:
                delta_text = "".join(texts)
                c.text.append(delta_text)
                text = c.text.snapshot()
            if c.wants_logprobs:
                c.logprobs.extend(delta_logprobs)
            outputs.append(CompletionOutput(
                index=index,
                text=text,
                token_ids=list(c.token_ids) if done else c.token_ids,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                cumulative_logprob=cumulative,
                logprobs=(list(c.logprobs) if done else c.logprobs) if c.wants_logprobs else None,
                delta_text=delta_text,
                delta_token_ids=delta_ids,
                delta_logprobs=delta_logprobs if c.wants_logprobs else None,
            ))
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=items[-1][1],
            metrics=self._metrics,
            prompt_logprobs=self._prompt_logprobs,
        )


def request_error(kind: str, message: str) -> Exception:
    """The exception a request failed with in the engine, from its (kind, message)."""
    return InvalidRequestError(message) if kind == "invalid" else EngineError(message)
