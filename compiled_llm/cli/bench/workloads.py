"""The benchmark workloads, for compiled_llm and for Hugging Face transformers, measured the same
way in the same run.

- latency: batch 1, a 128-token random prompt, 256 new tokens greedy, EOS ignored; decode
  tok/s (prefill excluded) and time to first token.
- throughput: 256 requests, prompt lengths and max_tokens uniform in 100..1024 with
  random.seed(0), token ids in 0..10000, temperature 0.6, EOS ignored (nano-vllm's bench.py);
  output tok/s = sum(max_tokens) / wall time.
- prefill: one 1024-token prompt; time to first token.

HF peers: latency uses a static cache + torch.compile (mode reduce-overhead) on the same shapes
(and, for an engine built with ``--quantization``, the same after torchao's weight-only
quantization of that scheme: ``torchao_peer.py``);
throughput uses static batching (all requests left-padded to the longest, max(max_tokens) steps
for the batch), measured over a capped number of decode steps and extrapolated (each extra step
costs at least the measured average, so the extrapolation flatters HF). Every workload warms up
first and reports the median of its repeats.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

WORKLOADS = ("latency", "throughput", "prefill")


@dataclass
class Result:
    workload: str
    system: str
    metrics: dict[str, float]
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Workload definitions
# ---------------------------------------------------------------------------------------------


def latency_prompt(vocab_size: int, length: int = 128, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(min(vocab_size, 10_001)) for _ in range(length)]


def throughput_requests(num_requests: int = 256, max_input_len: int = 1024, max_output_len: int = 1024,
                        vocab_size: int | None = None):
    """(prompts, max_tokens) exactly as nano-vllm's bench.py draws them (ids folded into a
    vocabulary smaller than 10001, for tiny test models only)."""
    from random import randint, seed

    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, max_input_len))] for _ in range(num_requests)]
    max_tokens = [randint(100, max_output_len) for _ in range(num_requests)]
    if vocab_size is not None and vocab_size <= 10000:
        prompts = [[t % vocab_size for t in p] for p in prompts]
    return prompts, max_tokens


def _sync(llm=None):
    """Wait for this process's device work (none for an LLM over data-parallel replicas: this
    process must not make a CUDA context of its own on their first GPU)."""
    import torch

    if torch.cuda.is_available() and (llm is None or llm.data_parallel_size == 1):
        torch.cuda.synchronize()


def _replicas_note(llm) -> str:
    return f"{llm.data_parallel_size} data-parallel replicas; " if llm.data_parallel_size > 1 else ""


def _stats(llm):
    """The engine counters, of every replica added up."""
    from compiled_llm.serve.llm_engine import total_stats

    return total_stats(s for s in llm.replica_stats() if s is not None)


# ---------------------------------------------------------------------------------------------
# compiled_llm
# ---------------------------------------------------------------------------------------------


def compiled_latency(llm, new_tokens: int = 256, repeats: int = 3) -> Result:
    from compiled_llm.serve.sampling_params import SamplingParams

    prompt = {"prompt_token_ids": latency_prompt(llm.model.config.vocab_size)}
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    llm.capture_cuda_graphs()  # steady state: every graph captured (they are on first use)
    ttft, decode = [], []
    for _ in range(repeats):
        (out,) = llm.generate(prompt, params, use_tqdm=False)
        m = out.metrics
        ttft.append(m.first_token_time - m.arrival_time)
        decode.append((new_tokens - 1) / (m.finished_time - m.first_token_time))
    graphs = _stats(llm).graphs_captured // llm.data_parallel_size
    # one request: one replica serves it, as one engine would
    return Result("latency", "compiled_llm", {"decode_tok_s": statistics.median(decode), "ttft_ms": 1e3 * statistics.median(ttft)},
                  note=_replicas_note(llm) + (f"CUDA graphs: {graphs} buckets" if graphs else "eager decode"))


def compiled_throughput(llm, num_requests: int = 256, max_input_len: int = 1024, max_output_len: int = 1024,
                        shift: int = 0) -> Result:
    """``shift``: every prompt id moved by it (the same lengths): a second measurement on one
    engine passes an even shift of its own, so that neither it nor its warm-up (shifted by one
    more) finds an earlier run's prompts in the prefix cache."""
    from compiled_llm.serve.sampling_params import SamplingParams

    prompts, max_tokens = throughput_requests(num_requests, max_input_len, max_output_len, llm.model.config.vocab_size)
    vocab = min(llm.model.config.vocab_size, 10_001)
    if shift:
        prompts = [[(t + shift) % vocab for t in p] for p in prompts]
    params = [SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True, detokenize=False) for n in max_tokens]
    # Warm-up with the workload's own shapes: full-budget mixed prefill steps and decode batches
    # of every size, so no kernel variant is first compiled inside the timed run. The prompts
    # are shifted by one id: the measured run must not find them in the prefix cache.
    warm = [{"prompt_token_ids": [(t + 1) % vocab for t in p]} for p in prompts[:64]]
    llm.generate(warm, SamplingParams(max_tokens=8, temperature=0.6, ignore_eos=True, detokenize=False), use_tqdm=False)
    # graphs are captured when their batch size first runs; a steady-state run has them all
    llm.capture_cuda_graphs()
    st = _stats(llm)
    before = (st.preemptions, st.prefill_steps, st.prefill_s, st.decode_steps, st.decode_s)
    _sync(llm)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    assert [len(o.token_ids) for o in outs] == max_tokens, "every request must produce exactly max_tokens"
    st = _stats(llm)
    pre, ps, pt, ds, dt = (a - b for a, b in zip(
        (st.preemptions, st.prefill_steps, st.prefill_s, st.decode_steps, st.decode_s), before))
    # over replicas, steps and seconds are every replica's added up
    return Result(
        "throughput", "compiled_llm",
        {"output_tok_s": sum(max_tokens) / wall, "wall_s": wall},
        note=f"{_replicas_note(llm)}{num_requests} requests, {pre} preemptions; "
             f"{ps} prefill steps {pt:.2f} s, {ds} decode steps {dt:.2f} s",
    )


def compiled_prefill(llm, length: int = 1024, repeats: int = 5) -> Result:
    from compiled_llm.serve.sampling_params import SamplingParams

    prompt = {"prompt_token_ids": latency_prompt(llm.model.config.vocab_size, length, seed=1)}
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    # distinct prompts per repeat so the prefix cache cannot serve them
    vocab = min(llm.model.config.vocab_size, 10_001)
    prompts = [{"prompt_token_ids": [(t + i) % vocab for t in prompt["prompt_token_ids"]]} for i in range(repeats + 1)]
    llm.generate(prompts[0], params, use_tqdm=False)
    ttft = []
    for p in prompts[1:]:
        (out,) = llm.generate(p, params, use_tqdm=False)
        ttft.append(out.metrics.first_token_time - out.metrics.arrival_time)
    med = statistics.median(ttft)
    return Result("prefill", "compiled_llm", {"ttft_ms": 1e3 * med, "prefill_tok_s": length / med})


def run_compiled(llm, workloads=WORKLOADS) -> list[Result]:
    fns = {"latency": compiled_latency, "throughput": compiled_throughput, "prefill": compiled_prefill}
    return [fns[w](llm) for w in workloads]


# ---------------------------------------------------------------------------------------------
# Hugging Face transformers
# ---------------------------------------------------------------------------------------------


def hf_model(hf_config: dict, dtype, device):
    """A transformers model built from a config.json dict, random weights (speed does not depend
    on their values). Built on ``device``: initialising an 8B model's weights on the CPU takes
    minutes, on a GPU seconds."""
    import torch
    import transformers

    d = dict(hf_config)
    cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **{k: v for k, v in d.items() if k != "architectures"})
    torch.manual_seed(0)
    with torch.device(device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        except TypeError:  # older transformers name the argument torch_dtype
            model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


class _TokenClock:
    """A generate() streamer that timestamps the prompt and each new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


HF_COMPILE_VARIANTS = ("auto", "default")


class PrepareError(RuntimeError):
    """``hf_latency``'s ``prepare`` (a peer's change to the model, such as quantizing it) failed."""


def hf_latency(hf_config: dict, dtype, device, new_tokens: int = 256, repeats: int = 3, variant: str = "auto",
               prepare=None, system: str = "hf static+compile") -> Result:
    """variant "auto": transformers' own path (a static cache makes generate() compile the
    decoding forward, CUDA graphs included); "default": our torch.compile(mode="default") of
    the forward, the fallback when the first crashes (seen: a segfault in torch 2.11's CUDA-graph
    trees under transformers 5.17). ``prepare(model)``, when given, changes the model before
    anything is compiled and returns a note (raised as PrepareError when it fails)."""
    import torch

    model = hf_model(hf_config, dtype, device)
    prepared = ""
    if prepare is not None:
        try:
            prepared = prepare(model) or ""
        except Exception as e:
            raise PrepareError(str(e)) from e
    model.generation_config.cache_implementation = "static"
    if variant == "default":
        model.forward = torch.compile(model.forward, mode="default", fullgraph=True)
    ids = torch.tensor([latency_prompt(hf_config["vocab_size"])], device=device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, **kw)  # compiles
        first_call = time.perf_counter() - t0
        model.generate(ids, **kw)
        ttft, decode = [], []
        for _ in range(repeats):
            clock = _TokenClock()
            _sync()
            start = time.perf_counter()
            model.generate(ids, streamer=clock, **kw)
            _sync()
            end = time.perf_counter()
            first = clock.times[1]  # times[0] is the prompt
            ttft.append(first - start)
            decode.append((new_tokens - 1) / (end - first))
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return Result("latency", system, {"decode_tok_s": statistics.median(decode), "ttft_ms": 1e3 * statistics.median(ttft)},
                  note="; ".join(n for n in (prepared, f"compile {variant}, first call {first_call:.0f} s") if n))


def hf_throughput(hf_config: dict, dtype, device, num_requests: int = 256, measured_steps: int = 64,
                  max_input_len: int = 1024, max_output_len: int = 1024) -> Result:
    """Static batching: the requests left-padded to the longest prompt of their batch, each batch
    run for its largest max_tokens. One batch of all the requests if it fits in memory, else
    batches half as large, and so on (a 30B mixture's weights leave no room for 256 padded
    sequences on one GPU). Each batch runs its prefill and ``measured_steps`` decode steps and
    extrapolates the rest at the measured per-step time (an underestimate: later steps attend to
    longer contexts)."""
    import gc

    import torch

    prompts, max_tokens = throughput_requests(num_requests, max_input_len, max_output_len, hf_config.get("vocab_size"))
    model = hf_model(hf_config, dtype, device)
    batch = len(prompts)
    while True:
        try:
            walls = [_static_batch_wall(model, prompts[i:i + batch], max_tokens[i:i + batch], measured_steps, device)
                     for i in range(0, len(prompts), batch)]
            break
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
            batch = (batch + 1) // 2
            gc.collect()
            torch.cuda.empty_cache()
    wall = sum(w for w, _ in walls)
    experts = getattr(model.config, "_experts_implementation", None) if {"num_experts", "num_local_experts"} & hf_config.keys() else None
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    note = (f"eager SDPA, {len(walls)} batch(es) of {batch} padded to their longest prompt (at most "
            f"{max(longest for _, longest in walls)}); {measured_steps} steps a batch measured, the rest extrapolated")
    return Result("throughput", "hf static batching", {"output_tok_s": sum(max_tokens) / wall, "wall_s": wall},
                  note=note + (f"; experts implementation {experts}" if experts else ""))


def _static_batch_wall(model, prompts, max_tokens, measured_steps: int, device) -> tuple[float, int]:
    """(seconds, longest prompt) of one static batch: ``hf_throughput``'s measurement."""
    import torch

    longest = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    kw = dict(attention_mask=mask, do_sample=True, temperature=0.6, top_k=0, top_p=1.0, pad_token_id=0)

    def timed(steps: int) -> float:
        _sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **kw)
        _sync()
        return time.perf_counter() - t0

    measured_steps = max(1, min(measured_steps, max(max_tokens) - 1))
    timed(2)  # warm-up
    t_prefill = timed(1)
    t_steps = timed(1 + measured_steps)
    per_step = max(t_steps - t_prefill, 0.0) / measured_steps
    return t_prefill + per_step * (max(max_tokens) - 1), longest


def hf_prefill(hf_config: dict, dtype, device, length: int = 1024, repeats: int = 5) -> Result:
    import torch

    model = hf_model(hf_config, dtype, device)
    ids = torch.tensor([latency_prompt(hf_config["vocab_size"], length, seed=1)], device=device)
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            _sync()
            t0 = time.perf_counter()
            model(ids, logits_to_keep=1)
            _sync()
            if i:
                times.append(time.perf_counter() - t0)
    del model
    med = statistics.median(times)
    return Result("prefill", "hf eager", {"ttft_ms": 1e3 * med, "prefill_tok_s": length / med}, note="one forward, SDPA")


def run_hf(hf_config: dict, dtype, device, workloads=WORKLOADS) -> list[Result]:
    fns = {"latency": hf_latency, "throughput": hf_throughput, "prefill": hf_prefill}
    results = []
    for w in workloads:
        try:
            results.append(fns[w](hf_config, dtype, device))
        except Exception as e:  # a peer failing must not hide our numbers
            msg = str(e).strip().splitlines()[0][:80] if str(e).strip() else type(e).__name__
            results.append(Result(w, "hf", {}, note=f"failed: {type(e).__name__}: {msg}"))
    return results


# ---------------------------------------------------------------------------------------------
# Ceilings measured in the same run, and what the workloads reach of them
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------

HEADLINE = {"latency": "decode_tok_s", "throughput": "output_tok_s", "prefill": "ttft_ms"}
LOWER_IS_BETTER = {"ttft_ms", "wall_s"}


def format_table(results: list[Result]) -> str:
    """One row per workload and metric: compiled_llm, the HF peer, and the speedup; a further
    peer of a workload (the torchao one of a quantized engine) adds the same rows against it."""
    rows = [("workload", "metric", "compiled_llm", "hf", "speedup", "notes")]
    for w in WORKLOADS:
        ours = next((r for r in results if r.workload == w and r.system == "compiled_llm"), None)
        peers = [r for r in results if r.workload == w and r.system != "compiled_llm"] or [None]
        if ours is None:
            continue
        for i, peer in enumerate(peers):
            for metric, value in ours.metrics.items():
                other = peer.metrics.get(metric) if peer else None
                speed = ""
                if other:
                    speed = f"{(other / value if metric in LOWER_IS_BETTER else value / other):.2f}x"
                notes = "; ".join(n for n in (ours.note if i == 0 else "", f"hf: {peer.system}, {peer.note}" if peer else "") if n)
                rows.append((w, metric, f"{value:,.1f}", f"{other:,.1f}" if other else "-", speed, notes if metric == HEADLINE[w] else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = []
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[j]) if j < 2 else c.rjust(widths[j]) for j, c in enumerate(r[:5])) + ("  " + r[5] if r[5] else ""))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)

