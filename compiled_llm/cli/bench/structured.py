"""The structured workload: what grammar-constrained decoding costs, against the same engine
unconstrained in the same run.

- latency: the latency workload (batch 1, 128-token prompt, 256 new tokens greedy) plain and
  under a JSON schema, alternating for 5 rounds; the median decode tok/s of each.
- throughput: the throughput workload (256 requests, nano-vllm's lengths, temperature 0.6) plain,
  then with every request under one of 8 JSON schemas (compiled in the warm-up); output tok/s
  (tokens produced / wall time). A request whose grammar completes ends before its max_tokens,
  and a shorter output spreads its prefill over fewer tokens, so the ratio is taken against the
  workload unconstrained with each request's max_tokens set to the length it had under its
  schema (the ratio to the full-length workload is reported too).
- compile: each schema's xgrammar compile time, and a batch-1 request's time to first token
  plain, under a schema seen for the first time, and under a cached one.

The schemas' strings are unbounded, so a random-weight model keeps writing inside them and
requests run to max_tokens, as in the plain workloads. JSON is asked for compact
(``disable_any_whitespace``): with any whitespace allowed, a random-weight model's draws are
refused wherever whitespace may come (nearly all its tokens are neither whitespace nor the next
token of the grammar) and its masked redraws are whitespace, run after run, which a trained
model does not do; that case is measured too (``output_tok_s_8_schemas_any_whitespace``).
Masks and compile times depend on the vocabulary: give the engine a real-sized one
(``benchmarks/bench_tokenizer.py``)."""

from __future__ import annotations

import copy
import statistics
import time

from compiled_llm.cli.bench.workloads import Result, _sync, latency_prompt, throughput_requests

_STR = {"type": "string"}
SCHEMAS = [
    {"type": "object", "properties": {"name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                      "email": _STR}, "required": ["name", "age"]},
    {"type": "object", "properties": {"city": _STR, "unit": {"enum": ["celsius", "fahrenheit"]}},
     "required": ["city", "unit"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": _STR, "quantity": {"type": "integer", "minimum": 1}}, "required": ["sku", "quantity"]}},
        "note": _STR}, "required": ["items"]},
    {"type": "object", "properties": {"title": _STR, "start": _STR, "attendees": {"type": "array", "items": _STR}},
     "required": ["title", "attendees"]},
    {"type": "object", "properties": {"results": {"type": "array", "items": {"$ref": "#/$defs/hit"}}},
     "$defs": {"hit": {"type": "object", "properties": {"url": _STR, "snippet": _STR}, "required": ["url"]}},
     "required": ["results"]},
    {"type": "object", "properties": {"verdict": {"enum": ["approve", "request_changes", "comment"]},
                                      "comments": {"type": "array", "items": _STR}}, "required": ["verdict"]},
    {"type": "object", "properties": {"recipe": _STR, "servings": {"type": "number", "minimum": 1},
                                      "steps": {"type": "array", "items": _STR}}, "required": ["recipe", "steps"]},
    {"type": "object", "properties": {"answer": {"anyOf": [_STR, {"type": "integer"}]}, "confidence": {
        "type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer"]},
]
LATENCY_ROUNDS = 5
LATENCY_SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": _STR}}, "required": ["notes"]}


def _structured(schema, compact: bool = True):
    from compiled_llm.serve.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(json=schema, disable_any_whitespace=compact)


def _latency(llm, structured, new_tokens: int = 256, repeats: int = 3) -> float:
    from compiled_llm.serve.sampling_params import SamplingParams

    prompt = {"prompt_token_ids": latency_prompt(llm.model.config.vocab_size)}
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                            structured_outputs=structured)
    llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, structured_outputs=structured),
                 use_tqdm=False)
    rates = []
    for _ in range(repeats):
        (out,) = llm.generate(prompt, params, use_tqdm=False)
        m = out.metrics
        rates.append((len(out.outputs[0].token_ids) - 1) / (m.finished_time - m.first_token_time))
    return statistics.median(rates)


def _throughput(llm, structured_of, num_requests: int, max_len: int,
                lengths: list[int] | None = None) -> tuple[float, list[int]]:
    """(output tok/s, each request's output length) of the throughput workload, request i
    under structured_of(i); ``lengths``: each request's max_tokens instead of the workload's."""
    from compiled_llm.serve.sampling_params import SamplingParams

    prompts, max_tokens = throughput_requests(num_requests, max_len, max_len, vocab_size=llm.model.config.vocab_size)
    if lengths is not None:
        max_tokens = [max(1, n) for n in lengths]  # a request aborted before its first token made none
    params = [SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True, detokenize=False,
                             structured_outputs=structured_of(i)) for i, n in enumerate(max_tokens)]
    vocab = min(llm.model.config.vocab_size, 10_001)
    warm = [{"prompt_token_ids": [(t + 1) % vocab for t in p]} for p in prompts[:64]]
    llm.generate(warm, [SamplingParams(max_tokens=8, temperature=0.6, ignore_eos=True, detokenize=False,
                                       structured_outputs=structured_of(i)) for i in range(len(warm))], use_tqdm=False)
    llm.engine.capture_cuda_graphs()
    _sync()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    return sum(lengths) / wall, lengths


def _ttft(llm, structured, seed: int) -> float:
    from compiled_llm.serve.sampling_params import SamplingParams

    prompt = {"prompt_token_ids": latency_prompt(llm.model.config.vocab_size, seed=seed)}
    (out,) = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False,
                                                 structured_outputs=structured), use_tqdm=False)
    return out.metrics.first_token_time - out.metrics.arrival_time


def run_structured(llm, num_requests: int = 256, max_len: int = 1024, new_tokens: int = 256) -> list[Result]:
    """The workload (``max_len``: the throughput requests' longest prompt and output; 1024 as
    in the throughput workload)."""
    # alternating, so that both see the same state of the machine
    rates = [(_latency(llm, None, new_tokens, 1), _latency(llm, _structured(LATENCY_SCHEMA), new_tokens, 1))
             for _ in range(LATENCY_ROUNDS)]
    plain_latency = statistics.median(p for p, _ in rates)
    schema_latency = statistics.median(q for _, q in rates)
    plain_tput, plain_lengths = _throughput(llm, lambda i: None, num_requests, max_len)
    plain_tokens = sum(plain_lengths)
    schemas = [_structured(s) for s in SCHEMAS]
    st = llm.stats
    before = (st.grammar_candidates, st.grammar_redraws, st.dropped_ahead_tokens, st.ahead_steps, st.decode_steps)
    tput, lengths = _throughput(llm, lambda i: schemas[i % len(schemas)], num_requests, max_len)
    candidates, redraws, dropped, ahead, decode = (a - b for a, b in zip(
        (st.grammar_candidates, st.grammar_redraws, st.dropped_ahead_tokens, st.ahead_steps, st.decode_steps), before))
    # a request whose grammar completes ends early: the same engine unconstrained, each request
    # made to write as many tokens, is what the grammars' cost is measured against
    plain_same, _ = _throughput(llm, lambda i: None, num_requests, max_len, lengths)
    tokens = sum(lengths)
    spaced = [_structured(s, compact=False) for s in SCHEMAS]
    tput_spaced, _ = _throughput(llm, lambda i: spaced[i % len(spaced)], num_requests, max_len)
    # time to first token: plain, a schema never seen (its compile on the way), then cached
    plain_ttft = statistics.median(_ttft(llm, None, seed) for seed in range(10, 15))
    fresh = copy.deepcopy(SCHEMAS[2])
    fresh["properties"]["warehouse"] = _STR  # a new key: nothing cached
    fresh_params = _structured(fresh)
    new_ttft = _ttft(llm, fresh_params, 20)
    compiler = llm.engine.grammar_compiler()
    compile_s = dict(compiler.compile_s)
    new_compile = compile_s[fresh_params.key]
    cached_ttft = statistics.median(_ttft(llm, fresh_params, seed) for seed in range(21, 26))
    ms = {f"compile_ms_schema_{i}": 1e3 * compile_s[s.key] for i, s in enumerate(schemas)}
    return [
        Result("structured", "compiled_llm", {
            "decode_tok_s_json_schema": schema_latency, "decode_tok_s_plain": plain_latency,
            "latency_ratio": schema_latency / plain_latency,
            "output_tok_s_8_schemas": tput, "output_tok_s_plain_same_lengths": plain_same,
            "throughput_ratio": tput / plain_same,
            "output_tok_s_plain": plain_tput, "throughput_ratio_to_full_lengths": tput / plain_tput,
            "output_tok_s_8_schemas_any_whitespace": tput_spaced,
            "ttft_ms_plain": 1e3 * plain_ttft, "ttft_ms_new_schema": 1e3 * new_ttft,
            "new_schema_compile_ms": 1e3 * new_compile,
            "new_schema_ttft_over_compile_ms": 1e3 * (new_ttft - new_compile - plain_ttft),
            "ttft_ms_cached_schema": 1e3 * cached_ttft, **ms},
            note=f"{num_requests} requests; {tokens} tokens under schemas ({candidates} refused and replaced by a "
                 f"later token of their race, {redraws} drawn again under their grammar, {dropped} computed ahead and dropped; {ahead} of {decode} decode steps queued "
                 f"ahead), {plain_tokens} plain"),
    ]


def format_table(results: list[Result]) -> str:
    rows = [(k, f"{v:,.2f}") for r in results for k, v in r.metrics.items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v:>12}" for k, v in rows) + "\n" + "\n".join(r.note for r in results)
