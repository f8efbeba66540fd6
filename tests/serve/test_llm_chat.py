"""``LLM.chat`` as vLLM's: one conversation ({"role", "content"} dicts) or a list of them, each
rendered by the tokenizer's chat template and generated like a prompt, one output each. Greedy
output equals transformers' generate on the ids of the same tokenizer's
``apply_chat_template(messages, add_generation_prompt=True)``. A tokenizer without a template
takes what ``run --chat`` takes; bad messages are a one-line InvalidRequestError."""

import json
import shutil
from types import SimpleNamespace

import pytest
import transformers

from compiled_llm import LLM, SamplingParams
from compiled_llm.serve.sampling_params import StructuredOutputsParams
from compiled_llm.errors import InvalidRequestError
from helpers.hf_checkpoints import make_checkpoint
from helpers.lively import greedy_continuation
from helpers.trained_tokenizers import QWEN_TOOLS_TEMPLATE, train_hf_tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ONE = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "How do I build a mini inference loop?"},
]
MULTI_TURN = [
    {"role": "user", "content": "What is a token?"},
    {"role": "assistant", "content": "A piece of text."},
    {"role": "user", "content": "And a tokenizer?"},
]


@pytest.fixture(scope="module")
def llm(lively_bpe_engine):
    return LLM(str(lively_bpe_engine), device="cpu")


@pytest.fixture(scope="module")
def hf_tokenizer(lively_bpe_checkpoint):
    return transformers.AutoTokenizer.from_pretrained(str(lively_bpe_checkpoint[0]))


def hf_chat_ids(hf_tok, messages, add_generation_prompt=True) -> list[int]:
    out = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)  # a BatchEncoding in transformers 5


def test_one_conversation_matches_transformers(llm, lively_bpe_checkpoint, hf_tokenizer):
    hf_model = lively_bpe_checkpoint[1]
    assert llm.tokenizer.has_chat_template
    (out,) = llm.chat(ONE, GREEDY, use_tqdm=False)
    ids = hf_chat_ids(hf_tokenizer, ONE)
    assert out.prompt_token_ids == ids
    assert out.token_ids == list(greedy_continuation(hf_model, ids, GREEDY.max_tokens).token_ids)


def test_the_output_prompt_is_the_rendered_conversation(tiny_engine):
    # the preset's byte-level tokenizer spells every text exactly, as real checkpoints' do
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tiny_engine / "tokenizer"))
    (out,) = LLM(str(tiny_engine), device="cpu").chat(ONE, SamplingParams(max_tokens=1), use_tqdm=False)
    assert out.prompt == hf_tok.apply_chat_template(ONE, add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == hf_chat_ids(hf_tok, ONE)


def test_a_batch_of_conversations_gives_one_output_each_in_order(llm, lively_bpe_checkpoint, hf_tokenizer):
    hf_model = lively_bpe_checkpoint[1]
    outs = llm.chat([MULTI_TURN, ONE], GREEDY, use_tqdm=False)
    assert len(outs) == 2
    for out, messages in zip(outs, [MULTI_TURN, ONE]):
        ids = hf_chat_ids(hf_tokenizer, messages)
        assert out.prompt_token_ids == ids
        assert out.token_ids == list(greedy_continuation(hf_model, ids, GREEDY.max_tokens).token_ids)


def test_without_generation_prompt_the_conversation_is_rendered_as_it_stands(llm, hf_tokenizer):
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    (out,) = llm.chat(MULTI_TURN, one_token, use_tqdm=False, add_generation_prompt=False)
    assert out.prompt_token_ids == hf_chat_ids(hf_tokenizer, MULTI_TURN, add_generation_prompt=False)
    assert out.prompt_token_ids != hf_chat_ids(hf_tokenizer, MULTI_TURN)


def test_chat_without_sampling_params_uses_the_generation_defaults(lively_bpe_checkpoint, tmp_path, hf_tokenizer):
    path = shutil.copytree(lively_bpe_checkpoint[0], tmp_path / "checkpoint")
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 6}))
    llm = LLM(str(path), device="cpu", enforce_eager=True)
    (out,) = llm.chat(ONE, use_tqdm=False)
    # greedy, 6 tokens or up to the first EOS, as the file asks
    expected = list(greedy_continuation(lively_bpe_checkpoint[1], hf_chat_ids(hf_tokenizer, ONE), 6).token_ids)
    stop = next((i + 1 for i, t in enumerate(expected) if t in llm.model.eos_token_ids), len(expected))
    assert out.token_ids == expected[:stop]


@pytest.mark.parametrize("messages, problem", [
    ("hello", "messages must be a list"),
    ([], "conversation is empty"),
    ([[]], "conversation 0 is empty"),
    (["hello"], "message 0 must be a dict"),
    ([{"content": "hi"}], "message 0 needs a 'role' string"),
    ([{"role": "user"}], "message 0 (user) has no 'content'"),
    ([{"role": "user", "content": 3}], "message 0 (user) content must be a string, got int"),
    ([ONE, [{"role": "user", "content": None}]], "conversation 1: message 0 (user) content must be a string"),
])
def test_bad_messages_are_one_line_errors(llm, messages, problem):
    with pytest.raises(InvalidRequestError) as e:
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert problem in str(e.value) and "\n" not in str(e.value)
    assert not llm.engine.has_unfinished_requests()


# --- a tokenizer without a chat template -----------------------------------------------------


def eager_llm_with_template(path, chat_template):
    """An eager tiny Qwen2 at ``path`` whose trained tokenizer has ``chat_template`` (None: none)."""
    make_checkpoint("qwen2", path)
    _, tok = train_hf_tokenizer(vocab_size=200, chat_template=chat_template, all_bytes=False)
    tok.save_pretrained(path)
    return LLM(str(path), device="cpu", enforce_eager=True), tok


@pytest.fixture(scope="module")
def no_template_llm(tmp_path_factory):
    return eager_llm_with_template(tmp_path_factory.mktemp("no_template"), None)[0]


def test_without_a_template_one_turn_is_the_run_chat_transcript(no_template_llm):
    tok = no_template_llm.tokenizer
    assert not tok.has_chat_template
    (out,) = no_template_llm.chat(ONE, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert out.prompt_token_ids == tok.encode_chat(ONE[1]["content"], ONE[0]["content"])


def test_without_a_template_a_longer_conversation_is_refused(no_template_llm):
    with pytest.raises(InvalidRequestError, match="has no chat template"):
        no_template_llm.chat(MULTI_TURN, GREEDY, use_tqdm=False)


# --- tools --------------------------------------------------------------------------------------

# short: the tiny checkpoint takes 256 tokens, and the template spells the tools out in the prompt
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALLED = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
]


@pytest.fixture(scope="module")
def tools_llm(tmp_path_factory):
    """An eager model whose tokenizer's template renders tools as Qwen's does (hermes calls)."""
    return eager_llm_with_template(tmp_path_factory.mktemp("tools"), QWEN_TOOLS_TEMPLATE)


def test_chat_with_tools_renders_them_and_the_calls_as_transformers_does(tools_llm):
    llm, hf_tok = tools_llm
    outs = llm.chat([ASK, CALLED], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False, tools=[WEATHER_TOOL])
    # transformers' templates read a call's arguments as a dict
    called = [CALLED[0], {**CALLED[1], "content": "", "tool_calls": [{**CALLED[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}, CALLED[2]]
    for out, messages in zip(outs, [ASK, called]):
        expected = hf_tok.apply_chat_template(messages, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
        assert out.prompt_token_ids == hf_tok.encode(expected, add_special_tokens=False)
    assert outs[0].prompt_token_ids != hf_chat_ids(hf_tok, ASK)  # the tools are in the prompt
    assert all(c.tool_calls is None for out in outs for c in out.outputs)  # random weights call nothing


def fake_generate(texts: list[str], seen: list):
    """An LLM.generate that answers each prompt with the next text (and records its params)."""
    from compiled_llm.serve.outputs import CompletionOutput

    def generate(prompts, sampling_params=None, use_tqdm=True):
        seen.append(sampling_params)
        return [SimpleNamespace(outputs=[CompletionOutput(index=0, text=texts[i], token_ids=[], finish_reason="stop")])
                for i in range(len(prompts))]

    return generate


def test_chat_with_tools_gives_each_completions_calls_as_the_templates_parser_reads_them(tools_llm, monkeypatch):
    llm, _ = tools_llm
    texts = ['Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
             "No tool needed."]
    monkeypatch.setattr(llm, "generate", fake_generate(texts, []))
    called, plain = llm.chat([ASK, ASK], tools=[WEATHER_TOOL], use_tqdm=False)
    (call,) = called.outputs[0].tool_calls
    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert called.outputs[0].text == texts[0]  # the text stays the model's
    assert plain.outputs[0].tool_calls is None
    (out,) = llm.chat(ASK, tools=[WEATHER_TOOL], tool_choice="none", use_tqdm=False)
    assert out.outputs[0].tool_calls is None  # "none" parses nothing


def test_chat_with_a_named_function_decodes_under_its_schema_and_its_answer_is_the_arguments(tools_llm, monkeypatch):
    llm, _ = tools_llm
    seen = []
    monkeypatch.setattr(llm, "generate", fake_generate(['{"city": "Paris"}'], seen))
    named = {"type": "function", "function": {"name": "get_weather"}}
    (out,) = llm.chat(ASK, SamplingParams(max_tokens=20, temperature=0.5), tools=[WEATHER_TOOL], tool_choice=named,
                      use_tqdm=False)
    (params,) = seen[0]
    assert params.structured_outputs.json == WEATHER_TOOL["function"]["parameters"]
    assert params.max_tokens == 20 and params.temperature == 0.5  # the rest as given
    assert out.outputs[0].tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_chat_with_tool_choice_required_parses_the_array_of_calls(tools_llm, monkeypatch):
    llm, _ = tools_llm
    seen = []
    monkeypatch.setattr(llm, "generate", fake_generate(['[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'], seen))
    (out,) = llm.chat(ASK, tools=[WEATHER_TOOL], tool_choice="required", use_tqdm=False)
    assert seen[0][0].structured_outputs.json["type"] == "array"
    assert [c["function"] for c in out.outputs[0].tool_calls] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]


@pytest.mark.parametrize("kwargs, problem", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope', which is not in tools"),
    ({"tool_choice": "required", "sampling_params": SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"))},
     "give sampling params without structured_outputs"),
    ({"tools": None, "tool_choice": "required"}, "'required' needs tools"),
])
def test_bad_tool_choices_are_one_line_errors(tools_llm, kwargs, problem):
    llm, _ = tools_llm
    with pytest.raises(InvalidRequestError) as e:
        llm.chat(ASK, **{"tools": [WEATHER_TOOL], "use_tqdm": False, **kwargs})
    assert problem in str(e.value) and "\n" not in str(e.value)
    assert not llm.engine.has_unfinished_requests()
