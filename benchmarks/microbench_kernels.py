"""Microbenchmarks of the fused cllm:: kernels on a GPU, one printed table.

Each fused op at real model shapes (Qwen2.5-0.5B, Llama-3.2-1B, GPT-2) against
  * eager: the unfused torch sequence (the op's reference implementation; for paged attention a
    vectorised gather + softmax in torch, since the reference loops over sequences on the host),
  * inductor: torch.compile of that same sequence,
  * the Triton provider (and the CUDA C++ provider for decode-shaped norm + MLP).
Times are medians of CUDA-graph replays (launch overhead excluded, as in the engine's decode
graphs) over calls that rotate through several random input sets; ops that cannot be captured
(host syncs) fall back to triton.testing.do_bench. GB/s counts the bytes an op must move at least (weights and
activations read once, outputs written once), reported against the device-to-device copy
bandwidth measured at the start of the same run; TFLOP/s is given for the matmul-bound shapes.

    python benchmarks/microbench_kernels.py            # everything, < 3 min on an H100
    python benchmarks/microbench_kernels.py --no-compile --cases mlp
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from compiled_llm.graph import fused_ops, ops  # noqa: E402

QWEN = dict(H=896, I=4864, Hq=14, Hkv=2, D=64)
LLAMA = dict(H=2048, I=8192, Hq=32, Hkv=8, D=64)
GPT2 = dict(H=768, I=3072, Hq=12, Hkv=12, D=64)
DTYPE = torch.bfloat16
ES = 2  # bytes per bf16 element
INPUT_SETS = 3


@dataclass
class Case:
    name: str
    make: Callable[[int], tuple]  # seed -> args
    bytes: float
    flops: float
    impls: dict[str, Callable]  # name -> fn(*args); "eager" first: the baseline


def decode_attention_torch(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_tables, scale):
    """Unfused decode attention in torch: store k/v, gather each sequence's blocks, masked
    softmax. Vectorised over sequences (no host sync), so torch.compile can take it whole."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)
    S, width = block_tables.shape
    bs, hkv, d = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    keys = kv_cache[0][block_tables.long()].reshape(S, width * bs, hkv, d)
    vals = kv_cache[1][block_tables.long()].reshape(S, width * bs, hkv, d)
    group = q.shape[1] // hkv
    qg = q.view(S, hkv, group, d).float()
    scores = torch.einsum("shgd,slhd->shgl", qg, keys.float()) * scale
    pos = torch.arange(width * bs, device=q.device)
    scores = scores.masked_fill((pos[None, :] >= seq_lens[:, None])[:, None, None, :], float("-inf"))
    out = torch.einsum("shgl,slhd->shgd", scores.softmax(-1), vals.float())
    return out.reshape(S, q.shape[1], d).to(q.dtype)


def prefill_attention_torch(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_tables, scale):
    """One fresh prompt: store k/v, then SDPA's causal kernel on the contiguous q/k/v."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1).contiguous()


def _rnd(gen, *shape, scale=1.0, shift=0.0):
    return (torch.randn(shape, generator=gen, device="cuda") * scale + shift).to(DTYPE)


def build_cases(with_cuda: bool) -> list[Case]:
    from compiled_llm.kernels import providers
    from kernel_inputs import attention_case, mlp_gelu_inputs, mlp_glu_inputs, qkv_inputs

    tri = lambda name: providers.provider_op(name, "triton")  # noqa: E731
    cases = []

    for m, label, T in ((QWEN, "qwen0.5b", 1), (QWEN, "qwen0.5b", 4096)):
        H = m["H"]

        def make(seed, T=T, H=H):
            g = torch.Generator("cuda").manual_seed(seed)
            return (_rnd(g, T, H), _rnd(g, T, H), _rnd(g, H, scale=0.1, shift=1.0), 1e-6)

        cases.append(Case(f"add_rms_norm {label} T={T}", make, (4 * T * H + H) * ES, 0,
                          {"eager": fused_ops.fused_add_rms_norm_ref, "triton": tri("fused_add_rms_norm")}))

    for m, label, T in ((QWEN, "qwen0.5b", 1), (QWEN, "qwen0.5b", 1024)):
        n = (m["Hq"] + 2 * m["Hkv"]) * m["D"]

        def make(seed, T=T, m=m):
            return qkv_inputs(T, m["H"], m["Hq"], m["Hkv"], m["D"], DTYPE, "cuda", seed, bias=True, qk_norm=False,
                              rope=True)

        cases.append(Case(f"qkv_rope {label} T={T}", make, (T * m["H"] + n * m["H"] + n + T * n) * ES + T * m["D"] * 4,
                          2 * T * m["H"] * n, {"eager": fused_ops.fused_qkv_rope_ref, "triton": tri("fused_qkv_rope")}))

    for m, label, T in ((QWEN, "qwen0.5b", 1), (QWEN, "qwen0.5b", 8), (LLAMA, "llama1b", 1), (QWEN, "qwen0.5b", 1024)):
        H, inter = m["H"], m["I"]

        def make(seed, T=T, H=H, inter=inter):
            return mlp_glu_inputs(T, H, inter, DTYPE, "cuda", seed)

        impls = {"eager": fused_ops.fused_rms_norm_glu_mlp_ref, "triton": tri("fused_rms_norm_glu_mlp")}
        if with_cuda and T <= 8:
            impls["cuda"] = providers.provider_op("fused_rms_norm_glu_mlp", "cuda")
        cases.append(Case(f"rms_norm_glu_mlp {label} T={T}", make, (3 * inter * H + 2 * T * H) * ES,
                          2 * T * H * 3 * inter, impls))

    H, inter = GPT2["H"], GPT2["I"]
    impls = {"eager": fused_ops.fused_layer_norm_gelu_mlp_ref, "triton": tri("fused_layer_norm_gelu_mlp")}
    if with_cuda:
        impls["cuda"] = providers.provider_op("fused_layer_norm_gelu_mlp", "cuda")
    cases.append(Case("layer_norm_gelu_mlp gpt2 T=1", lambda seed: mlp_gelu_inputs(1, H, inter, DTYPE, "cuda", seed),
                      (2 * inter * H + inter + 3 * H) * ES, 2 * H * 2 * inter, impls))

    for m, label, S, ctx in ((QWEN, "qwen0.5b", 1, 4096), (QWEN, "qwen0.5b", 64, 1024), (LLAMA, "llama1b", 32, 1024)):
        kv_bytes = S * ctx * m["Hkv"] * m["D"] * 2 * ES

        def make(seed, m=m, S=S, ctx=ctx):
            case = attention_case([(ctx - 1, 1)] * S, m["Hq"], m["Hkv"], m["D"], 16, DTYPE, "cuda", seed,
                                  extra_blocks=0)
            return case.args(case.kv_cache.nan_to_num(0.0))

        cases.append(Case(f"paged_attn decode {label} S={S} ctx={ctx}", make, kv_bytes + 2 * S * m["Hq"] * m["D"] * ES,
                          4 * S * ctx * m["Hq"] * m["D"],
                          {"eager": decode_attention_torch, "triton": tri("paged_attention")}))

    m, T = QWEN, 1024

    def make_prefill(seed):
        case = attention_case([(0, T)], m["Hq"], m["Hkv"], m["D"], 16, DTYPE, "cuda", seed, extra_blocks=0)
        return case.args(case.kv_cache.nan_to_num(0.0))

    cases.append(Case(f"paged_attn prefill qwen0.5b T={T}", make_prefill,
                      (2 * T * m["Hq"] * m["D"] + 4 * T * m["Hkv"] * m["D"]) * ES, 2 * T * T * m["Hq"] * m["D"],
                      {"eager": prefill_attention_torch, "triton": tri("paged_attention")}))
    return cases


def copy_bandwidth_gbs(do_bench) -> float:
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=5, rep=50, return_mode="median")
    return 2 * src.numel() * src.element_size() / ms / 1e6


def graph_time_us(fn, sets, reps: int = 30) -> float:
    """Median device time of one call, from replays of a CUDA graph that calls fn once per input
    set: launch and Python dispatch costs drop out, as they do in the engine's decode graphs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for args in sets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in sets:
            fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(sets))
    return statistics.median(times)


def rel_err(out, ref) -> float:
    out, ref = (out[0], ref[0]) if isinstance(out, (tuple, list)) else (out, ref)
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="", help="run only cases whose name contains this text")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile (Inductor) baseline")
    parser.add_argument("--no-cuda-ext", action="store_true", help="skip the CUDA C++ provider (no JIT build)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("microbench_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    from compiled_llm.kernels import cuda_norm_mlp

    t_start = time.perf_counter()
    torch.manual_seed(0)
    with_cuda = not args.no_cuda_ext and cuda_norm_mlp.cuda_extension_ok()
    if not args.no_cuda_ext and not with_cuda:
        print(f"note: CUDA C++ provider unavailable ({cuda_norm_mlp.build_error()})")
    copy_gbs = copy_bandwidth_gbs(do_bench)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"copy bandwidth (read+write): {copy_gbs:,.0f} GB/s  CUDA ext: {'yes' if with_cuda else 'no'}")

    header = f"{'case':<42} {'impl':<9} {'median us':>10} {'GB/s':>8} {'%copy':>6} {'TFLOP/s':>8} {'vs eager':>9} {'rel err':>8}"
    print(header)
    print("-" * len(header))
    for case in build_cases(with_cuda):
        if args.cases not in case.name:
            continue
        sets = [case.make(seed) for seed in range(INPUT_SETS)]
        impls = dict(case.impls)
        if not args.no_compile:
            impls["inductor"] = torch.compile(case.impls["eager"], dynamic=False)
        ref = case.impls["eager"](*sets[0])
        eager_us = None
        for name, fn in impls.items():
            try:
                out = fn(*sets[0])  # warm-up / compile, and a correctness spot check
                err = rel_err(out, ref)
                if "prefill" not in case.name:
                    us = graph_time_us(fn, sets)
                else:  # prefill attention reads its max query length on the host: no graph
                    cycle = itertools.cycle(sets)
                    us = do_bench(lambda: fn(*next(cycle)), warmup=10, rep=60, return_mode="median") * 1e3
            except Exception as e:  # one broken impl must not hide the rest of the table
                print(f"{case.name:<42} {name:<9} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                continue
            if name == "eager":
                eager_us = us
            gbs = case.bytes / us / 1e3
            tflops = case.flops / us / 1e6 if case.flops else 0.0
            speed = f"{eager_us / us:8.2f}x" if eager_us else "       -"
            print(f"{case.name:<42} {name:<9} {us:10.1f} {gbs:8.0f} {100 * gbs / copy_gbs:5.0f}% "
                  f"{tflops:8.1f} {speed:>9} {err:8.1e}")
        del sets
        torch.cuda.empty_cache()
    print(f"total wall time {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
