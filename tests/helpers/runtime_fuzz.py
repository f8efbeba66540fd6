"""The runtime fuzz's draws (tests/serve/test_fuzz_runtime.py on the CPU, and
test_fuzz_runtime_gpu.py on a GPU): ``run_draw`` makes one random engine configuration and a
random workload over a pool of (prompt, transformers continuation) pairs, drives the engine one of
four ways, and compares each request's output with what its continuation says it must be."""

from __future__ import annotations

import dataclasses
import random
import re
import threading
from dataclasses import dataclass
from typing import Callable

from compiled_llm import LLM, SamplingParams
from compiled_llm.serve.core.block_manager import cdiv
from compiled_llm.serve.sampling_params import StructuredOutputsParams

MAX_NEW_TOKENS = 24
MAX_MODEL_LEN = 128


@dataclass(frozen=True)
class Expected:
    token_ids: list[int]
    text: str
    finish_reason: str


@dataclass(frozen=True)
class Request:
    prompt: dict | str
    prompt_ids: list[int]
    params: SamplingParams
    expected: Expected | None  # None: a structured request, checked by ``valid``
    valid: Callable[[str], bool] | None = None


# Structured draws spell with the lively tokenizer's letters and spaces: a regex, a choice of
# words, an EBNF grammar; each with the check of a finished output.
STRUCTURED = [
    (StructuredOutputsParams(regex="[a-z]{1,6}( [a-z]{1,6}){0,3}"),
     lambda t: re.fullmatch("[a-z]{1,6}( [a-z]{1,6}){0,3}", t) is not None),
    (StructuredOutputsParams(choice=["the cat", "a dog", "the quick fox", "sat"]),
     lambda t: t in ("the cat", "a dog", "the quick fox", "sat")),
    (StructuredOutputsParams(grammar='root ::= word (" and " word)*\nword ::= "cat" | "dog" | [a-z] [a-z]'),
     lambda t: re.fullmatch("(cat|dog|[a-z]{2})( and (cat|dog|[a-z]{2}))*", t) is not None),
]


def structured_variant(rng: random.Random, request: Request) -> Request:
    """``request`` under one of the STRUCTURED grammars, greedy or sampled, n of 1 to 3."""
    structured, valid = rng.choice(STRUCTURED)
    # top-k makes its step mask before sampling; the others sample, then check their tokens
    params = dataclasses.replace(request.params, structured_outputs=structured, stop=(), ignore_eos=False,
                                 temperature=rng.choice([0.0, 0.0, 1.0]), n=rng.choice([1, 1, 2, 3]),
                                 max_tokens=max(request.params.max_tokens, 12), seed=rng.randrange(100),
                                 top_k=rng.choice([-1, -1, -1, 5]))
    return Request(request.prompt, request.prompt_ids, params, None, valid)


def expected_output(tok, continuation, params: SamplingParams, eos_ids) -> Expected:
    """What the engine must return: the continuation up to EOS (unless ignored), the first
    stop string (text cut where it starts) or max_tokens, whichever comes first."""
    ids = list(continuation.token_ids)
    for k in range(1, params.max_tokens + 1):
        text = tok.decode(ids[:k])
        hits = [text.find(s) for s in params.stop if s in text]
        if hits:
            return Expected(ids[:k], text[: min(hits)], "stop")
        if ids[k - 1] in eos_ids and not params.ignore_eos:
            return Expected(ids[:k], text, "stop")
    return Expected(ids[: params.max_tokens], tok.decode(ids[: params.max_tokens]), "length")


def draw_requests(rng: random.Random, pool, tok, eos_ids) -> list[Request]:
    requests = []
    for _ in range(rng.randint(1, 10)):
        prompt, cont = rng.choice(pool)
        params = dict(max_tokens=rng.randint(1, MAX_NEW_TOKENS), temperature=0.0, ignore_eos=rng.random() < 0.5)
        full = tok.decode(list(cont.token_ids))
        if rng.random() < 0.3 and len(full) > 2:
            start = rng.randrange(len(full) - 1)
            params["stop"] = [full[start: start + rng.randint(1, 6)]]
        sp = SamplingParams(**params)
        as_ids = {"prompt_token_ids": list(cont.prompt)}
        requests.append(Request(prompt if isinstance(prompt, str) and rng.random() < 0.7 else as_ids,
                                list(cont.prompt), sp, expected_output(tok, cont, sp, eos_ids)))
    return requests


def draw_engine_options(rng: random.Random, requests: list[Request], block_sizes=(2, 4, 8, 16)) -> dict:
    block_size = rng.choice(block_sizes)
    chunked = rng.random() < 0.8
    small = rng.random() < 0.6
    if chunked:
        budget = rng.randint(1, 8) if small else int(2 ** rng.uniform(3, 12))
    else:
        budget = rng.randint(MAX_MODEL_LEN, 4096)
    need = max(cdiv(len(r.prompt_ids) + r.params.max_tokens, block_size) for r in requests)
    return dict(
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=rng.choice([1, 2, 3, 4, 8, 16, 64]),
        max_model_len=MAX_MODEL_LEN,
        num_blocks=need + rng.randint(0, 2 * need),
        enable_prefix_caching=rng.random() < 0.7,
        enable_chunked_prefill=chunked,
        async_scheduling=rng.random() < 0.7,
    )


# ---- four ways to drive an engine ---------------------------------------------------------------


def by_generate(llm, requests, rng):
    outs = llm.generate([r.prompt for r in requests], [r.params for r in requests], use_tqdm=False)
    return {i: (o.token_ids, o.text, o.finish_reason) for i, o in enumerate(outs)}


def by_two_threads(llm, requests, rng):
    cut = rng.randint(0, len(requests))
    halves = [list(range(cut)), list(range(cut, len(requests)))]
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def work(indices):
        try:
            if indices:
                outs = llm.generate([requests[i].prompt for i in indices], [requests[i].params for i in indices], use_tqdm=False)
                results.update({i: (o.token_ids, o.text, o.finish_reason) for i, o in zip(indices, outs)})
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(h,)) for h in halves]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results


def by_streams(llm, requests, rng):
    """Each request a stream; streams advanced in a random order, some closed early (aborted)."""
    streams = {i: llm.stream(r.prompt, r.params) for i, r in enumerate(requests)}
    texts = {i: "" for i in streams}
    results = {}
    while streams:
        i = rng.choice(list(streams))
        if rng.random() < 0.03:
            streams.pop(i).close()  # aborted: nothing to compare
            continue
        try:
            texts[i] += next(streams[i])
        except StopIteration:
            out = streams.pop(i).output
            # a stream of n > 1 completions interleaves their pieces: the first one's text then
            results[i] = (out.token_ids, texts[i] if requests[i].params.n == 1 else out.text, out.finish_reason)
    return results


def by_engine_steps(llm, requests, rng):
    """add_request / abort_request / step on the engine itself, with requests arriving in waves
    and a few aborted at random points."""
    engine = llm.engine
    pending = list(enumerate(requests))
    live, results = [], {}
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if pending:
                i, r = pending.pop(0)
                engine.add_request(r.prompt, r.params, request_id=f"r{i}")
                live.append(i)
        if live and rng.random() < 0.05:
            engine.abort_request(f"r{live.pop(rng.randrange(len(live)))}")
        for out in engine.step():
            if out.finished:
                i = int(out.request_id[1:])
                results[i] = (out.token_ids, out.text, out.finish_reason)
                live.remove(i)
    return results


DRIVERS = {"generate": by_generate, "two_threads": by_two_threads, "streams": by_streams,
           "engine_steps": by_engine_steps}


def draw_speculative_config(rng: random.Random) -> dict:
    hi = rng.randint(1, 3)
    return {"method": "ngram", "num_speculative_tokens": rng.randint(1, 5), "prompt_lookup_max": hi,
            "prompt_lookup_min": rng.randint(1, hi)}


def run_draw(seed: int, lively, block_sizes=(2, 4, 8, 16), speculate: bool = False, stats: list | None = None,
             structured: bool = False, structured_stats: list | None = None, **forced) -> tuple[int, list[str]]:
    """One random configuration and workload (``forced`` engine options override the drawn
    ones): how many requests were compared, and the differences found. ``speculate`` adds an
    n-gram speculative config (drawn apart, so the other draws of a seed stay what they were);
    ``stats`` collects the speculator's stats. ``structured`` turns some requests into
    structured ones (drawn apart too), whose finished outputs must match their grammar;
    ``structured_stats`` collects how many of their tokens were drawn again."""
    loaded, tok, pool = lively
    rng = random.Random(seed)
    eos_ids = set(loaded.eos_token_ids)
    requests = draw_requests(rng, pool, tok, eos_ids)
    if structured:
        srng = random.Random(f"structured {seed}")
        requests = [structured_variant(srng, r) if srng.random() < 0.5 else r for r in requests]
    options = dict(draw_engine_options(rng, requests, block_sizes), **forced)
    cap = options["max_num_seqs"]
    requests = [dataclasses.replace(r, params=dataclasses.replace(r.params, n=min(r.params.n, cap))) for r in requests]
    if speculate:
        options["speculative_config"] = draw_speculative_config(random.Random(f"speculative {seed}"))
    driver = rng.choice(sorted(DRIVERS))
    llm = LLM.from_loaded(loaded, **options)
    results = DRIVERS[driver](llm, requests, rng)
    where = f"seed {seed}, {driver}, {options}"
    problems = []
    for i, got in results.items():
        e = requests[i].expected
        if e is None:
            if got[2] == "stop" and not requests[i].valid(got[1]):
                problems.append(f"{where}: structured request {i} ({requests[i].params}) gave {got[1]!r}")
            continue
        if got != (e.token_ids, e.text, e.finish_reason):
            problems.append(f"{where}: request {i} ({requests[i].params}) gave {got}, expected {e}")
    if driver in ("generate", "two_threads") and len(results) != len(requests):
        problems.append(f"{where}: {len(requests) - len(results)} requests gave no output")
    bm = llm.engine.block_manager
    if llm.engine.scheduler.has_unfinished() or bm.num_free_blocks != bm.num_blocks:
        problems.append(f"{where}: {bm.num_blocks - bm.num_free_blocks} blocks still held after the run")
    bm.check_invariants()
    if llm.engine.live_grammar_matchers:
        problems.append(f"{where}: {llm.engine.live_grammar_matchers} grammar matchers not released")
    if structured_stats is not None:
        structured_stats.append((llm.engine.stats.grammar_candidates, llm.engine.stats.grammar_redraws))
    if stats is not None and llm.engine.speculator is not None:
        stats.append(llm.engine.speculator.stats)
    return len(results), problems
