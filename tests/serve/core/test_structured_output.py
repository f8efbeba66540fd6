"""Structured outputs in the engine: every token a request gets is one its grammar allows (a
JSON schema, a regex, a choice, an EBNF grammar), through batching, speculation, preemption and
aborts; greedy decoding under a grammar that admits the unconstrained output is that output;
logit_bias moves the sampler; what cannot be compiled is refused when submitted."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.errors import InvalidRequestError
from compiled_llm.serve.core.structured_output.grammar_check import json_safe_string_lengths
from compiled_llm.serve.sampling_params import StructuredOutputsParams as Structured

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}
PROMPT = [5, 17, 40, 41, 7]


@pytest.fixture(scope="module")
def llm(structured_engine):
    return LLM(str(structured_engine), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)


def test_sampled_outputs_under_a_json_schema_validate(llm):
    params = SamplingParams(temperature=1.0, max_tokens=200, n=3, seed=1, structured_outputs=Structured(json=PERSON))
    outs = llm.generate([PROMPT, PROMPT[:3]], params, use_tqdm=False)
    finished = [c for o in outs for c in o.outputs if c.finish_reason == "stop"]
    assert len(finished) >= 5
    for c in finished:
        jsonschema.validate(json.loads(c.text), PERSON)
    assert llm.engine.live_grammar_matchers == 0


def test_regex_choice_grammar_and_json_object_outputs_match(llm):
    cases = [
        (Structured(regex=r"[a-c]{2,4}-[0-9]{1,3}"), lambda t: re.fullmatch(r"[a-c]{2,4}-[0-9]{1,3}", t)),
        (Structured(choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
        (Structured(grammar='root ::= "(" [0-9]+ (" + " [0-9]+)* ")"'),
         lambda t: re.fullmatch(r"\([0-9]+( \+ [0-9]+)*\)", t)),
        (Structured(json_object=True, disable_any_whitespace=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    params = [SamplingParams(temperature=1.0, max_tokens=120, seed=i, structured_outputs=s)
              for i, (s, _) in enumerate(cases)]
    outs = llm.generate([PROMPT] * len(cases), params, use_tqdm=False)
    for (_, matches), out in zip(cases, outs):
        c = out.outputs[0]
        if c.finish_reason == "stop":
            assert matches(c.text), c.text
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 3


def ascii_prefix(tokenizer, token_ids: list[int]) -> list[int]:
    """The leading tokens that each decode to printable ASCII text."""
    n = 0
    while n < len(token_ids) and (t := tokenizer.decode([token_ids[n]])) and t.isascii() and t.isprintable():
        n += 1
    return token_ids[:n]


def test_greedy_output_is_unchanged_by_a_grammar_that_admits_it(llm):
    # a random model also writes special tokens and bytes that are no UTF-8, which no grammar
    # admits: the comparison runs over the longest plain-text start among a few prompts
    candidates = [[5, 17, 40 + i, 41, 7] for i in range(16)]
    outs = llm.generate(candidates, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    starts = [ascii_prefix(llm.tokenizer, o.outputs[0].token_ids) for o in outs]
    prompt, start = max(zip(candidates, starts), key=lambda ps: len(ps[1]))
    assert len(start) >= 3
    text = llm.tokenizer.decode(start)
    pattern = "".join(c if c.isalnum() else f"\\u{ord(c):04x}" for c in text)
    regex = Structured(regex=f"{pattern}[\\s\\S]*")
    for async_scheduling in (True, False):
        llm.engine.config = dataclasses.replace(llm.engine.config, async_scheduling=async_scheduling)
        got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=len(start), structured_outputs=regex),
                           use_tqdm=False)
        assert got[0].outputs[0].token_ids == start


def test_logprobs_under_a_grammar_are_those_of_the_masked_distribution(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, structured_outputs=Structured(choice=["ab", "ba"]))
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("ab", "ba")
    first = out.logprobs[0]
    assert out.token_ids[0] in first
    # the masked distribution puts all its mass on the few allowed tokens
    assert sum(2.718281828 ** lp.logprob for lp in first.values() if lp.logprob > -1e30) == pytest.approx(1.0, abs=1e-3)


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(llm):
    params = SamplingParams(temperature=1.0, max_tokens=5, seed=0, structured_outputs=Structured(regex="[a-z]{20}"))
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and re.fullmatch("[a-z]*", out.text)
    assert llm.engine.live_grammar_matchers == 0


def test_logit_bias_moves_greedy_decoding(llm):
    free = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    first = free[0].outputs[0].token_ids[0]
    banned = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1, logit_bias={first: -100}),
                          use_tqdm=False)
    assert banned[0].outputs[0].token_ids[0] != first
    forced = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3, logit_bias={"65": 100.0}),
                          use_tqdm=False)
    assert forced[0].outputs[0].token_ids == [65, 65, 65]


def test_structured_requests_survive_speculation_preemption_and_aborts(structured_engine):
    llm = LLM(str(structured_engine), block_size=4, max_num_seqs=6, max_num_batched_tokens=32, num_blocks=40,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 2})
    schema = {"type": "object", "properties": {"k": {"enum": ["aaaa", "aaab"]}, "n": {"type": "array", "items":
              {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 6}}, "required": ["k", "n"]}
    # single spaces only: a greedy random model could otherwise write whitespace to max_tokens
    structured = Structured(json=schema, disable_any_whitespace=True)
    params = [SamplingParams(temperature=t, max_tokens=80, seed=i, structured_outputs=structured)
              for i, t in enumerate([0.0, 1.0, 0.0, 1.0, 0.7, 0.0])]
    prompts = [PROMPT * 3, PROMPT, PROMPT[::-1] * 2, PROMPT, PROMPT * 2, PROMPT[:2]]
    # two streams read a few pieces, then closed (aborted), while the batch below runs
    streams = [llm.stream({"prompt_token_ids": p}, sp) for p, sp in zip(prompts[:2], params[:2])]
    for s in streams:
        next(s, None)
    outs = llm.generate(prompts * 2, params * 2, use_tqdm=False)
    for s in streams:
        s.close()
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 8
    for out in outs:
        c = out.outputs[0]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schema)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.speculator.stats.draft_tokens > 0
    llm.engine_loop.settle()
    assert llm.engine.live_grammar_matchers == 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("structured, problem", [
    (dict(json={"type": "strnig"}), "invalid JSON schema"),
    (dict(json={"type": "object", "properties": {"a": {"not": {"type": "string"}}}}), "#/properties/a/not"),
    (dict(regex="(ab"), "invalid regex"),
    (dict(grammar="root ::= missing"), "invalid grammar"),
])
def test_what_cannot_be_compiled_is_refused_when_submitted(llm, structured, problem):
    with pytest.raises(InvalidRequestError, match=re.escape(problem)):
        llm.generate([PROMPT], SamplingParams(structured_outputs=Structured(**structured)), use_tqdm=False)


def test_a_length_bounded_strings_grammar_takes_only_utf8():
    """For a negated class xgrammar's pattern rule takes an encoded surrogate and overlong
    encodings; a decoder makes each of their bytes a U+FFFD, and the string outgrows its
    maxLength. The pattern the compiler gives such strings lists the allowed code points."""
    import xgrammar as xgr

    vocab = [bytes([b]) for b in range(256)] + [b"</s>"]
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[256]))
    grammar = compiler.compile_json_schema(json.dumps(json_safe_string_lengths({"type": "string", "maxLength": 1})))

    def takes(text: bytes) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return all(matcher.accept_token(b) for b in b'"' + text + b'"') and matcher.accept_token(256)

    for one in ("a", "\x7f", "\u06be", "\u0800", "\ud7ff", "\ue000", "\U0001f600", "\U0010ffff"):
        assert takes(one.encode()), ascii(one)
    for bad in (b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xc0\x80", b"\xe0\x80\x80", b"\xe0\x9f\xbf", b"\xf0\x80\x80\x80",
                b"\xf0\x8f\xbf\xbf", b"\xf4\x90\x80\x80", b"\x1f", b"\\n", b"ab"):
        assert not takes(bad), bad


def test_logit_bias_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(InvalidRequestError, match="logit_bias token id 100000 is outside"):
        llm.generate([PROMPT], SamplingParams(logit_bias={100000: 1.0}), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"logit_bias\[3\] must be in \[-100, 100\]"):
        SamplingParams(logit_bias={3: 101})


def test_structured_outputs_need_exactly_one_constraint():
    with pytest.raises(InvalidRequestError, match="exactly one of json, regex, choice, grammar and json_object, got json, regex"):
        Structured(json={}, regex="a")
    with pytest.raises(InvalidRequestError, match="got none"):
        Structured()


def test_a_grammar_starting_after_a_token_leaves_the_output_before_it_free(llm):
    waking = 65  # forced first by its bias: before it the output is free, after it the grammar rules
    structured = Structured(choice=["yes", "no"], start_after_token_id=waking)
    for top_k in (-1, 20):  # checked after sampling, masked before it
        params = SamplingParams(temperature=0.0, max_tokens=12, logit_bias={waking: 100.0}, top_k=top_k,
                                structured_outputs=structured)
        out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids[0] == waking and out.finish_reason == "stop"
        assert llm.tokenizer.decode(out.token_ids[1:]) in ("yes", "no")


def test_a_draft_that_ends_the_grammar_keeps_its_stop_token_and_nothing_after(llm):
    grammar = llm.engine.grammar_compiler().matcher(Structured(choice=["ab"]))
    grammar.future.result()
    a, b = (llm.tokenizer.encode(c, add_special_tokens=False)[0] for c in "ab")
    eos = llm.engine.model.eos_token_ids[0]
    assert grammar.allowed_prefix([a, b, eos, a]) == [a, b, eos]
    bitmask = torch.zeros((4, (llm.model.config.vocab_size + 31) // 32), dtype=torch.int32)
    grammar.fill_after([a, b, eos], bitmask, 0)  # no mask is asked of the ended grammar
    allowed = lambda row, t: bool(bitmask[row, t // 32] >> (t % 32) & 1)  # noqa: E731
    assert allowed(0, a) and allowed(1, b) and allowed(2, eos) and not allowed(2, a)
    assert not bitmask[3].any() and grammar.accept(a)  # the matcher is back where it was
    grammar.release()


def test_property_order_is_part_of_a_schema_key():
    first = Structured(json={"type": "object", "properties": {"a": {}, "b": {}}})
    second = Structured(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert first.key != second.key and first.key == Structured(json=json.dumps(first.json)).key


@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_a_seeded_request_gives_one_output_masked_first_or_checked_after(llm, monkeypatch, temperature):
    """Checked after sampling, a refused token is replaced by the first token its race ranks
    next that the grammar allows (or drawn again masked): the token a masked draw takes."""
    from compiled_llm.serve.core.structured_output import grammar_matcher

    params = SamplingParams(temperature=temperature, max_tokens=40, seed=3, structured_outputs=Structured(json=PERSON))
    outputs = []
    for share in (2.0, 0.0):  # every mask narrow: masked first; every mask wide: checked after
        monkeypatch.setattr(grammar_matcher, "WIDE_MASK_SHARE", share)
        before = llm.engine.stats.grammar_candidates + llm.engine.stats.grammar_redraws
        outputs.append(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)
        refused = llm.engine.stats.grammar_candidates + llm.engine.stats.grammar_redraws - before
        assert (refused == 0) == (share == 2.0)  # only checked rows are refused
    assert outputs[0] == outputs[1]


def test_a_seeded_request_gives_one_output_whichever_way_its_step_samples(llm):
    seeded = SamplingParams(temperature=1.0, max_tokens=30, seed=7, structured_outputs=Structured(json=PERSON))
    alone = llm.generate([PROMPT], seeded, use_tqdm=False)[0].outputs[0].token_ids
    # a neighbour asking for logprobs is masked before sampling: no step is sampled ahead
    masked = SamplingParams(temperature=1.0, max_tokens=30, seed=1, logprobs=1, structured_outputs=Structured(json=PERSON))
    together = llm.generate([PROMPT, PROMPT[:4]], [seeded, masked], use_tqdm=False)
    assert together[0].outputs[0].token_ids == alone


def test_a_row_is_masked_first_where_few_tokens_are_allowed_and_checked_after_inside_a_string(llm):
    from compiled_llm.serve.core.structured_output.step_bitmask import StepBitmask

    note = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
    grammar = llm.engine.grammar_compiler().matcher(Structured(json=note, disable_any_whitespace=True))
    grammar.future.result()
    bitmask = StepBitmask(1, llm.model.config.vocab_size, pin=False)
    ids = lambda text: llm.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert grammar.masks_first  # nothing seen yet: "{" is the only token
    bitmask.fill([grammar])
    assert grammar.masks_first
    assert all(grammar.accept(t) for t in ids('{"note": "ab'))
    bitmask.fill([grammar])  # inside the string: nearly every token
    assert not grammar.masks_first
    assert grammar.accept(ids('"')[0])  # a quote may end the string: the next token is masked first
    assert grammar.masks_first
    bitmask.fill([grammar])  # only "}" now
    assert grammar.masks_first
    bitmask.close()
    grammar.release()
