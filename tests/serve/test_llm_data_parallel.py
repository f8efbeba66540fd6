"""``LLM(ENGINE, data_parallel_size=2)`` on a CPU: two engine processes behind the offline API,
checked against transformers' greedy outputs (the lively checkpoint) for generate, chat and
stream, every output in its prompt's place; what is one engine's refused in one line; and
``run`` and the bench's workloads over the replicas.

One LLM for the module, two sequences per replica at a time (so that a replica holds some
requests waiting). The last test shuts it down and checks that no engine process is left.
"""

from __future__ import annotations

import multiprocessing

import pytest

from compiled_llm.errors import CompiledLLMError, InvalidOptionError
from compiled_llm.serve.llm import LLM
from compiled_llm.serve.sampling_params import SamplingParams

from helpers.server_fixtures import process_exists
from helpers.trained_tokenizers import chat_ids_from_transformers

GREEDY = dict(temperature=0.0, ignore_eos=True)  # every request runs to max_tokens
PROMPTS = ["The quick brown fox", "A compiler lowers", "Once upon a time", "Paged attention keeps", "hello world",
           "continuous batching of requests", "in the beginning", "tokens per second"]


@pytest.fixture(scope="module")
def replicas(lively_bpe_engine):
    before = set(multiprocessing.active_children())
    llm = LLM(str(lively_bpe_engine), data_parallel_size=2, max_num_seqs=2, num_blocks=64)
    pids = [p.pid for p in set(multiprocessing.active_children()) - before]
    yield llm, pids
    llm.shutdown()


def expected(lively_oracle, lively_hf_tokenizer, prompt: str, n: int) -> tuple[list[int], str]:
    return lively_oracle(lively_hf_tokenizer(prompt)["input_ids"], n)


def test_generate_returns_transformers_greedy_outputs_in_prompt_order_and_both_replicas_serve(
        replicas, lively_oracle, lively_hf_tokenizer):
    llm, pids = replicas
    assert len(pids) == 2 and llm.data_parallel_size == 2
    before = [s.generated_tokens for s in llm.replica_stats()]
    params = [SamplingParams(max_tokens=6 + i % 5, **GREEDY) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    for out, prompt, p in zip(outs, PROMPTS, params):
        ids, text = expected(lively_oracle, lively_hf_tokenizer, prompt, p.max_tokens)
        assert (out.outputs[0].token_ids, out.outputs[0].text, out.finished) == (ids, text, True)
    generated = [s.generated_tokens - b for s, b in zip(llm.replica_stats(), before)]
    assert sum(generated) == sum(p.max_tokens for p in params) and min(generated) > 0


def test_n_greedy_completions_of_a_request_come_back_together(replicas, lively_oracle, lively_hf_tokenizer):
    llm, _ = replicas
    outs = llm.generate(PROMPTS[:3], SamplingParams(n=2, max_tokens=5, **GREEDY), use_tqdm=False)
    for out, prompt in zip(outs, PROMPTS):
        ids, _ = expected(lively_oracle, lively_hf_tokenizer, prompt, 5)
        assert [c.index for c in out.outputs] == [0, 1] and [c.token_ids for c in out.outputs] == [ids, ids]


def test_chat_and_stream_work_over_replicas(replicas, lively_oracle, lively_hf_tokenizer):
    llm, _ = replicas
    conversations = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": p}] for p in PROMPTS[:3]]
    outs = llm.chat(conversations, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)
    for out, prompt in zip(outs, PROMPTS):
        ids = chat_ids_from_transformers(lively_hf_tokenizer, prompt, "Be brief.")
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == lively_oracle(ids, 6)[0]
    stream = llm.stream(PROMPTS[4], SamplingParams(max_tokens=8, **GREEDY))
    ids, text = expected(lively_oracle, lively_hf_tokenizer, PROMPTS[4], 8)
    assert "".join(stream) == text and stream.output.token_ids == ids and stream.output.finished


def test_what_is_one_engines_is_refused_in_one_line(replicas):
    llm, _ = replicas
    for name in ("engine", "stats", "engine_loop"):
        with pytest.raises(InvalidOptionError) as e:
            getattr(llm, name)
        assert str(e.value).startswith(f"{name} is one engine's, and this LLM runs 2 data-parallel replicas")
        assert "\n" not in str(e.value)
        assert not hasattr(llm, name) and getattr(llm, name, None) is None  # an AttributeError too
    assert llm.capture_cuda_graphs() is False  # no graphs on a CPU, in either replica
    with pytest.raises(AttributeError):
        llm.no_such_attribute


def test_run_and_the_bench_workloads_run_over_the_replicas(replicas, lively_bpe_engine, monkeypatch, capsys):
    from compiled_llm.cli import run as cli_run
    from compiled_llm.cli.bench import workloads as wl
    from compiled_llm.cli.main import main

    llm, _ = replicas

    class Borrowed:  # run shuts its LLM down at the end: this one stays up for the module
        def __getattr__(self, name):
            return getattr(llm, name)

        def shutdown(self):
            pass

    monkeypatch.setattr(cli_run, "build_llm", lambda args: Borrowed())
    assert main(["run", str(lively_bpe_engine), "--data-parallel-size", "2", "--prompt-ids", "5,6,7", "--max-tokens", "4",
                 "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert "--- output (4 tokens, finish: length) ---" in out
    assert f"{lively_bpe_engine} on cpu, float32, compiled runtime, 2 data-parallel replicas\n" in out
    assert "tokens generated" in out
    result = wl.compiled_throughput(llm, num_requests=4, max_input_len=110, max_output_len=104)
    assert result.metrics["output_tok_s"] > 0 and result.note.startswith("2 data-parallel replicas; 4 requests")


def test_bad_data_parallel_values_are_one_line_errors(lively_bpe_engine):
    with pytest.raises(InvalidOptionError, match=r"^data_parallel_size must be an integer >= 1, got 0$"):
        LLM(str(lively_bpe_engine), data_parallel_size=0)
    with pytest.raises(InvalidOptionError, match="--device cuda:1 names one GPU, but data_parallel_size 2"):
        LLM("tiny-qwen2", device="cuda:1", data_parallel_size=2)
    with pytest.raises(InvalidOptionError, match=r"from_loaded serves the model loaded in this process"):
        LLM.from_loaded(None, data_parallel_size=2)


def test_shutdown_stops_every_replica_and_later_calls_fail_in_one_line(replicas):
    llm, pids = replicas
    llm.shutdown()
    assert not any(process_exists(pid) for pid in pids)
    with pytest.raises(CompiledLLMError, match="^this LLM has been shut down$"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()  # again: nothing left to do
