"""The LLM API against the reference loop: batched, chunked, prefix-cached and preempted
generation gives exactly what each request gives alone; sampling is reproducible; stop strings,
streaming and aborts; bad requests are refused at submit while others carry on."""

import dataclasses
import random

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.errors import CompiledLLMError, InvalidRequestError
from compiled_llm.serve.reference import generate_reference
from helpers.greedy_oracle import hf_greedy, lively_checkpoint


@pytest.fixture(scope="module")
def tiny():
    # small budget and pool: chunked prefill and preemption both happen. enforce_eager: the
    # source runs as the eager spec inside the runtime (no build), so tiny.model.params are the
    # reference loop's params (an engine's are post-pass: merged qkv, gate_up)
    return LLM("tiny-qwen2", device="cpu", max_num_seqs=16, max_num_batched_tokens=96, num_blocks=48,
               enforce_eager=True)


def mixed_requests(vocab, n=64, seed=0, prefix=()):
    rng = random.Random(seed)
    prompts = [list(prefix) + [rng.randrange(vocab) for _ in range(rng.randint(1, 100))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 16), temperature=0.0, ignore_eos=rng.random() < 0.5) for _ in range(n)]
    return prompts, params


def reference(llm, prompts, params, detokenize=None):
    m = llm.model
    return generate_reference(m.config, m.params, prompts, params, eos_token_ids=m.eos_token_ids, detokenize=detokenize)


def assert_same(outs, refs):
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.token_ids == r.token_ids, f"request {i}: {o.token_ids} != {r.token_ids}"
        assert o.finish_reason == r.finish_reason, f"request {i}"


def test_64_mixed_requests_match_reference_on_preset(tiny):
    prompts, params = mixed_requests(tiny.model.config.vocab_size)
    preempted_before = tiny.engine.scheduler.num_preemptions
    outs = tiny.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert_same(outs, reference(tiny, prompts, params))
    assert tiny.engine.scheduler.num_preemptions > preempted_before
    assert tiny.engine.block_manager.num_free_blocks == tiny.engine.num_blocks


@pytest.fixture(scope="module")
def transformers_qwen2(tmp_path_factory):
    """A varied-output qwen2 checkpoint, 64 mixed requests and transformers' greedy output for
    each of them alone (EOS let through; cut below where a request stops at it)."""
    path = tmp_path_factory.mktemp("qwen2")
    hf = lively_checkpoint("qwen2", path)
    prompts, params = mixed_requests(hf.config.vocab_size, seed=1)
    return path, prompts, params, [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(prompts, params)]


def test_64_mixed_requests_match_transformers(transformers_qwen2):
    """A built engine, batched, chunked and preempted, against transformers' own greedy generate
    of each request alone."""
    path, prompts, params, wants = transformers_qwen2
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_seqs=16, max_num_batched_tokens=128,
              num_blocks=48)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    eos = set(llm.model.eos_token_ids)
    for i, (o, sp, want) in enumerate(zip(outs, params, wants)):
        stop = next((k + 1 for k, t in enumerate(want) if t in eos), None) if not sp.ignore_eos else None
        assert o.token_ids == want[:stop], f"request {i}"
        assert o.finish_reason == ("stop" if stop else "length"), f"request {i}"
    assert len({tuple(o.token_ids) for o in outs if len(o.token_ids) > 3}) > 10  # outputs vary
    assert llm.engine.scheduler.num_preemptions > 0


def test_shared_system_prompt_hits_prefix_cache_without_changing_outputs(tiny):
    vocab = tiny.model.config.vocab_size
    system = [random.Random(5).randrange(vocab) for _ in range(40)]
    prompts, params = mixed_requests(vocab, n=24, seed=2, prefix=system)
    hits_before = tiny.engine.block_manager.stats.hit_tokens
    outs = tiny.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hits = tiny.engine.block_manager.stats.hit_tokens - hits_before
    assert hits >= 32 * 20  # 40 tokens = 2 full blocks of 16, reused by most requests
    assert sum(o.metrics.num_cached_tokens for o in outs) > 0
    assert_same(outs, reference(tiny, prompts, params))


def test_text_prompts_detokenize_like_the_reference(tiny):
    tok = tiny.tokenizer
    texts = ["Hello there", "The quick brown fox", "a"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = tiny.generate(texts, params, use_tqdm=False)
    refs = reference(tiny, [tok.encode(t) for t in texts], [params] * 3, detokenize=tok.decode)
    for o, r, t in zip(outs, refs, texts):
        assert o.prompt == t and o.text == r.text and o.token_ids == r.token_ids
        assert o.outputs[0].text == o.text


def test_stop_string_is_trimmed_and_streaming_adds_up(tiny):
    prompt = "Once upon a time"
    base = tiny.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert len(base.text) >= 6
    stop = base.text[3:5]
    cut = base.text.find(stop)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop])
    out = tiny.generate(prompt, params, use_tqdm=False)[0]
    assert out.text == base.text[:cut] and out.finish_reason == "stop"
    ref = reference(tiny, [tiny.tokenizer.encode(prompt)], [params], detokenize=tiny.tokenizer.decode)[0]
    assert (out.text, out.token_ids, out.finish_reason) == (ref.text, ref.token_ids, ref.finish_reason)
    # streaming: the deltas add up to the text, for plain and stop-string requests alike
    assert "".join(tiny.stream(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))) == base.text
    assert "".join(tiny.stream(prompt, params)) == out.text


def test_each_streamed_output_holds_the_text_of_its_step_however_late_it_is_read(tiny):
    """The engine's streamed outputs carry their whole text without joining it at every step:
    read after the request has finished, each is still the text as of its own step."""
    from compiled_llm.serve.engine_config import EngineConfig
    from compiled_llm.serve.llm_engine import LLMEngine

    engine = LLMEngine(tiny.model, EngineConfig(max_num_seqs=4, num_blocks=16))
    for stop in ([], ["zq"]):
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=stop)
        rid = engine.add_request("Once upon a time", params, stream=True)
        outs = []
        while engine.has_unfinished_requests():
            outs += [o.outputs[0] for o in engine.step() if o.request_id == rid]
        want = tiny.generate("Once upon a time", params, use_tqdm=False)[0].text
        assert len(outs) == 24 and outs[-1].text == want
        for k, out in enumerate(outs):
            assert want.startswith(out.text) and len(out.text) >= len("".join(o.delta_text for o in outs[:k + 1]))
        assert "".join(o.delta_text for o in outs) == want


def test_seeded_sampling_is_reproducible_and_matches_reference(tiny):
    vocab = tiny.model.config.vocab_size
    prompts = [[random.Random(i).randrange(vocab) for _ in range(10 + i)] for i in range(6)]
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.95, seed=100 + i, ignore_eos=True) for i in range(6)]
    first = tiny.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # a different batch around them (and in another order) changes nothing
    noise = [SamplingParams(max_tokens=5, temperature=1.0) for _ in range(3)]
    second = tiny.generate([{"prompt_token_ids": p} for p in prompts[::-1]] + [[1, 2]] * 3, params[::-1] + noise, use_tqdm=False)
    assert [o.token_ids for o in first] == [o.token_ids for o in second[:6][::-1]]
    assert len({tuple(o.token_ids) for o in first}) > 1
    assert [o.token_ids for o in first] == [r.token_ids for r in reference(tiny, prompts, params)]


def test_min_tokens_holds_back_stop_tokens_like_the_reference(tiny):
    # each request's stop token is one its free greedy run makes early: before min_tokens output
    # tokens it cannot be sampled (EOS, stop_token_ids), from then on it ends the request
    vocab = tiny.model.config.vocab_size
    prompts = [[random.Random(50 + i).randrange(vocab) for _ in range(5 + 3 * i)] for i in range(6)]
    free = tiny.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(max_tokens=16, temperature=0.0 if i % 2 else 0.8, seed=i, min_tokens=1 + i,
                             stop_token_ids=[out.token_ids[i % 3]], ignore_eos=i % 3 == 0)
              for i, out in enumerate(free)]
    ahead = tiny.stats.ahead_steps
    outs = tiny.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert tiny.stats.ahead_steps > ahead  # steps queued ahead count the token not read yet
    assert_same(outs, reference(tiny, prompts, params))
    for out, sp in zip(outs, params):
        held = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(tiny.model.eos_token_ids))
        assert not held & set(out.token_ids[:sp.min_tokens])
        assert len(out.token_ids) > sp.min_tokens
    assert any(o.finish_reason == "stop" for o in outs)  # the stop token still ends requests after
    without = tiny.generate([{"prompt_token_ids": p} for p in prompts],
                            [dataclasses.replace(sp, min_tokens=0) for sp in params], use_tqdm=False)
    assert [o.token_ids for o in without] != [o.token_ids for o in outs]


def test_min_tokens_counts_the_token_a_step_queued_ahead_has_not_read(tiny):
    # every token but three is a stop token and the temperature flattens the distribution: the
    # first min_tokens tokens are among the three, and (for these seeds) the very next one stops
    # the request, in steps queued ahead as in the others
    vocab = tiny.model.config.vocab_size
    keep = {5, 100, 200}
    stops = [t for t in range(vocab) if t not in keep]
    prompts = [[random.Random(70 + i).randrange(vocab) for _ in range(6 + i)] for i in range(4)]
    params = [SamplingParams(max_tokens=16, temperature=5.0, seed=i, min_tokens=m, stop_token_ids=stops)
              for i, m in enumerate((2, 3, 5, 7))]
    ahead = tiny.stats.ahead_steps
    outs = tiny.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert tiny.stats.ahead_steps > ahead
    for out, sp in zip(outs, params):
        assert set(out.token_ids[:sp.min_tokens]) <= keep
        assert len(out.token_ids) == sp.min_tokens + 1 and out.finish_reason == "stop"
    assert_same(outs, reference(tiny, prompts, params))


def test_a_max_model_len_past_the_engines_limit_is_refused(tiny):
    from compiled_llm.errors import InvalidOptionError

    limit = tiny.model.config.max_position_embeddings
    with pytest.raises(InvalidOptionError, match=f"max_model_len {limit + 1} is more than this engine's limit of {limit}"):
        LLM.from_loaded(tiny.model, max_model_len=limit + 1)
    assert LLM.from_loaded(tiny.model, max_model_len=limit // 2).engine.max_model_len == limit // 2


def test_closing_a_stream_aborts_and_frees_blocks(tiny):
    it = tiny.stream({"prompt_token_ids": [5] * 50}, SamplingParams(max_tokens=40, ignore_eos=True, temperature=0))
    next(it)
    it.close()
    assert not tiny.engine.has_unfinished_requests()
    assert tiny.engine.block_manager.num_free_blocks == tiny.engine.num_blocks


@pytest.mark.parametrize(
    "prompt, make_params, fragment",
    [
        ({"prompt_token_ids": []}, lambda: SamplingParams(), "empty"),
        ("", lambda: SamplingParams(), "empty"),
        ({"prompt_token_ids": [1] * 1020}, lambda: SamplingParams(max_tokens=10), "max length"),
        ({"prompt_token_ids": [1, 99999]}, lambda: SamplingParams(), "vocabulary"),
        ({"prompt_token_ids": [1]}, lambda: SamplingParams(max_tokens=0), "max_tokens"),
        ({"prompt_token_ids": [1]}, lambda: SamplingParams(temperature=-1.0), "temperature"),
        ({"prompt_token_ids": [1]}, lambda: SamplingParams(top_p=0.0), "top_p"),
        ({"prompt_token_ids": [1]}, lambda: SamplingParams(top_p=1.01), "top_p"),
        ({"prompt_token_ids": [1]}, lambda: SamplingParams(seed=2**80), "seed must fit in 64 bits"),
        ({"prompt_token_ids": [1]}, lambda: SamplingParams(temperature="0.5"), "temperature must be a finite number"),
        ({"prompt_token_ids": [1]}, lambda: SamplingParams(stop_token_ids=["a"]), "stop_token_ids entry must be an integer"),
        ({"prompt_token_ids": [1]}, lambda: SamplingParams(max_tokens=2.0), "max_tokens must be an integer"),
        ({"prompt_token_ids": [1]}, lambda: SamplingParams(stop=7), "stop must be a string"),
        ({"prompt_token_ids": [1]}, lambda: SamplingParams(ignore_eos="yes"), "ignore_eos must be True or False"),
        (None, lambda: SamplingParams(), "a prompt is a string"),
        (b"Hello", lambda: SamplingParams(), "bytes"),
        ("caf\udce9", lambda: SamplingParams(), "not valid UTF-8"),
        ({"prompt_token_ids": [1, "2"]}, lambda: SamplingParams(), "list of integers"),
        ({"prompt_token_ids": [1, True]}, lambda: SamplingParams(), "list of integers"),
        # min_tokens masks stop ids on the logits: one past the vocabulary would index out of them
        ({"prompt_token_ids": [1]}, lambda: SamplingParams(min_tokens=2, stop_token_ids=[10**7]),
         "stop token id 10000000 is outside the model's vocabulary"),
        ({"prompt_token_ids": [1]}, lambda: SamplingParams(stop_token_ids=[5, 272]), "stop token id 272 is outside"),
    ],
)
def test_bad_request_is_refused_at_submit_while_others_carry_on(tiny, prompt, make_params, fragment):
    engine = tiny.engine
    good = engine.add_request({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    engine.step()
    with pytest.raises(InvalidRequestError, match=fragment):
        engine.add_request(prompt, make_params())
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == [good] and len(finished[0].token_ids) == 4


def test_bad_values_are_value_errors_with_one_line(tiny):
    with pytest.raises(ValueError) as e:
        tiny.generate({"prompt_token_ids": [1]}, SamplingParams(temperature="hot"), use_tqdm=False)
    assert isinstance(e.value, InvalidRequestError) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="prompts must be a prompt or a list"):
        tiny.generate(None, use_tqdm=False)


def test_a_huge_text_prompt_is_refused_before_tokenizing(tiny):
    import time

    text = "a" * 100_000_000
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequestError, match="cannot fit the model's max length of 1024 tokens"):
        tiny.generate(text, use_tqdm=False)
    assert time.perf_counter() - t0 < 5  # tokenizing it would take minutes and tens of GB


def test_a_text_just_within_the_byte_bound_is_tokenized_and_checked(tiny):
    with pytest.raises(InvalidRequestError, match="prompt of 2000 tokens"):
        tiny.generate("ab" * 1000, use_tqdm=False)


def test_options_that_cannot_make_progress_are_refused_at_construction(tiny):
    from compiled_llm.errors import InvalidOptionError

    with pytest.raises(InvalidOptionError, match=r"without chunked prefill, max_num_batched_tokens \(64\) must be at least max_model_len \(1024\)"):
        LLM.from_loaded(tiny.model, enable_chunked_prefill=False, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1"):
        LLM.from_loaded(tiny.model, max_num_seqs=0)


def test_generate_validates_every_request_before_running_any(tiny):
    with pytest.raises(InvalidRequestError, match="empty"):
        tiny.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": []}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not tiny.engine.has_unfinished_requests()


def test_unknown_engine_directory_is_refused(tmp_path):
    with pytest.raises(CompiledLLMError, match="nowhere"):
        LLM(str(tmp_path / "nowhere"), device="cpu")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CompiledLLMError, match="config.json"):
        LLM(str(empty), device="cpu")


def test_single_prompt_and_output_conveniences(tiny):
    (out,) = tiny.generate({"prompt_token_ids": [7, 8, 9]}, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out.token_ids == out.outputs[0].token_ids and len(out.token_ids) == 3
    assert out.finish_reason == "length" and out.finished
    assert out.metrics.time_to_first_token is not None and out.metrics.time_to_first_token >= 0


def test_decode_padded_to_buckets_matches_unpadded(tiny):
    """The CUDA-graph input layout (rows padded to the bucket with slot -1 / seq_len 0, block
    tables at full width), exercised eagerly on the CPU."""
    from compiled_llm.serve.worker.cuda_graphs import decode_buckets

    prompts, params = mixed_requests(tiny.model.config.vocab_size, n=20, seed=7)
    requests = [{"prompt_token_ids": p} for p in prompts]
    plain = tiny.generate(requests, params, use_tqdm=False)
    runner = tiny.engine.runner
    runner.decode_buckets = runner.graphs.buckets = decode_buckets(16)
    try:
        padded = tiny.generate(requests, params, use_tqdm=False)
    finally:
        runner.decode_buckets = runner.graphs.buckets = []
    assert [o.token_ids for o in padded] == [o.token_ids for o in plain]
    assert_same(padded, reference(tiny, prompts, params))


def test_decode_buckets_cover_every_batch_size():
    from compiled_llm.serve.worker.cuda_graphs import decode_buckets

    b = decode_buckets(256)
    assert b[:4] == [1, 2, 4, 8] and b[-1] == 256
    assert all(x in b for x in range(16, 65, 8))
    assert b == sorted(set(b))
    assert decode_buckets(20)[-1] == 20 and max(decode_buckets(20)) == 20


# ---- the CLI on a built engine -------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    from compiled_llm.engine.build import build_engine

    out = tmp_path_factory.mktemp("engine") / "tiny"
    build_engine("tiny-qwen2", out, dtype="float32", device="cpu", progress=False)
    return str(out)


def cli(argv, capsys):
    import json

    from compiled_llm.cli.main import main

    code = main(argv)
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines() if line.startswith("{")]
    return code, captured, lines


def test_run_engine_json_matches_reference(engine_dir, tiny, capsys):
    code, _, lines = cli(["run", engine_dir, "--prompt", "Hi there", "--prompt-ids", "5,6,7,8", "--max-tokens", "10",
                          "--ignore-eos", "--device", "cpu", "--json", "--max-num-seqs", "4"], capsys)
    assert code == 0 and len(lines) == 2
    tok = tiny.tokenizer
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    refs = reference(tiny, [tok.encode("Hi there"), [5, 6, 7, 8]], [params] * 2, detokenize=tok.decode)
    for line, r in zip(lines, refs):
        assert line == {"prompt_token_ids": r.prompt_token_ids, "token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason}


def test_run_engine_stream_profile_and_perf_summary(engine_dir, tmp_path, capsys):
    import json

    prof = tmp_path / "prof"
    code, captured, _ = cli(["run", engine_dir, "--prompt", "Hello", "--max-tokens", "6", "--ignore-eos",
                             "--device", "cpu", "--stream", "--profile", str(prof)], capsys)
    assert code == 0
    for field in ("load", "graphs", "ttft", "prefill", "decode", "tokens generated"):
        assert field in captured.out
    trace = json.loads((prof / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"schedule", "forward", "sample"} <= names


def test_run_engine_interactive_chat(engine_dir, monkeypatch, capsys):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nsecond message\n\n"))
    code, captured, _ = cli(["run", engine_dir, "--interactive", "--max-tokens", "4", "--device", "cpu"], capsys)
    assert code == 0 and captured.out.count("> ") == 3  # two replies, then the empty line quits


def test_run_engine_bad_option_values_exit_2(engine_dir, capsys):
    code, captured, _ = cli(["run", engine_dir, "--prompt-ids", "1,2", "--top-p", "0", "--device", "cpu"], capsys)
    assert code == 2 and captured.err.startswith("error:") and "top_p" in captured.err
    code, captured, _ = cli(["run", engine_dir, "--prompt-ids", "1,2", "--max-tokens", "5000", "--device", "cpu"], capsys)
    assert code == 2 and "max length" in captured.err and len(captured.err.strip().splitlines()) == 1


def test_run_refuses_a_max_model_len_past_the_engines_limit_in_one_line(engine_dir, capsys):
    code, captured, _ = cli(["run", engine_dir, "--prompt-ids", "1,2", "--max-model-len", "99999", "--device", "cpu"],
                            capsys)
    assert code == 2 and len(captured.err.strip().splitlines()) == 1
    assert "max_model_len 99999 is more than this engine's limit of 1024 tokens" in captured.err


def test_bench_latency_on_cpu(engine_dir, capsys):
    code, captured, _ = cli(["bench", engine_dir, "--workload", "latency", "--no-hf", "--device", "cpu"], capsys)
    assert code == 0
    row = next(line for line in captured.out.splitlines() if line.startswith("latency") and "decode_tok_s" in line)
    assert float(row.split()[2].replace(",", "")) > 0


def test_throughput_workload_definition_and_small_run(tiny):
    from compiled_llm.cli.bench import workloads as wl

    prompts, max_tokens = wl.throughput_requests()
    assert len(prompts) == len(max_tokens) == 256
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(100 <= n <= 1024 for n in max_tokens)
    assert all(0 <= t <= 10000 for p in prompts for t in p)
    assert wl.throughput_requests() == (prompts, max_tokens)  # seeded: the same every time
    result = wl.compiled_throughput(tiny, num_requests=3, max_input_len=110, max_output_len=104)
    assert result.metrics["output_tok_s"] > 0
    table = wl.format_table([result])
    assert "throughput" in table and "output_tok_s" in table


def test_hf_peer_runs_in_a_child_process_and_reports_back():
    """`bench` measures HF in a fresh interpreter; its result comes back intact (prefill of a
    tiny preset's config on the CPU, the quickest HF workload)."""
    from compiled_llm.cli.bench import hf_child
    from compiled_llm.model.presets import preset_hf_config

    result = hf_child.run_hf_child(preset_hf_config("tiny-qwen2"), torch.float32, "cpu", "prefill")
    assert result.workload == "prefill" and result.system.startswith("hf"), result.note
    assert result.metrics["ttft_ms"] > 0


def test_capturing_every_graph_runs_in_inference_mode_like_the_steps(tiny, monkeypatch):
    """Build warm-ups and benchmarks capture every CUDA graph outside generate(): the step
    buffers the captures write were made in inference mode, which refuses in-place writes from
    outside it, so the capture must run in it too (on a CPU, with the captures stubbed)."""
    from compiled_llm.serve.worker.cuda_graphs import StepGraphs

    tiny.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # buffers made
    inside = []
    monkeypatch.setattr(tiny.engine.runner, "decode_buckets", [1, 2, 4])
    monkeypatch.setattr(tiny.engine.runner.graphs, "buckets", [1, 2, 4])
    monkeypatch.setattr(StepGraphs, "enabled", property(lambda self: True))
    monkeypatch.setattr(StepGraphs, "capture", lambda self, bucket: inside.append(torch.is_inference_mode_enabled()) or True)
    assert tiny.engine.capture_cuda_graphs()
    assert inside and all(inside)
