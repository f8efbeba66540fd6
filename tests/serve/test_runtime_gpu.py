"""GPU runtime: decode CUDA graphs give the same greedy outputs as eager decode (tiny preset and
Qwen2.5-0.5B shapes in bf16), capture failures fall back to eager, seeded sampling repeats,
prompt_logprobs chunks beside graphed decodes equal the eager spec, min_tokens holds stops back.

Run on the GPU machine:  python -m pytest -q -s tests/serve/test_runtime_gpu.py
(-s shows the small speed table each test prints)."""

import gc
import random
import time

import pytest
import torch

from compiled_llm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def build(tmp_path_factory, source, dtype, max_model_len=None):
    from compiled_llm.engine.build import build_engine

    out = tmp_path_factory.mktemp(source.replace(".", "_")) / "engine"
    t0 = time.perf_counter()
    build_engine(source, out, dtype=dtype, device="cuda", max_model_len=max_model_len, progress=False)
    print(f"\nbuilt {source} {dtype} in {time.perf_counter() - t0:.1f} s")
    return str(out)


def requests(vocab, n, max_tokens, seed=0, max_prompt=200):
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(min(vocab, 10_000)) for _ in range(rng.randint(1, max_prompt))]} for _ in range(n)]
    return prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)


def generate(engine, graphs, prompts, params, **kw):
    llm = LLM(engine, device="cuda", enforce_eager=not graphs, gpu_memory_utilization=0.4, **kw)
    try:
        assert llm.stats.graphs_captured == 0, "graphs are captured on first use, not at load"
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        st = llm.stats
        if graphs:
            assert st.graphs_captured > 0 and not llm.engine.runner.graphs.failed, "CUDA graph capture failed (see the warning)"
        print(f"  graphs={graphs!s:5}  wall {wall:7.3f} s  decode {st.decode_tokens / max(st.decode_s, 1e-9):9,.0f} tok/s  "
              f"prefill {st.prefill_tokens / max(st.prefill_s, 1e-9):9,.0f} tok/s  capture {st.graph_capture_s:.2f} s "
              f"({st.graphs_captured} buckets)")
        return [o.token_ids for o in outs]
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tiny_engine_graphs_match_eager(tmp_path_factory, dtype):
    engine = build(tmp_path_factory, "tiny-qwen2", dtype)
    # 40 requests of mixed lengths: decode batches shrink through many buckets as they finish
    prompts, _ = requests(272, 40, 1)
    rng = random.Random(1)
    params = [SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.0, ignore_eos=True, detokenize=False) for _ in prompts]
    graphs = generate(engine, True, prompts, params)
    eager = generate(engine, False, prompts, params)
    assert graphs == eager


def test_tiny_fp32_engine_matches_reference(tmp_path_factory):
    from compiled_llm.serve.reference import generate_reference
    from compiled_llm.model.sources import load_source_params, resolve_source

    engine = build(tmp_path_factory, "tiny-qwen2", "float32")
    prompts, params = requests(272, 24, 24, seed=3)
    outs = generate(engine, True, prompts, params)
    src = resolve_source("tiny-qwen2")
    ref = generate_reference(src.config, load_source_params(src, torch.float32, "cuda"),
                             [p["prompt_token_ids"] for p in prompts], params)
    same = sum(o == r.token_ids for o, r in zip(outs, ref))
    assert same >= 23, f"only {same}/24 requests match the reference loop"


def test_qwen25_shapes_bf16_graphs_match_eager(tmp_path_factory):
    engine = build(tmp_path_factory, "qwen2.5-0.5b", "bfloat16", max_model_len=2048)
    prompts, params = requests(151936, 16, 64, seed=5)
    graphs = generate(engine, True, prompts, params)
    eager = generate(engine, False, prompts, params)
    assert graphs == eager


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_sequence_prefill_graphs_match_eager_prefill(tmp_path_factory, dtype):
    """Prompts prefilled alone replay a token-count bucket's graph (padded rows write nowhere):
    lengths at, below and above bucket edges, a chunked prompt and a prefix-cache hit give the
    same tokens as op-by-op prefill, with async scheduling on and off."""
    engine = build(tmp_path_factory, "tiny-qwen2", dtype)
    rng = random.Random(4)
    base = [rng.randrange(256) for _ in range(300)]
    lengths = [1, 15, 16, 17, 100, 255, 300]
    prompts = [{"prompt_token_ids": base[:n]} for n in lengths] + [{"prompt_token_ids": base[:100] + [7, 8, 9]}]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
    runs = []
    for kw in ({}, {"prefill_graph_max_tokens": 0, "async_scheduling": False}, {"max_num_batched_tokens": 128}):
        llm = LLM(engine, device="cuda", gpu_memory_utilization=0.3, **kw)
        if kw.get("prefill_graph_max_tokens", 1):
            assert llm.engine.runner.prefill_graphs.enabled
        runs.append([llm.generate(p, params, use_tqdm=False)[0].token_ids for p in prompts])
        del llm
        gc.collect()
    assert runs[0] == runs[1] == runs[2]


def test_seeded_sampling_repeats_with_graphs(tmp_path_factory):
    engine = build(tmp_path_factory, "tiny-qwen2", "bfloat16")
    prompts, _ = requests(272, 8, 1, seed=9)
    params = [SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, top_k=50, seed=i, ignore_eos=True, detokenize=False) for i in range(8)]
    first = generate(engine, True, prompts, params)
    second = generate(engine, True, prompts[::-1], params[::-1])
    assert first == second[::-1]
    assert len({tuple(t) for t in first}) > 1


def test_capture_failure_warns_and_runs_eagerly():
    """A model source runs the reference ops, whose paged attention syncs with the host (not
    capturable): the runner must warn and decode eagerly, with correct outputs."""
    from compiled_llm.serve.reference import generate_reference

    from compiled_llm.engine.loader import load_model

    # LLM("tiny-qwen2") would build an engine, and LLM(..., enforce_eager=True) captures no
    # graphs: the eager spec with CUDA graphs on is from_loaded over the loaded source
    loaded = load_model("tiny-qwen2", dtype="float32", device="cuda")
    prompts, params = requests(272, 6, 12, seed=11, max_prompt=40)
    with pytest.warns(RuntimeWarning, match="CUDA graph capture failed"):  # at start-up or first use
        llm = LLM.from_loaded(loaded, gpu_memory_utilization=0.3, max_num_seqs=8)
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats.graphs_captured == 0
    ref = generate_reference(llm.model.config, llm.model.params, [p["prompt_token_ids"] for p in prompts], params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def test_prompt_logprobs_and_min_tokens_on_a_cuda_engine_leave_graphed_requests_unchanged(tmp_path_factory):
    """A 300-token prompt_logprobs request, prefilled in 128-token chunks beside plain requests
    that decode through CUDA graphs: its values are the eager spec's log_softmax over the whole
    prompt, the plain requests' tokens are what they are without it, and min_tokens keeps stop
    tokens out of the first tokens."""
    from compiled_llm.engine.loader import load_model
    from compiled_llm.graph.batch import ScheduledSeq, pack_batch
    from compiled_llm.model.spec import forward
    from compiled_llm.serve.worker import kv_cache as kvc

    engine = build(tmp_path_factory, "tiny-qwen2", "float32")
    llm = LLM(engine, device="cuda", gpu_memory_utilization=0.4, max_num_batched_tokens=128)
    vocab = llm.model.config.vocab_size
    rng = random.Random(7)
    prompt = [rng.randrange(vocab) for _ in range(300)]
    others = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(4, 60))]} for _ in range(6)]
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, detokenize=False)
    alone = llm.generate(others, plain, use_tqdm=False)
    scored = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False, prompt_logprobs=2)
    mixed = llm.generate([{"prompt_token_ids": prompt}, *others], [scored, *[plain] * len(others)], use_tqdm=False)
    assert llm.stats.graphs_captured > 0 and not llm.engine.runner.graphs.failed
    assert [o.outputs[0].token_ids for o in mixed[1:]] == [o.outputs[0].token_ids for o in alone]

    source = load_model("tiny-qwen2", dtype="float32", device="cuda")
    blocks = -(-len(prompt) // 16)
    kv = kvc.allocate(source.config, blocks, 16, torch.float32, "cuda")
    batch = pack_batch([ScheduledSeq(prompt, 0, list(range(blocks)))], 16, device="cuda")
    with torch.inference_mode():
        want = forward(source.config, source.params, batch, kv,
                       logits_rows=torch.arange(len(prompt) - 1, device="cuda")).log_softmax(-1)
    got = mixed[0].prompt_logprobs
    assert got[0] is None and len(got) == len(prompt)
    worst = max(abs(got[p][prompt[p]].logprob - want[p - 1, prompt[p]].item()) for p in range(1, len(prompt)))
    assert worst < 2e-3, f"prompt logprobs differ from the eager spec by up to {worst}"

    first = alone[0].outputs[0].token_ids[:3]  # tokens greedy decoding picks early on
    held = llm.generate([others[0]], SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6, stop_token_ids=first,
                                                    detokenize=False), use_tqdm=False)[0].outputs[0].token_ids
    assert len(held) >= 6 and not set(held[:6]) & set(first), held
