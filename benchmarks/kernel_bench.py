"""The kernel tools, for a CUDA GPU: one script, one timing helper.

    python benchmarks/kernel_bench.py micro      every fused op at real shapes against eager torch, Inductor
                                                 and the CUDA C++ provider
    python benchmarks/kernel_bench.py attention  paged attention: decode at runtime-shaped batches; the prefill
                                                 kernel's configs against SDPA
    python benchmarks/kernel_bench.py sweep      launch configs of the weight-streaming GEMV kernels, printed
                                                 as a launch_configs.py snippet with the dispatch limits
    python benchmarks/kernel_bench.py tune       batch-1 decode launch configs, tuned on the whole decode graph
    python benchmarks/kernel_bench.py gemm-wq    launch configs of the weight-only quantized GEMM (prefill sizes)
                                                 against cuBLAS on bf16 weights and the dequantizing reference
    python benchmarks/kernel_bench.py int4-stream  the int4 decode GEMV kernels against a probe that streams the
                                                 same weights with TMA bulk copies, with and without arithmetic
    python benchmarks/kernel_bench.py profile    decode graph time against the step's wall time, PDL on and
                                                 off, device time per kernel of decode and prefill steps
    python benchmarks/kernel_bench.py agree      fused kernels + CUDA graphs against the eager spec (greedy
                                                 agreement of the engine's logits)

Every kernel time is device time between CUDA events around replays of a CUDA graph
(``graph_time_us``): launch and Python costs drop out, as they do in the engine's graphs. The
kernels are called through their public entry points (compiled_llm.kernels.triton_*,
cuda_norm_mlp), the engines through ``compiled_llm.LLM``. ``--help`` of every subcommand,
``micro --list``, ``sweep --dry-run`` and ``agree`` run without a GPU; what the tools found is in
benchmarks/NOTES.md, the numbers in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import functools
import io
import itertools
import json
import math
import multiprocessing as mp
import os
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from compiled_llm import LLM, SamplingParams
from compiled_llm.engine import compare as cmp
from compiled_llm.graph import fused_ops, ops
from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.kernels import (
    cuda_norm_mlp,
    launch_configs,
    triton_common,
    triton_gemm_wq,
    triton_gemv,
    triton_kv_store,
    triton_norm,
    triton_norm_mlp,
    triton_qkv_rope,
)
from compiled_llm.kernels import triton_paged_attention as pa
from compiled_llm.model.presets import preset_config
from compiled_llm.model.sources import load_source_params
from compiled_llm.serve.worker.cuda_graphs import StepGraphs

DTYPE = torch.bfloat16
ITEMSIZE = 2  # bytes of a bf16 element
BLOCK = 16  # KV-cache block size (the runtime's default)
MAX_MODEL_LEN = 4096  # block-table width of the decode batches (it sets the split count)
QWEN, LLAMA, GPT2 = "qwen2.5-0.5b", "llama-3.2-1b", "gpt2"
model_config = functools.lru_cache(maxsize=None)(preset_config)  # a preset's shapes (ModelConfig)


# ---------------------------------------------------------------------------------------------
# shared: timing, inputs, errors
# ---------------------------------------------------------------------------------------------


def graph_time_us(fn: Callable, arg_sets=((),), calls: int | None = None, replays: int = 10, rounds: int = 5,
                  capture: bool = True) -> float:
    """Median device µs of one call of ``fn(*args)``.

    ``calls`` calls (default: one per arg set), rotating through ``arg_sets``, are captured in one
    CUDA graph after a warm-up on a side stream (compiles, allocator); weights rotated past the L2
    stream from HBM as every layer of a real step does. The graph is replayed ``replays`` times
    between two CUDA events, ``rounds`` times; the median round is divided by replays x calls.
    With ``capture=False``, ``fn()`` already launches a captured graph (the runtime's decode
    graph) and is timed as it is."""
    run, per_run = fn, 1
    if capture:
        calls = calls or len(arg_sets)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for args in arg_sets:
                fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(*arg_sets[i % len(arg_sets)])
        run, per_run = graph.replay, calls
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(replays):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * per_run))
    return statistics.median(times)


def copy_gbs() -> float:
    """Device-to-device copy bandwidth (bytes read + written): the ceiling GB/s figures are read
    against, measured in the same run."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / graph_time_us(lambda: dst.copy_(src), calls=2, replays=5) / 1e3


def matmul_tflops(n: int = 8192) -> float:
    """The bf16 n^3 matmul rate (random data): the ceiling of prefill (BENCHMARKS.md reads prefill against it)."""
    g = torch.Generator("cuda").manual_seed(0)
    a, b = randn(g, n, n), randn(g, n, n)
    return 2 * n ** 3 / graph_time_us(torch.matmul, [(a, b)], replays=5) / 1e6


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (the worst of a tuple's); inf when out is not finite."""
    if isinstance(out, (tuple, list)):
        return max(rel_err(o, r) for o, r in zip(out, ref))
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def randn(gen: torch.Generator, *shape, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=gen.device) * scale + shift).to(DTYPE)


def paged_batch(specs, cfg, seed: int, max_blocks: int | None = None, layers: int = 1, device: str = "cuda"):
    """A packed batch of sequences given as (cached, new) token counts, on ``device``: (the
    arguments of paged_attention, the kv_cache of each of ``layers`` layers). Cache blocks are
    handed out in a shuffled order; every cache is random (a timed graph over several layers
    reads K/V from HBM, not from an L2 one small cache would fit in)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // BLOCK) for c, n in specs]
    order = torch.randperm(sum(need), generator=gen).tolist()
    seqs, at = [], 0
    for (cached, new), nb in zip(specs, need):
        seqs.append(ScheduledSeq([0] * new, cached, order[at:at + nb]))
        at += nb
    b = pack_batch(seqs, BLOCK, device, max_blocks=max_blocks or max(need))
    g = torch.Generator(device).manual_seed(seed)
    T, Hq, Hkv, D = int(b.query_start_loc[-1]), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    caches = [randn(g, 2, sum(need), BLOCK, Hkv, D) for _ in range(layers)]
    args = (randn(g, T, Hq, D), randn(g, T, Hkv, D), randn(g, T, Hkv, D), caches[0], b.slot_mapping,
            b.query_start_loc, b.seq_lens, b.block_tables, D ** -0.5)
    return args, caches


def use_config(kernel: str, bucket_config: dict) -> None:
    """Install ``bucket_config`` as every bucket of ``kernel`` (the other kernels keep theirs)."""
    launch_configs.use_configs({kernel: {"inf": bucket_config}})


def failure(e: Exception) -> str:
    return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


def needs_cuda(name: str) -> bool:
    if torch.cuda.is_available():
        return True
    print(f"kernel_bench {name}: needs a CUDA GPU", file=sys.stderr)
    return False


# ---------------------------------------------------------------------------------------------
# micro: every fused op against eager torch, Inductor and the CUDA C++ provider
# ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    make: Callable[..., tuple]  # (seed, device="cuda") -> arguments
    bytes: float  # what the op must move at least: weights and activations read once, outputs written once
    flops: float
    impls: dict[str, Callable]  # "eager" first: the baseline and the reference


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
    qg = q.view(S, hkv, q.shape[1] // hkv, d).float()
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
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).contiguous()


def micro_cases(with_cuda: bool) -> list[Case]:
    qwen, llama, gpt2 = model_config(QWEN), model_config(LLAMA), model_config(GPT2)
    cases = []
    H = qwen.hidden_size
    for T in (1, 4096):
        def make(seed, device="cuda", T=T, H=H):
            g = torch.Generator(device).manual_seed(seed)
            return randn(g, T, H), randn(g, T, H), randn(g, H, scale=0.1, shift=1.0), 1e-6

        cases.append(Case(f"add_rms_norm {QWEN} T={T}", make, (4 * T * H + H) * ITEMSIZE, 0,
                          {"eager": fused_ops.fused_add_rms_norm_ref, "triton": triton_norm.fused_add_rms_norm}))

    n_qkv = (qwen.num_heads + 2 * qwen.num_kv_heads) * qwen.head_dim
    for T in (1, 1024):
        def make(seed, device="cuda", T=T, H=H):
            g = torch.Generator(device).manual_seed(seed)
            pos = torch.randint(0, MAX_MODEL_LEN, (T,), generator=g, device=device)
            cos_sin = ops.rope_cos_sin(qwen.head_dim, MAX_MODEL_LEN, qwen.rope_theta).to(device)
            return (randn(g, T, H), randn(g, n_qkv, H, scale=H ** -0.5), randn(g, n_qkv, scale=0.5), None, None, pos,
                    cos_sin, qwen.num_heads, qwen.num_kv_heads, qwen.head_dim, 1e-6)

        cases.append(Case(f"qkv_rope {QWEN} T={T}", make, (T * H + n_qkv * H + n_qkv + T * n_qkv) * ITEMSIZE,
                          2 * T * H * n_qkv,
                          {"eager": fused_ops.fused_qkv_rope_ref, "triton": triton_qkv_rope.fused_qkv_rope}))

    for cfg, name, T in ((qwen, QWEN, 1), (qwen, QWEN, 8), (llama, LLAMA, 1), (qwen, QWEN, 1024)):
        H, inter = cfg.hidden_size, cfg.intermediate_size

        def make(seed, device="cuda", T=T, H=H, inter=inter):
            g = torch.Generator(device).manual_seed(seed)
            return (randn(g, T, H), randn(g, H, scale=0.1, shift=1.0), 1e-6, randn(g, 2 * inter, H, scale=H ** -0.5),
                    randn(g, H, inter, scale=inter ** -0.5))

        impls = {"eager": fused_ops.fused_rms_norm_glu_mlp_ref, "triton": triton_norm_mlp.fused_rms_norm_glu_mlp}
        if with_cuda and T <= 8:
            impls["cuda"] = cuda_norm_mlp.fused_rms_norm_glu_mlp
        cases.append(Case(f"rms_norm_glu_mlp {name} T={T}", make, (3 * inter * H + 2 * T * H) * ITEMSIZE,
                          2 * T * H * 3 * inter, impls))

    H, inter = gpt2.hidden_size, gpt2.intermediate_size

    def make_gelu(seed, device="cuda"):
        g = torch.Generator(device).manual_seed(seed)
        return (randn(g, 1, H, shift=0.5), randn(g, H, scale=0.1, shift=1.0), randn(g, H, scale=0.1), 1e-5,
                randn(g, inter, H, scale=H ** -0.5), randn(g, inter, scale=0.1), randn(g, H, inter, scale=inter ** -0.5),
                randn(g, H, scale=0.1))

    impls = {"eager": fused_ops.fused_layer_norm_gelu_mlp_ref, "triton": triton_norm_mlp.fused_layer_norm_gelu_mlp}
    if with_cuda:
        impls["cuda"] = cuda_norm_mlp.fused_layer_norm_gelu_mlp
    cases.append(Case(f"layer_norm_gelu_mlp {GPT2} T=1", make_gelu, (2 * inter * H + inter + 3 * H) * ITEMSIZE,
                      2 * H * 2 * inter, impls))

    for cfg, name, S, ctx in ((qwen, QWEN, 1, 4096), (qwen, QWEN, 64, 1024), (llama, LLAMA, 32, 1024)):
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cases.append(Case(f"paged_attn decode {name} S={S} ctx={ctx}",
                          lambda seed, device="cuda", cfg=cfg, S=S, ctx=ctx:
                          paged_batch([(ctx - 1, 1)] * S, cfg, seed, device=device)[0],
                          (S * ctx * Hkv * D * 2 + 2 * S * Hq * D) * ITEMSIZE, 4 * S * ctx * Hq * D,
                          {"eager": decode_attention_torch, "triton": pa.paged_attention}))
    T, Hq, Hkv, D = 1024, qwen.num_heads, qwen.num_kv_heads, qwen.head_dim
    cases.append(Case(f"paged_attn prefill {QWEN} T={T}",
                      lambda seed, device="cuda": paged_batch([(0, T)], qwen, seed, device=device)[0],
                      (2 * T * Hq * D + 4 * T * Hkv * D) * ITEMSIZE, 2 * T * T * Hq * D,
                      {"eager": prefill_attention_torch, "triton": pa.paged_attention}))
    return cases


def micro(args) -> int:
    if args.list:
        for case in micro_cases(with_cuda=False):
            print(f"{case.name:<44} {', '.join(case.impls)}")
        return 0
    if not needs_cuda("micro"):
        return 2
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with_cuda = not args.no_cuda_ext and cuda_norm_mlp.cuda_extension_ok()
    if not args.no_cuda_ext and not with_cuda:
        print(f"note: CUDA C++ provider unavailable ({cuda_norm_mlp.build_error()})")
    ceiling = copy_gbs()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"copy bandwidth (read+write): {ceiling:,.0f} GB/s  bf16 8192^3 matmul: {matmul_tflops():,.0f} TFLOP/s  "
          f"CUDA ext: {'yes' if with_cuda else 'no'}")
    header = (f"{'case':<44} {'impl':<9} {'median us':>10} {'GB/s':>8} {'%copy':>6} {'TFLOP/s':>8} {'vs eager':>9} "
              f"{'rel err':>8}")
    print(header + "\n" + "-" * len(header))
    for case in micro_cases(with_cuda):
        if args.cases not in case.name:
            continue
        sets = [case.make(seed) for seed in range(args.input_sets)]
        impls = dict(case.impls)
        if not args.no_compile:
            impls["inductor"] = torch.compile(case.impls["eager"], dynamic=False)
        ref = case.impls["eager"](*sets[0])
        eager_us = None
        for name, fn in impls.items():
            try:
                err = rel_err(fn(*sets[0]), ref)  # also the warm-up / compile
                us = graph_time_us(fn, sets)
            except Exception as e:  # one broken impl must not hide the rest of the table
                print(f"{case.name:<44} {name:<9} {failure(e)}")
                continue
            eager_us = us if name == "eager" else eager_us
            gbs = case.bytes / us / 1e3
            speed = f"{eager_us / us:8.2f}x" if eager_us else "       -"
            print(f"{case.name:<44} {name:<9} {us:10.1f} {gbs:8.0f} {100 * gbs / ceiling:5.0f}% "
                  f"{case.flops / us / 1e6:8.1f} {speed:>9} {err:8.1e}")
        del sets
        torch.cuda.empty_cache()
    print(f"total wall time {time.perf_counter() - t0:.0f} s")
    return 0


# ---------------------------------------------------------------------------------------------
# attention: decode at runtime-shaped batches; prefill kernel configs against SDPA
# ---------------------------------------------------------------------------------------------

DECODE_CASES = [(QWEN, 1, 384), (QWEN, 1, 4096), (QWEN, 64, 1024), (LLAMA, 32, 1024)]  # (model, S, context)
PREFILL_SWEEP = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages) besides the default
    (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 8, 3),
]


def attention_decode(args, rows: list) -> None:
    """One call per layer cache in each timed graph, block tables a runtime's full width."""
    for model, S, ctx in DECODE_CASES:
        cfg = model_config(model)
        label = f"decode {model} S={S} ctx={ctx}"
        try:
            batch, caches = paged_batch([(ctx - 1, 1)] * S, cfg, seed=0, max_blocks=MAX_MODEL_LEN // BLOCK,
                                        layers=args.layers)
            splits = pa.decode_plan(S, cfg.num_kv_heads, MAX_MODEL_LEN, torch.device("cuda"))["NUM_SPLITS"]
            us = graph_time_us(lambda c, b=batch: pa.paged_attention(*b[:3], c, *b[4:]), [(c,) for c in caches],
                               replays=args.reps)
        except Exception as e:
            rows.append((label, "kernel", failure(e)))
            continue
        kv_bytes = S * ctx * cfg.num_kv_heads * cfg.head_dim * 2 * ITEMSIZE
        rows.append((label, f"splits={splits}", f"{us:8.2f} us  {kv_bytes / us / 1e3:7.0f} GB/s of K/V"))
        del caches
        torch.cuda.empty_cache()


# Large-batch decode at Llama-3.1-8B's heads, whole (TP=1) and one rank's share at TP=2, over
# contexts drawn uniform in 100..1600 (the throughput workload's middle): the "inf" bucket's
# (BLOCK_N, num_warps, num_stages, PROGRAMS_PER_SM), after the default, and with one stage the
# kernel's own prefetch of the next tile (PREFETCH).
DECODE_SWEEP_SHAPES = [("8b TP=1", 32, 8), ("8b TP=2 rank", 16, 4)]  # (label, q heads, kv heads); head_dim 128
DECODE_SWEEP = [dict(BLOCK_N=bn, num_warps=w, num_stages=st, PROGRAMS_PER_SM=pps, **prefetch)
                for bn in (32, 64, 128) for w in (4, 8) for st in (1, 2, 3) for pps in (2, 4)
                for prefetch in ({}, {"PREFETCH": 1}) if st == 1 or not prefetch]


def attention_decode_sweep(args, rows: list) -> None:
    """Time every config of DECODE_SWEEP on mixed-length decode batches of 256 and 128
    sequences, in the scheduler's row order (longest context first); each output is checked
    against the default config's. The default also runs on the rows in arrival (random) order,
    which shows what the order buys."""
    default = launch_configs.get("paged_attention_decode", 1 << 20)
    for S in (256, 128):
        draw = random.Random(S)
        arrival = [draw.randint(100, 1600) for _ in range(S)]
        for (label, heads, kv_heads), order in itertools.product(DECODE_SWEEP_SHAPES, ("longest first", "arrival")):
            ctx = sorted(arrival, reverse=True) if order == "longest first" else arrival
            label = f"{label} {order}"
            cfg = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=128)
            batch, caches = paged_batch([(c - 1, 1) for c in ctx], cfg, seed=0, max_blocks=MAX_MODEL_LEN // BLOCK,
                                        layers=args.layers)
            kv_bytes = sum(ctx) * kv_heads * 128 * 2 * ITEMSIZE
            ref = pa.paged_attention(*batch[:3], caches[0], *batch[4:]).float()
            candidates = [{**{k: v for k, v in default.items() if k != "PREFETCH"}, **knobs} for knobs in DECODE_SWEEP]
            for i, knobs in enumerate([default] + (candidates if order == "longest first" else [])):
                use_config("paged_attention_decode", knobs)
                what = ("default " if i == 0 else "") + (f"BLOCK_N={knobs['BLOCK_N']} w={knobs['num_warps']} "
                                                         f"s={knobs['num_stages']} {knobs['PROGRAMS_PER_SM']}/SM"
                                                         + (" prefetch" if knobs.get("PREFETCH") else ""))
                try:
                    err = rel_err(pa.paged_attention(*batch[:3], caches[0], *batch[4:]).float(), ref)
                    us = graph_time_us(lambda c, b=batch: pa.paged_attention(*b[:3], c, *b[4:]),
                                       [(c,) for c in caches], replays=args.reps)
                except Exception as e:
                    rows.append((f"decode {label} S={S}", what, failure(e)))
                    continue
                rows.append((f"decode {label} S={S}", what,
                             f"{us:8.2f} us  {kv_bytes / us / 1e3:5.0f} GB/s of K/V  rel err {err:.1e}"))
            launch_configs.use_configs(None)
            del caches, batch
            torch.cuda.empty_cache()


def attention_prefill(args, rows: list) -> None:
    """The kernel alone (k/v stored first) per config, the whole op, and SDPA on contiguous
    [1, H, T, D] tensors (with enable_gqa and with K/V expanded to every query head)."""
    cfg, T = model_config(QWEN), args.prefill_tokens
    label = f"prefill {QWEN} T={T}"
    (q, k, v, cache, slots, qsl, seq_lens, tables, scale), _ = paged_batch([(0, T)], cfg, seed=1)
    triton_kv_store.kv_store(k, v, cache, slots)
    group = cfg.num_heads // cfg.num_kv_heads
    qh, kh, vh = (t.transpose(0, 1)[None].contiguous() for t in (q, k, v))
    ke, ve = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    sdpa_us = math.inf
    for what, fn in (
        ("torch SDPA enable_gqa", lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                                                         enable_gqa=True)),
        ("torch SDPA K/V expanded", lambda: F.scaled_dot_product_attention(qh, ke, ve, is_causal=True, scale=scale)),
    ):
        try:
            us = graph_time_us(fn, replays=args.reps)
        except Exception as e:
            rows.append((label, what, failure(e)))
            continue
        sdpa_us = min(sdpa_us, us)
        rows.append((label, what, f"{us:8.2f} us"))
    default = launch_configs.get("paged_attention_prefill", T)
    configs = [(default["BLOCK_M"], default["BLOCK_N"], default["num_warps"], default["num_stages"])]
    configs += [] if args.no_sweep else [c for c in PREFILL_SWEEP if c != configs[0]]
    for i, (bm, bn, warps, stages) in enumerate(configs):
        use_config("paged_attention_prefill", {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages})
        tokens = pa.prefill_tile(cfg.num_heads, cfg.num_kv_heads, bm)[1]
        what = f"kernel BLOCK_M={bm}({tokens} tok) N={bn} w={warps} s={stages}" + (" [default]" if i == 0 else "")
        try:
            us = graph_time_us(lambda: pa.paged_attention_prefill(q, cache, qsl, seq_lens, tables, scale),
                               replays=args.reps)
        except Exception as e:  # a config that does not compile or run is reported and skipped
            rows.append((label, what, failure(e)))
            continue
        rows.append((label, what, f"{us:8.2f} us  {us / sdpa_us:4.2f}x SDPA"))
    launch_configs.use_configs(None)
    us = graph_time_us(lambda: pa.paged_attention(q, k, v, cache, slots, qsl, seq_lens, tables, scale),
                       replays=args.reps)
    rows.append((label, "whole op (kv_store + kernel)", f"{us:8.2f} us"))


def attention(args) -> int:
    if not needs_cuda("attention"):
        return 2
    t0 = time.perf_counter()
    rows: list[tuple[str, str, str]] = []
    for name, fn in (("decode", attention_decode), ("decode-sweep", attention_decode_sweep),
                     ("prefill", attention_prefill)):
        if name in args.cases:
            fn(args, rows)
    print(f"# paged attention on {torch.cuda.get_device_name()} ({DTYPE}), {time.perf_counter() - t0:.0f} s")
    w0, w1 = (max((len(r[i]) for r in rows), default=0) for i in (0, 1))
    for case, what, result in rows:
        print(f"{case:<{w0}}  {what:<{w1}}  {result}")
    return 0


# ---------------------------------------------------------------------------------------------
# sweep: launch configs of the weight-streaming GEMV kernels
# ---------------------------------------------------------------------------------------------
# For every (shape, T) each candidate config of the kernel that serves the shape is timed:
#   qkv      fused_qkv_rope decode kernel (input RMSNorm + projection + RoPE)   table "qkv_decode"
#   o        triton_gemv.gemv + residual                                         table "gemv"
#   gate_up  norm + MLP decode activation kernel (RMSNorm + gate/up + silu * up) table "norm_mlp_decode"
#   down     triton_gemv.gemv + residual (tall K)                                table "norm_mlp_down"
#   lm_head  triton_gemv.gemv, plain (reported only: no call site uses it)
# with cuBLAS F.linear on the same weight for scale. Calls rotate over enough weight copies (>= 4,
# and >= 2x the L2 in all) that every call streams its weight from HBM. A candidate's output is
# checked against the reference (rel err <= 1e-2 in bf16); one that fails to compile or run is
# skipped, one that is wrong is reported and never chosen. Then, with the best configs installed,
# each op's decode form is timed against its cuBLAS (prefill) form per T, which gives the
# dispatch limits (MAX_TOKENS / MAX_DECODE_TOKENS). num_stages is 1 by default: these loops have
# no tl.dot for Triton to pipeline (``--stages 1 3`` sweeps it anyway).

SWEEP_MODELS = (QWEN, LLAMA)
ROLES = ("qkv", "o", "gate_up", "down", "lm_head")
TABLE_OF_ROLE = {"qkv": "qkv_decode", "o": "gemv", "gate_up": "norm_mlp_decode", "down": "norm_mlp_down",
                 "lm_head": "gemv"}
# each table's (weight-rows key, K key) and candidate values: weight rows per program, and
# (K block, warps) pairs; warps are caps, the wrappers lay them along K (4 bf16 warps fill 1024)
GRIDS = {
    "gemv": dict(rows_key="BLOCK_N", k_key="BLOCK_K", rows=(1, 2, 4, 8),
                 k_warps=((512, 2), (1024, 2), (1024, 4), (2048, 4), (2048, 8))),
    "norm_mlp_down": dict(rows_key="BLOCK_N", k_key="BLOCK_K", rows=(1, 2, 4),
                          k_warps=((1024, 4), (2048, 4), (2048, 8), (4096, 8))),
    "norm_mlp_decode": dict(rows_key="BLOCK_I", k_key="BLOCK_H", rows=(1, 2, 4),
                            k_warps=((512, 2), (1024, 2), (1024, 4), (2048, 4), (2048, 8))),
    "qkv_decode": dict(rows_key="BLOCK_P", k_key="BLOCK_K", rows=(1, 2, 4, 8),
                       k_warps=((512, 2), (1024, 4), (2048, 4), (2048, 8))),
}
# weight tiles a program accumulates at once (gate + up; the two halves of a rotation pair)
TILES_PER_PROGRAM = {"gemv": 1, "norm_mlp_down": 1, "norm_mlp_decode": 2, "qkv_decode": 2}
MAX_ACC_REGS = 128  # fp32 accumulator registers a thread may hold; more spills or starves occupancy
L2_BYTES = 50 * 2**20
MIN_COPIES, MIN_CALLS = 4, 20
TOL = 1e-2


@dataclass(frozen=True)
class Shape:
    model: str
    role: str
    N: int  # weight rows
    K: int  # weight columns (reduction)

    @property
    def name(self) -> str:
        return f"{self.model}/{self.role} {self.N}x{self.K}"

    @property
    def table(self) -> str:
        return TABLE_OF_ROLE[self.role]

    @property
    def weight_bytes(self) -> int:
        return self.N * self.K * ITEMSIZE

    def tile_rows(self) -> int:
        """The extent tile_config caps the table's rows block at."""
        if self.role == "gate_up":
            return self.N // 2
        if self.role == "qkv":
            return model_config(self.model).head_dim // 2
        return self.N


def role_shape(model: str, role: str) -> Shape:
    c = model_config(model)
    H, n_qkv = c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    n, k = {"qkv": (n_qkv, H), "o": (H, H), "gate_up": (2 * c.intermediate_size, H), "down": (H, c.intermediate_size),
            "lm_head": (c.vocab_size, H)}[role]
    return Shape(model, role, n, k)


def all_shapes(models, roles) -> list[Shape]:
    shapes = [role_shape(m, r) for m in models for r in roles if r != "lm_head"]
    return shapes + ([role_shape(QWEN, "lm_head")] if "lm_head" in roles else [])  # Qwen2.5's tied embedding


def raw_candidates(table: str, T: int, stages) -> list[dict]:
    """The table entries to try for T tokens (BLOCK_T = T: one pass over the weights)."""
    g = GRIDS[table]
    return [{"BLOCK_T": T, g["rows_key"]: rows, g["k_key"]: k, "num_warps": warps, "num_stages": st}
            for rows in g["rows"] for k, warps in g["k_warps"] for st in stages]


def effective(shape: Shape, raw: dict, T: int) -> tuple:
    """What a launch with ``raw`` actually runs for ``shape`` (the wrappers cap blocks at the
    problem and lay warps along K): raw configs that agree here are measured once."""
    g = GRIDS[shape.table]
    tile = triton_gemv.tile_config(raw, T, shape.tile_rows(), shape.K, ITEMSIZE, rows_key=g["rows_key"],
                                   k_key=g["k_key"])
    return tile["BLOCK_T"], tile["BLOCK_ROWS"], tile["BLOCK_K"], tile["num_warps"], tile["num_stages"]


def plan(shapes, tokens, stages) -> dict:
    """{(shape, T): {effective key: [raw configs]}} with register-hungry candidates pruned."""
    out = {}
    for shape in shapes:
        for T in tokens:
            groups: dict[tuple, list[dict]] = {}
            for raw in raw_candidates(shape.table, T, stages):
                eff = effective(shape, raw, T)
                bt, rows, bk, warps, _ = eff
                if TILES_PER_PROGRAM[shape.table] * bt * rows * bk / (32 * warps) <= MAX_ACC_REGS:
                    groups.setdefault(eff, []).append(raw)
            out[(shape, T)] = groups
    return out


def compile_jobs(planned) -> dict:
    """One (shape, T, raw config) per distinct kernel compilation the sweep triggers: o and down
    compile the same GEMV kernels; q/k/v's head counts are constexprs, so each model has its own."""
    jobs = {}
    for (shape, T), groups in planned.items():
        variant = {"o": "gemv+residual", "down": "gemv+residual", "qkv": f"qkv/{shape.model}"}.get(shape.role,
                                                                                                  shape.role)
        for eff, raws in groups.items():
            jobs.setdefault((variant, *eff), (shape, T, raws[0]))
    return jobs


def copies_for(weight_bytes: int) -> int:
    """Weight copies to rotate through: at least MIN_COPIES and 2x the L2 in all."""
    return max(MIN_COPIES, math.ceil(2 * L2_BYTES / weight_bytes))


@dataclass
class Op:
    """One shape's kernel call under test: arg sets (one per weight copy), the call, its
    reference, the cuBLAS baseline, and the decode / prefill forms for the dispatch limits."""
    arg_sets: list
    call: Callable
    reference: Callable
    cublas: Callable
    forms: dict = field(default_factory=dict)
    ref: object = None  # the reference output of arg_sets[0], once computed

    def error(self, fn: Callable) -> float:
        if self.ref is None:
            self.ref = self.reference(*self.arg_sets[0])
        return rel_err(fn(*self.arg_sets[0]), self.ref)


def make_op(shape: Shape, T: int, copies: int, device: str = "cuda") -> Op:
    c = model_config(shape.model)
    g = torch.Generator(device).manual_seed(T)
    H = shape.K
    weights = [randn(g, shape.N, shape.K, scale=shape.K ** -0.5) for _ in range(copies)]
    if shape.role == "qkv":
        cos_sin = ops.rope_cos_sin(c.head_dim, MAX_MODEL_LEN, c.rope_theta).to(device)
        pos = torch.randint(0, MAX_MODEL_LEN, (T,), generator=g, device=device)
        heads = (c.num_heads, c.num_kv_heads, c.head_dim, 1e-6)
        sets = [(randn(g, T, H), w, randn(g, shape.N, scale=0.5) if c.qkv_bias else None,
                 randn(g, H, scale=0.1, shift=1.0)) for w in weights]

        def qkv(form):
            return lambda x, w, b, nw: triton_qkv_rope.fused_qkv_rope(x, w, b, None, None, pos, cos_sin, *heads,
                                                                      norm_weight=nw, norm_eps=1e-6, form=form)

        return Op(sets, qkv("decode"),
                  lambda x, w, b, nw: fused_ops.fused_qkv_rope_ref(x, w, b, None, None, pos, cos_sin, *heads, nw, 1e-6),
                  lambda x, w, b, nw: F.linear(x, w, b), {"decode": qkv("decode"), "prefill": qkv("prefill")})
    if shape.role == "gate_up":
        def act_ref(x, nw, w):
            gate, up = F.linear(ops.rms_norm_ref(x, nw, 1e-6), w).chunk(2, -1)
            return F.silu(gate) * up

        return Op([(randn(g, T, H), randn(g, H, scale=0.1, shift=1.0), w) for w in weights],
                  lambda x, nw, w: triton_norm_mlp.decode_activation(x, nw, None, 1e-6, w, None, True, True),
                  act_ref, lambda x, nw, w: F.linear(x, w))
    if shape.role in ("o", "down"):
        decode = lambda x, w, r: triton_gemv.gemv(x, w, None, r, config=shape.table)  # noqa: E731
        return Op([(randn(g, T, shape.K), w, randn(g, T, shape.N)) for w in weights], decode,
                  lambda x, w, r: r + F.linear(x, w), lambda x, w, r: F.linear(x, w),
                  {"decode": decode, "prefill": lambda x, w, r: triton_gemv.dense_linear(x, w, None, r)})
    return Op([(randn(g, T, shape.K), w) for w in weights], triton_gemv.gemv, F.linear, F.linear)  # lm_head


def mlp_forms(model: str, T: int, copies: int, device: str = "cuda") -> Op:
    """The whole norm + MLP op (with residual), for the MLP's dispatch limit."""
    c = model_config(model)
    H, inter = c.hidden_size, c.intermediate_size
    g = torch.Generator(device).manual_seed(100 + T)
    sets = [(randn(g, T, H), randn(g, H, scale=0.1, shift=1.0), 1e-6, randn(g, 2 * inter, H, scale=H ** -0.5),
             randn(g, H, inter, scale=inter ** -0.5), randn(g, T, H)) for _ in range(copies)]

    def form(f):
        return lambda x, nw, eps, gu, dn, r: triton_norm_mlp.fused_rms_norm_glu_mlp(x, nw, eps, gu, dn, residual=r,
                                                                                     form=f)

    return Op(sets, form("decode"), lambda *a: fused_ops.fused_rms_norm_glu_mlp_ref(*a[:5], residual=a[5]),
              lambda *a: None, {"decode": form("decode"), "prefill": form("prefill")})


def _compile_worker(jobs: list, wall_deadline: float) -> int:
    """Run each job once (compiling its kernel into Triton's on-disk cache, which processes may
    share); returns how many could not run. Runs in a spawned process."""
    failed, current, op = 0, None, None
    for shape, T, raw in jobs:  # sorted by (shape, T): one op at a time in memory
        if time.time() > wall_deadline:
            break
        try:
            if current != (shape, T):
                op, current = None, (shape, T)
                op = make_op(shape, T, copies=1)
            use_config(shape.table, raw)
            op.call(*op.arg_sets[0])
        except Exception:
            failed += 1
    torch.cuda.synchronize()
    return failed


def precompile(jobs: dict, workers: int, wall_deadline: float) -> None:
    """Compile every kernel the sweep needs in ``workers`` processes at once: compilation, not
    timing, dominates a sweep of ~200 configs, and the timing process then loads cached kernels."""
    if workers <= 1 or not jobs:
        return
    items = sorted(jobs.values(), key=lambda j: (j[0].name, j[1]))
    chunks = [items[i::workers] for i in range(workers)]
    t0 = time.monotonic()
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        failed = sum(pool.map(_compile_worker, chunks, [wall_deadline] * workers))
    print(f"precompiled {len(items)} kernels in {workers} processes in {time.monotonic() - t0:.0f} s"
          f" ({failed} could not run; the sweep reports them)", flush=True)


@dataclass
class Result:
    us: dict = field(default_factory=dict)  # effective key -> µs
    raws: dict = field(default_factory=dict)  # effective key -> raw configs
    wrong: dict = field(default_factory=dict)  # effective key -> rel err
    failed: dict = field(default_factory=dict)  # effective key -> error line
    cublas_us: float = float("nan")


def fmt_eff(shape: Shape, eff: tuple) -> str:
    g = GRIDS[shape.table]
    bt, rows, bk, warps, st = eff
    return f"BLOCK_T={bt} {g['rows_key']}={rows} {g['k_key']}={bk} warps={warps} stages={st}"


def sweep_configs(planned, deadline: float) -> dict:
    results: dict = {}
    for (shape, T), groups in planned.items():
        res = results[(shape, T)] = Result(raws=groups)
        if time.monotonic() > deadline:
            print(f"  {shape.name} T={T}: skipped (time budget spent)")
            continue
        copies = copies_for(shape.weight_bytes)
        calls = max(MIN_CALLS, copies)
        op = make_op(shape, T, copies)
        res.cublas_us = graph_time_us(op.cublas, op.arg_sets, calls, replays=5, rounds=1)
        for eff, raws in groups.items():
            if time.monotonic() > deadline:
                break
            use_config(shape.table, raws[0])
            try:
                err = op.error(op.call)
                if not err <= TOL:
                    res.wrong[eff] = err
                    continue
                res.us[eff] = graph_time_us(op.call, op.arg_sets, calls, replays=5, rounds=1)
            except Exception as e:  # a config that does not compile or launch is skipped
                res.failed[eff] = failure(e)
                torch.cuda.synchronize()
        launch_configs.use_configs(None)
        best = min(res.us.items(), key=lambda kv: kv[1]) if res.us else None
        tail = f"best {best[1]:7.2f} µs {fmt_eff(shape, best[0])}" if best else "no valid config"
        print(f"  {shape.name:34s} T={T}: {len(res.us)}/{len(groups)} ok, cuBLAS {res.cublas_us:7.2f} µs, {tail}",
              flush=True)
        del op
        torch.cuda.empty_cache()
    return results


def choose_tables(results, tokens) -> dict:
    """Per table and T, the raw config minimising the sum over the table's shapes of time / best
    time of that shape (so a large shape does not drown a small one); lm_head is left out."""
    tables: dict = {}
    for T in tokens:
        per_table: dict = {}
        for (shape, t), res in results.items():
            if t == T and shape.role != "lm_head" and res.us:
                per_table.setdefault(shape.table, []).append(res)
        for table, entries in per_table.items():
            scores: dict = {}
            for res in entries:
                best = min(res.us.values())
                for eff, us in res.us.items():
                    for raw in res.raws[eff]:
                        scores.setdefault(json.dumps(raw, sort_keys=True), []).append(us / best)
            complete = {k: sum(v) for k, v in scores.items() if len(v) == len(entries)}
            if complete:
                # ties (raw configs that run identically) go to the smallest blocks
                best_key = min(complete, key=lambda k: (round(complete[k], 4), sorted(json.loads(k).values())))
                tables.setdefault(table, {})[str(T)] = json.loads(best_key)
    for buckets in tables.values():
        buckets["inf"] = dict(buckets[max(buckets, key=int)])
    return tables


def decode_limit(rows) -> int:
    """Largest T of (T, decode µs, prefill µs) rows such that the decode form wins there and at
    every smaller T swept (at least 1: one token always streams the weights)."""
    limit = 1
    for T, dec, pre in sorted(rows):
        if dec >= pre:
            break
        limit = T
    return limit


def dispatch_limits(models, tokens, deadline: float) -> dict:
    """With the chosen tables installed: the largest T up to which each op's decode form beats its
    prefill form, summed over the models, there and at every smaller T."""
    makers = {
        "gemv_dispatch": lambda m, T: make_op(role_shape(m, "o"), T, copies_for(role_shape(m, "o").weight_bytes)),
        "qkv_dispatch": lambda m, T: make_op(role_shape(m, "qkv"), T, copies_for(role_shape(m, "qkv").weight_bytes)),
        "norm_mlp_dispatch": lambda m, T: mlp_forms(m, T, MIN_COPIES),
    }
    rows: dict = {name: [] for name in makers}
    for T in tokens:
        if time.monotonic() > deadline:
            print("  dispatch: time budget spent")
            break
        for name, make in makers.items():
            dec = pre = 0.0
            for model in models:
                try:
                    op = make(model, T)
                    dec += graph_time_us(op.forms["decode"], op.arg_sets, MIN_CALLS, replays=5, rounds=1)
                    pre += graph_time_us(op.forms["prefill"], op.arg_sets, MIN_CALLS, replays=5, rounds=1)
                except Exception as e:
                    print(f"  dispatch {name} {model} T={T}: {failure(e)}")
                    dec = math.inf
            rows[name].append((T, dec, pre))
            print(f"  {name:18s} T={T}: decode form {dec:8.2f} µs, prefill form {pre:8.2f} µs (sum over models)")
    key = {"norm_mlp_dispatch": "MAX_DECODE_TOKENS"}
    return {name: {"inf": {key.get(name, "MAX_TOKENS"): decode_limit(r)}} for name, r in rows.items() if r}


def sweep_report(results, ceiling: float) -> None:
    print(f"\n{'shape':36s} {'T':>2s} {'best µs':>8s} {'GB/s':>7s} {'%copy':>6s} {'cuBLAS µs':>9s} {'x':>5s}  config")
    for (shape, T), res in results.items():
        if not res.us:
            print(f"{shape.name:36s} {T:2d} {'-':>8s}   (no valid config; failed {len(res.failed)}, "
                  f"wrong {len(res.wrong)})")
            continue
        eff, us = min(res.us.items(), key=lambda kv: kv[1])
        gbs = shape.weight_bytes / us / 1e3
        print(f"{shape.name:36s} {T:2d} {us:8.2f} {gbs:7.0f} {100 * gbs / ceiling:5.0f}% {res.cublas_us:9.2f} "
              f"{res.cublas_us / us:5.2f}  {fmt_eff(shape, eff)}")
        for bad, err in res.wrong.items():
            print(f"    WRONG (rel err {err:.2e}): {fmt_eff(shape, bad)}")
        for bad, msg in list(res.failed.items())[:2]:
            print(f"    {fmt_eff(shape, bad)}: {msg}")


def sweep(args) -> int:
    t0 = time.monotonic()
    tokens = sorted(set(args.tokens))
    shapes = all_shapes(args.models, args.roles)
    planned = plan(shapes, tokens, args.stages)
    print(f"{len(shapes)} shapes x {len(tokens)} token counts: {sum(len(g) for g in planned.values())} measurements, "
          f"{len(compile_jobs(planned))} kernel compilations")
    if args.dry_run:
        for (shape, T), groups in planned.items():
            copies = copies_for(shape.weight_bytes)
            print(f"  {shape.name:36s} T={T}: {len(groups):3d} configs, {copies:3d} weight copies"
                  f" ({copies * shape.weight_bytes / 2**20:.0f} MiB)")
        return 0
    if not needs_cuda("sweep (try --dry-run)"):
        return 2
    ceiling = copy_gbs()
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {ceiling:.0f} GB/s", flush=True)
    left = args.budget_s - (time.monotonic() - t0)
    precompile(compile_jobs(planned), args.jobs, time.time() + left / 2)
    results = sweep_configs(planned, t0 + max(args.budget_s - 20, 0))
    sweep_report(results, ceiling)
    tables = choose_tables(results, tokens)
    if not args.no_dispatch and tables:
        launch_configs.use_configs(tables)
        print("\ndecode vs prefill forms with the chosen configs:")
        tables.update(dispatch_limits(sorted({s.model for s in shapes if s.role != "lm_head"}), tokens,
                                      t0 + args.budget_s))
        launch_configs.use_configs(None)
    snippet = json.dumps(tables, indent=1, sort_keys=True)
    print("\n# paste into DEFAULT_CONFIGS in compiled_llm/kernels/launch_configs.py (keeping each table's \"shapes\"):\n" + snippet)
    if args.json_out:
        args.json_out.write_text(snippet + "\n")
    print(f"\n{time.monotonic() - t0:.0f} s")
    return 0


# ---------------------------------------------------------------------------------------------
# tune / profile: the engine's batch-1 decode graph
# ---------------------------------------------------------------------------------------------

# candidate values per (table, knob) of the "1" bucket
TUNE_SPACE = {
    "norm_mlp_decode": {"BLOCK_I": [1, 2, 4, 8], "BLOCK_H": [256, 512, 1024, 2048], "num_warps": [1, 2, 4]},
    "norm_mlp_down": {"BLOCK_N": [1, 2, 4], "BLOCK_K": [1024, 2048, 4096], "num_warps": [4, 8]},
    "gemv": {"BLOCK_N": [1, 2, 4], "BLOCK_K": [512, 1024, 2048], "num_warps": [1, 2, 4]},
    "qkv_decode": {"BLOCK_P": [1, 2, 4], "BLOCK_K": [512, 1024, 2048, 4096], "num_warps": [2, 4, 8]},
    "paged_attention_decode": {"BLOCK_N": [32, 64], "MAX_SPLITS": [4, 8, 16, 32], "num_warps": [2, 4]},
    # the INT4 forms' tables (an int4 engine's --source; K blocks in columns)
    "gemv_int4": {"BLOCK_N": [1, 2, 4, 8, 16], "BLOCK_K": [512, 1024, 2048, 4096], "num_warps": [1, 2, 4]},
    "norm_mlp_decode_int4": {"BLOCK_I": [1, 2, 4, 8], "BLOCK_H": [512, 1024, 2048, 4096, 8192], "num_warps": [1, 2, 4]},
    "norm_mlp_down_int4": {"BLOCK_N": [1, 2, 4, 8], "BLOCK_K": [1024, 2048, 4096, 8192], "num_warps": [2, 4, 8]},
    "qkv_decode_int4": {"BLOCK_P": [1, 2, 4], "BLOCK_K": [1024, 2048, 4096, 8192], "num_warps": [1, 2, 4, 8]},
}
BF16_TUNE_TABLES = [t for t in TUNE_SPACE if not t.endswith("_int4")]


def engine(source: str, **options) -> LLM:
    """``source`` (a model source, built into the engine cache on first use, or an engine
    directory) on the GPU in bf16, at the workloads' max_model_len."""
    return LLM(source, dtype="bfloat16", device="cuda", max_model_len=MAX_MODEL_LEN, **options)


def recapture_decode_graphs(runner) -> bool:
    """Capture the runner's decode graphs again, from scratch: a graph keeps the kernels and
    launch configs it was captured with."""
    runner.graphs = StepGraphs()
    runner.prepare_graphs(0)
    return runner.capture_all_graphs()


def tune(args) -> int:
    """Coordinate descent over the T = 1 bucket of each decode kernel's table, judged by the
    device time of the bucket-1 decode graph: programmatic dependent launch and the neighbouring
    kernels count, which a kernel timed alone misses. It starts from the general buckets (the
    tables' per-shape buckets set aside); a winner that is not the default for the other models
    belongs under the table's "shapes", keyed by this engine's weight shapes."""
    if not needs_cuda("tune"):
        return 2
    llm = engine(args.source, gpu_memory_utilization=0.5, max_graph_batch_size=1, prefill_graph_max_tokens=0)
    runner = llm.engine.runner

    def step_us(table) -> float:
        launch_configs.use_configs(table)
        if not recapture_decode_graphs(runner):
            return math.inf
        return graph_time_us(lambda: runner.graphs.run(1, 1), capture=False, replays=40, rounds=3)

    best = launch_configs.current()
    for table in args.tables:
        best[table].pop(launch_configs.SHAPES, None)
    best_us = step_us(best)
    print(f"start: {best_us:.1f} us per batch-1 decode step", flush=True)
    for r in range(args.rounds):
        best, best_us = descend_one_round(best, best_us, {t: TUNE_SPACE[t] for t in args.tables}, step_us, 0.995)
        print(f"round {r + 1}: {best_us:.1f} us ({1e6 / best_us:.0f} steps/s of graph time)", flush=True)
    launch_configs.use_configs(None)
    print(json.dumps({t: {"1": best[t]["1"]} for t in args.tables}, indent=1))
    return 0


def descend_one_round(best: dict, best_us: float, space: dict, measure: Callable, keep_below: float,
                      quiet: bool = False) -> tuple[dict, float]:
    """One round of coordinate descent over the T = 1 bucket of the tables in ``space`` (table ->
    knob -> values): each value of each knob tried on the best table so far, kept when
    ``measure(table)`` is under ``keep_below`` x the best; prints each trial (only the kept ones
    when ``quiet``)."""
    for table, knobs in space.items():
        for knob, values in knobs.items():
            for v in values:
                if best[table]["1"].get(knob) == v:
                    continue
                trial = copy.deepcopy(best)
                trial[table]["1"][knob] = v
                try:
                    us = measure(trial)
                except Exception as e:  # a config that does not compile or launch
                    print(f"  {table}.{knob}={v}: {failure(e)}", flush=True)
                    continue
                kept = us < best_us * keep_below
                if kept:
                    best, best_us = trial, us
                if kept or not quiet:
                    print(f"  {table}.{knob}={v}: {us:.1f} us{'  <- best' if kept else ''}", flush=True)
    return best, best_us


# ---------------------------------------------------------------------------------------------
# gemm-wq: the weight-only quantized GEMM's launch configs
# ---------------------------------------------------------------------------------------------

GEMM_WQ_MODELS = ("llama-3.1-8b", LLAMA, QWEN)
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages); int4 caps BLOCK_K at its group
GEMM_WQ_CANDIDATES = (
    (16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 4), (16, 128, 128, 1, 4, 3), (16, 64, 64, 1, 2, 4),
    (32, 64, 128, 1, 4, 4), (64, 64, 128, 1, 4, 4), (64, 128, 64, 4, 4, 4), (64, 128, 128, 4, 8, 3),
    (128, 128, 64, 8, 8, 3), (128, 128, 128, 8, 8, 3), (128, 256, 64, 8, 8, 3), (128, 64, 128, 8, 4, 4),
)


def gemm_wq_config(c: tuple) -> dict:
    return dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"), c))


def gemm_wq(args) -> int:
    """For each row count (a bucket of the table: the smallest holding it), every candidate config
    is timed on every shape of the models (q/k/v, o, gate/up, down, lm_head) with weights of the
    scheme; the config with the least summed time wins its bucket. Each row also shows cuBLAS on
    the bf16 weight (the unquantized engine's prefill), the other path of matmul_wq (the weight
    dequantized by triton_gemm_wq.dequantize, then cuBLAS) and the op's reference (dequantize in
    torch, then cuBLAS). The tool prints the winning table and the dispatch limit (the last row
    count of an unbroken run, from the first, where the GEMM beats dequantize + cuBLAS) as JSON."""
    from compiled_llm.graph.quantized_ops import linear_wq_ref, quantize

    if not needs_cuda("gemm-wq"):
        return 2
    gen = torch.Generator().manual_seed(0)
    shapes = [role_shape(m, r) for m in args.models for r in ROLES]
    weights = {}
    for sh in shapes:
        w = randn(gen, sh.N, sh.K, scale=sh.K ** -0.5).to("cuda", DTYPE)
        weights[sh.name] = (w, tuple(t.cuda() if t is not None else None for t in quantize(w, args.scheme)))
    totals: dict[int, dict[tuple, float]] = {}
    dequantized: dict[int, float] = {}
    print(f"{'shape':42} {'M':>5} {'cuBLAS bf16':>12} {'deq+cuBLAS':>11} {'reference':>10} {'best GEMM':>10}  config",
          flush=True)
    for M in args.tokens:
        totals[M] = {}
        for sh in shapes:
            w, q = weights[sh.name]
            x = randn(gen, M, sh.K).to("cuda", DTYPE)
            t_bf16 = graph_time_us(lambda: F.linear(x, w))
            t_deq = graph_time_us(lambda: F.linear(x, triton_gemm_wq.dequantize(*q, DTYPE)))
            dequantized[M] = dequantized.get(M, 0.0) + t_deq
            t_ref = graph_time_us(lambda: linear_wq_ref(x, *q)) if args.reference else float("nan")
            best = (float("inf"), None)
            for c in GEMM_WQ_CANDIDATES:
                use_config("gemm_wq", gemm_wq_config(c))
                try:
                    t = graph_time_us(lambda: triton_gemm_wq.gemm_wq(x, *q))
                except Exception as e:  # a config the GPU cannot run (shared memory): out of the race
                    print(f"  {c}: {failure(e)}")
                    t = float("inf")
                totals[M][c] = totals[M].get(c, 0.0) + t
                best = min(best, (t, c))
            launch_configs.use_configs(None)
            print(f"{sh.name:42} {M:>5} {t_bf16:>10.1f}µs {t_deq:>9.1f}µs {t_ref:>8.1f}µs {best[0]:>8.1f}µs  {best[1]}",
                  flush=True)
    table, wins = {}, []
    for M in sorted(totals):
        c, t = min(totals[M].items(), key=lambda kv: kv[1])
        table[str(M) if M != max(totals) else "inf"] = gemm_wq_config(c)
        wins.append((M, t, dequantized[M]))
        print(f"M = {M}: GEMM {t:.1f} µs summed with {c}, dequantize + cuBLAS {dequantized[M]:.1f} µs")
    print(json.dumps({"gemm_wq": table, "gemm_wq_dispatch": {"inf": {"MAX_TOKENS": decode_limit(wins)}}}, indent=1))
    return 0


# ---------------------------------------------------------------------------------------------
# int4-stream: how fast per-op int4 decode kernels can stream at all
# ---------------------------------------------------------------------------------------------

# the probe's (warps, stages, units a stage, blocks an SM) shapes (benchmarks/csrc/int4_stream.cu)
STREAM_SHAPES = ((16, 2, 2, 1), (16, 4, 2, 1), (8, 4, 2, 2))
STREAM_ROLES = ("gate_up", "down", "qkv", "o")  # a layer's weights, then the lm_head


def int4_stream_extension():
    """The probe, built in one translation unit after the engine's csrc/gemv_int4.cu (whose
    staging, decode and mma it reuses)."""
    from torch.utils.cpp_extension import load_inline

    from compiled_llm.kernels import cuda_build, cuda_gemv_int4

    probe = Path(__file__).parent / "csrc" / "int4_stream.cu"
    source = (cuda_build.CSRC / "gemv_int4.cu").read_text() + probe.read_text()
    declarations = cuda_gemv_int4.SOURCE.declarations + """
torch::Tensor cllm_int4_stream(torch::Tensor x, torch::Tensor codes, torch::Tensor scale_zero, int64_t N,
                               std::optional<torch::Tensor> residual, std::optional<torch::Tensor> norm_weight,
                               double eps, bool glu, int64_t warps, int64_t stages, int64_t units,
                               int64_t blocks_per_sm, bool arith, torch::Tensor counters);
int64_t cllm_int4_stream_shared_bytes(bool glu, int64_t warps, int64_t stages, int64_t units, int64_t T, int64_t K);
"""
    build_dir = cuda_build.cache_root() / "int4_stream_probe"
    build_dir.mkdir(parents=True, exist_ok=True)
    return load_inline(name="cllm_int4_stream_probe", cpp_sources=declarations, cuda_sources=source,
                       functions=["cllm_gemv_int4", "cllm_int4_stream", "cllm_int4_stream_shared_bytes"],
                       build_directory=str(build_dir), extra_cuda_cflags=["-O3"], verbose=False)


def tile_contiguous(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, glu: bool):
    """The probe's layout of an int4 weight: (codes, scale_zero), each (tile, group) unit contiguous."""
    rows, groups = scale.shape
    lead = (2, rows // 32) if glu else (rows // 16,)
    order = (1, 3, 0, 2, 4) if glu else (0, 2, 1, 3)
    codes = qweight.view(*lead, 16, groups, 64).permute(*order).contiguous().view(-1)
    scale_zero = torch.stack([scale, zero], -1).view(*lead, 16, groups, 2).permute(*order).contiguous().view(-1)
    return codes, scale_zero


def int4_stream(args) -> int:
    """Per model, the weights of a layer (norm + gate/up, down + residual, q/k/v, o + residual)
    and the lm_head at T rows: the cuda provider's int4 kernels (csrc/gemv_int4.cu, as the engine
    launches them: q/k/v with its RMSNorm and RoPE), and the probe of benchmarks/csrc/int4_stream.cu
    with and without its arithmetic (best of the STREAM_SHAPES whose shared memory fits: for GLU
    only the first). Weights are rotated past the L2. The sums are what one decode step spends on
    its weights in each; the loads-alone sum is the floor of kernels built this way (a kernel per
    op, each staging x), whatever their arithmetic costs."""
    from compiled_llm.graph.quantized_ops import quantize
    from compiled_llm.kernels import cuda_gemv_int4 as cg

    if not needs_cuda("int4-stream"):
        return 2
    ext = int4_stream_extension()
    limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    counters = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    gen, T = torch.Generator("cuda").manual_seed(0), args.tokens
    print(f"T = {T}; device-to-device copy {copy_gbs():.0f} GB/s (read + write)", flush=True)
    for model in args.models:
        c = model_config(model)
        sums = {"engine": 0.0, "probe": 0.0, "loads": 0.0}
        for role in STREAM_ROLES + ("lm_head",):
            sh = role_shape(model, role)
            glu = role == "gate_up"
            N = sh.N // 2 if glu else sh.N
            x, res = randn(gen, T, sh.K), randn(gen, T, N)
            nw = randn(gen, sh.K, scale=0.1, shift=1.0)
            copies = copies_for(sh.N * sh.K // 2)
            sets = [quantize(randn(gen, sh.N, sh.K, scale=sh.K ** -0.5), "int4") for _ in range(copies)]
            tiled = [tile_contiguous(*q, glu) for q in sets]
            nbytes = sets[0][0].numel() + 8 * sets[0][1].numel()
            r = res if role in ("o", "down") else None
            if role == "qkv":
                cos_sin = ops.rope_cos_sin(c.head_dim, MAX_MODEL_LEN, c.rope_theta).to("cuda")
                pos = torch.zeros(T, dtype=torch.int64, device="cuda")
                engine_call = lambda q, s, z: cg.fused_qkv_rope_wq(  # noqa: E731
                    x, q, s, z, None, None, None, pos, cos_sin, c.num_heads, c.num_kv_heads, c.head_dim, 1e-6, nw, 1e-6)
                plain = lambda q, s, z: cg.gemv_int4(x, q, s, z)  # noqa: E731  (the probe's rows: no norm, no RoPE)
            else:
                engine_call = plain = lambda q, s, z: cg.gemv_int4(  # noqa: E731
                    x, q, s, z, residual2=r, norm_weight=nw if glu else None, eps=1e-6, glu=glu)
            t_engine = graph_time_us(engine_call, sets)
            ref = plain(*sets[0])
            best = {True: (float("inf"), None), False: (float("inf"), None)}
            for warps, stages, units, per_sm in STREAM_SHAPES:
                if per_sm * ext.cllm_int4_stream_shared_bytes(glu, warps, stages, units, T, sh.K) > limit:
                    continue
                for arith in (True, False):
                    def call(codes, sz, arith=arith, cfg=(warps, stages, units, per_sm)):
                        return ext.cllm_int4_stream(x, codes, sz, N, r, nw if glu else None, 1e-6, glu, *cfg, arith,
                                                    counters)
                    if arith and rel_err(call(*tiled[0]), ref) > TOL:
                        print(f"  {sh.name} probe {(warps, stages, units, per_sm)}: WRONG, not timed")
                        continue
                    best[arith] = min(best[arith], (graph_time_us(call, tiled), (warps, stages, units, per_sm)))
            times = {"engine": t_engine, "probe": best[True][0], "loads": best[False][0]}
            per_step = 1 if role == "lm_head" else c.num_layers
            for k, t in times.items():
                sums[k] += per_step * t
            print(f"{sh.name:34} {nbytes / 1e6:7.1f} MB  " + "  ".join(
                f"{k} {t:6.1f} µs {nbytes / t / 1e3:5.0f} GB/s" for k, t in times.items())
                + f"  probe {best[True][1]}, loads {best[False][1]}", flush=True)
            del sets, tiled
        print(f"{model}: weights of one decode step ({c.num_layers} layers + lm_head): " + ", ".join(
            f"{k} {t:.0f} µs" for k, t in sums.items()), flush=True)
    return 0


def random_prompt(vocab_size: int, length: int = 128, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(min(vocab_size, 10_001)) for _ in range(length)]


def kernel_table(prof, top: int, per: int = 1) -> str:
    """Device time by kernel name (per step when ``per`` steps were profiled), largest first."""
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        t = e.self_cuda_time_total if t is None else t
        if t > 0 and e.device_type.name == "CUDA":
            rows.append((t / per, e.count // per, e.key[:110]))
    rows.sort(reverse=True)
    lines = [f"  device total {sum(r[0] for r in rows):.1f} us ({len(rows)} kernel names)"]
    return "\n".join(lines + [f"  {t:9.1f} us  x{n:<4d} {k}" for t, n, k in rows[:top]])


def profile_steps(args) -> int:
    """Where a step's time goes: the decode graphs' device time against the engine's step wall
    time (the difference is host work), PDL on and off, and device time per kernel of the
    decode loop and of a long prefill, with the prefill's host time by op and by function."""
    if not needs_cuda("profile"):
        return 2
    llm = engine(args.source, gpu_memory_utilization=0.6)
    runner, st, vocab = llm.engine.runner, llm.stats, llm.model.config.vocab_size
    greedy = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate({"prompt_token_ids": random_prompt(vocab)}, greedy, use_tqdm=False)

    steps, secs = st.decode_steps, st.decode_s
    llm.generate({"prompt_token_ids": random_prompt(vocab, seed=3)}, greedy, use_tqdm=False)
    wall = (st.decode_s - secs) / (st.decode_steps - steps)
    print(f"batch-1 decode: engine step wall {1e3 * wall:.3f} ms ({1 / wall:.0f} tok/s)")

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        steps, secs = st.decode_steps, st.decode_s
        llm.generate({"prompt_token_ids": random_prompt(vocab, seed=4)}, greedy, use_tqdm=False)
        torch.cuda.synchronize()
    steps = st.decode_steps - steps
    print(f"engine decode loop under the profiler: {steps} steps, wall {1e3 * (st.decode_s - secs) / steps:.3f} "
          f"ms/step; device time per step by kernel:\n{kernel_table(prof, args.top, per=steps)}")

    prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": random_prompt(vocab, args.prefill, seed=10 + i)} for i in range(4)]
    llm.generate(prompts[0], prefill, use_tqdm=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts[1], prefill, use_tqdm=False)
    torch.cuda.synchronize()
    print(f"prefill {args.prefill}: generate wall {1e3 * (time.perf_counter() - t0):.2f} ms")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        llm.generate(prompts[2], prefill, use_tqdm=False)
        torch.cuda.synchronize()
    print(f"prefill {args.prefill} kernels:\n{kernel_table(prof, args.top)}\nprefill host (cpu_time_total):")
    for e in sorted(prof.key_averages(), key=lambda e: e.cpu_time_total, reverse=True)[:12]:
        print(f"  {e.cpu_time_total / 1e3:8.2f} ms x{e.count:<5d} {e.key[:100]}")
    by_function = cProfile.Profile()
    by_function.enable()
    llm.generate(prompts[3], prefill, use_tqdm=False)
    torch.cuda.synchronize()
    by_function.disable()
    buf = io.StringIO()
    pstats.Stats(by_function, stream=buf).sort_stats("tottime").print_stats(30)
    print("prefill host by function (cProfile, tottime):\n" + "\n".join(buf.getvalue().splitlines()[:60]))

    # last: the graphs are captured again, with the runner's idle inputs (every row attends to one
    # token), for every bucket, and once more without programmatic dependent launch
    buckets = [b for b in (1, 2, 4, 8, 32, 64, 128, 256) if b in runner.graphs.buckets]
    times = {}
    for pdl in (True, False):
        triton_common.PDL_ENABLED = pdl
        recapture_decode_graphs(runner)
        times[pdl] = {b: graph_time_us(lambda b=b: runner.graphs.run(b, b), capture=False, replays=50, rounds=3)
                      for b in buckets}
    triton_common.PDL_ENABLED = True
    for b in buckets:
        print(f"  graph bucket {b:4d}: {times[True][b] / 1e3:.3f} ms device per replay with PDL, "
              f"{times[False][b] / 1e3:.3f} ms without ({times[False][b] / times[True][b]:.2f}x)")
    return 0


# ---------------------------------------------------------------------------------------------
# agree: fused kernels + CUDA graphs against the eager spec
# ---------------------------------------------------------------------------------------------


def read_prompts(path: Path, num_prompts: int) -> list[list[int]]:
    """The first ``num_prompts`` prompts of a JSON list of token-id lists, checked before the
    (slow) build, so a bad file fails at once."""
    prompts = json.loads(Path(path).read_text())
    if not isinstance(prompts, list) or len(prompts) < num_prompts:
        raise SystemExit(f"{path}: need a JSON list of at least {num_prompts} prompts")
    prompts = prompts[:num_prompts]
    for i, p in enumerate(prompts):
        if not (isinstance(p, list) and p and all(isinstance(t, int) and t >= 0 for t in p)):
            raise SystemExit(f"{path}: prompt {i} is not a non-empty list of token ids")
    return prompts


def agree(args) -> int:
    """The engine (fused kernels, decode CUDA graphs, one-sequence prefill graphs, async
    scheduling) generates greedily; its logits at every step are recorded from the sampler's
    input. The reference is the unfused spec with the reference ops on the source's weights, fed
    the engine's tokens (teacher forcing), so every step compares logits for the same context.
    Verdict as in ``compiled-llm compare``: bf16 needs >= 99% greedy agreement and every flip
    inside the other side's top 5."""
    file_prompts = read_prompts(args.prompts_file, args.prompts) if args.prompts_file is not None else None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    llm = LLM(args.source, dtype=args.dtype, device=device, max_model_len=args.max_model_len,
              gpu_memory_utilization=0.5)
    runner = llm.engine.runner
    recorded: dict[tuple[str, int], torch.Tensor] = {}
    original_sample = runner._sample

    def recording_sample(batch, logits, step_rows, ahead=0):
        for j, row in enumerate(batch.sample_rows):
            seq = batch.seqs[row]
            # output index of the token this row samples: one past the sequence's tokens, two
            # past when the step was queued before the previous step's token was appended
            index = seq.num_tokens - seq.num_prompt_tokens + ahead
            recorded[(seq.request_id, index)] = logits[j].float().cpu()
        return original_sample(batch, logits, step_rows, ahead)

    runner._sample = recording_sample
    vocab = llm.model.config.vocab_size
    prompts = file_prompts or cmp.random_prompts(vocab, args.prompts, args.seed)
    if max(max(p) for p in prompts) >= vocab:
        raise SystemExit(f"{args.prompts_file}: token ids must be below the model's vocab size {vocab}")
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    st = llm.stats
    print(f"engine: {st.graphs_captured} graphs, {st.decode_steps} decode steps ({st.ahead_steps} queued ahead), "
          f"{st.prefill_steps} prefill steps")
    tokens = torch.tensor([o.token_ids for o in outs])  # [N, K]
    logits = torch.stack([torch.stack([recorded[(o.request_id, k)] for o in outs]) for k in range(args.tokens)])

    manifest, config, dtype = llm.model.manifest, llm.model.config, llm.model.dtype
    del llm, runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dtype_name = str(dtype).removeprefix("torch.")

    def spec_logits(spec_dtype):
        weights = load_source_params(cmp.source_of(manifest), spec_dtype, device)
        return cmp.run_steps(cmp.spec_step(config, weights), config, prompts, args.tokens, device, spec_dtype,
                             forced=tokens)[0]

    ref, ref32 = spec_logits(dtype), spec_logits(torch.float32)
    v = cmp.judge(logits, tokens, ref, prompts, dtype)
    # the dtype's noise floor on this model: the same eager spec in float32, fed the same tokens;
    # how often does each side pick what float32 picks?
    pick32 = ref32.argmax(-1)
    top2 = ref32.topk(2, dim=-1).values
    print(f"against the float32 eager spec on the same tokens: engine "
          f"{(logits.argmax(-1) == pick32).float().mean().item():.2%}, eager {dtype_name} "
          f"{(ref.argmax(-1) == pick32).float().mean().item():.2%} (median top-1/top-2 logit gap "
          f"{(top2[..., 0] - top2[..., 1]).median().item():.3f}; max|logit| {ref32.abs().max().item():.2f})")
    print(f"fused kernels + graphs vs eager spec ({len(prompts)} prompts x {args.tokens} tokens, {dtype_name}): "
          f"greedy agreement {v.agreement:.2%} ({v.agree}/{v.steps}), flips outside top {cmp.TOP_K}: "
          f"{v.flips_outside_top_k}, max|dlogit| {v.max_abs_delta:.3f} (max|logit| {v.max_abs_logit:.2f}) -> "
          f"{'PASS' if v.ok else 'FAIL'} [{v.rule}]")
    return 0 if v.ok else 1


# ---------------------------------------------------------------------------------------------
# moe: the fused mixture-of-experts kernels at real shapes
# ---------------------------------------------------------------------------------------------

MOE_SHAPES = {  # name -> (experts, top_k, hidden, expert intermediate), from the published configs
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}


MOE_SWEEP = {
    "fused_moe_route": {"BLOCK_R": [1, 2, 4, 8], "BLOCK_H": [256, 512, 1024, 2048], "num_warps": [1, 2, 4, 8]},
    "fused_moe_decode": {"BLOCK_I": [1, 2, 4, 8, 16], "BLOCK_H": [256, 512, 1024, 2048], "num_warps": [1, 2, 4, 8]},
    "fused_moe_down": {"BLOCK_N": [1, 2, 4, 8, 16, 32], "BLOCK_K": [256, 512, 1024, 2048], "num_warps": [1, 2, 4, 8]},
}


def moe_layer_op(top_k: int, norm_weight):
    """The mixture as a built engine runs it: the layer's norm folded in and x its own residual
    (``fused_moe(h, ..., norm, eps, residual=h)``)."""
    from compiled_llm.kernels.triton_fused_moe import fused_moe

    return lambda x, r, gu, d: fused_moe(x, r, gu, d, top_k, True, norm_weight, 1e-6, x)


def moe_sweep(name: str, layers: list, top_k: int, gen, rounds: int = 2) -> None:
    """Coordinate descent over the T = 1 bucket of the decode form's tables (one layer's device
    µs, the weights rotated past the L2), from the general bucket; prints each step, the winner
    as JSON (for the table's "1" bucket, or its "shapes" when it is one model's), and the time of
    the routing alone (the norm, the router and the top-k in one launch) beside the whole op."""
    from compiled_llm.kernels.triton_fused_moe import _route_decode

    H = layers[0][0].shape[1]
    x = torch.randn(1, H, generator=gen, device="cuda", dtype=DTYPE)
    norm_weight = torch.rand(H, generator=gen, device="cuda").to(DTYPE) + 0.5
    sets = [(x, *w) for w in layers]
    layer_op = moe_layer_op(top_k, norm_weight)

    def op_us(table) -> float:
        launch_configs.use_configs(table)
        return graph_time_us(layer_op, sets)

    best = launch_configs.current()
    for table in MOE_SWEEP:  # from the general T = 1 bucket, the per-shape ones set aside
        best[table] = {**best[table], "1": launch_configs.get(table, 1)}
        best[table].pop(launch_configs.SHAPES, None)
    best_us = op_us(best)
    print(f"{name} sweep at T=1: start {best_us:.1f} us; routing alone "
          f"{graph_time_us(lambda x, r, gu, d: _route_decode(x, norm_weight, 1e-6, r, top_k, True, True), sets):.1f} us",
          flush=True)
    for _ in range(rounds):
        best, best_us = descend_one_round(best, best_us, MOE_SWEEP, op_us, 0.99, quiet=True)
    launch_configs.use_configs(None)
    print(f"{name} best {best_us:.1f} us: " + json.dumps({t: {"1": best[t]["1"]} for t in MOE_SWEEP}), flush=True)


def moe(args) -> int:
    """cllm::fused_moe's Triton kernels on one layer's weights (several copies, rotated past the
    L2) at each token count: device µs; at decode sizes the bandwidth of the bytes the chosen
    experts hold (each distinct chosen expert's gate, up and down once, plus the router) against
    the copy bandwidth; at prefill sizes TFLOP/s (2 * T * top_k * 3 * H * I) against the bf16
    matmul rate; and the error against the op's reference (fused_ops.fused_moe_ref). The op runs
    as a built engine runs it (``moe_layer_op``: the norm and the residual add folded in)."""
    from compiled_llm.graph.fused_ops import fused_moe_ref

    if not needs_cuda("moe"):
        return 2
    copy, peak = copy_gbs(), matmul_tflops()
    print(f"copy {copy:.0f} GB/s, bf16 matmul {peak:.0f} TFLOP/s", flush=True)
    gen = torch.Generator("cuda").manual_seed(0)
    for name in args.models:
        E, k, H, I = MOE_SHAPES[name]
        layer_bytes = (E * 3 * H * I + E * H) * 2
        copies = max(1, min(8, int(2.5e9 // layer_bytes)))  # several layers when they fit, past the L2
        layers = [(torch.randn(E, H, generator=gen, device="cuda", dtype=DTYPE) * H ** -0.5,
                   torch.randn(E, 2 * I, H, generator=gen, device="cuda", dtype=DTYPE) * H ** -0.5,
                   torch.randn(E, H, I, generator=gen, device="cuda", dtype=DTYPE) * I ** -0.5) for _ in range(copies)]
        if args.sweep:
            moe_sweep(name, layers, k, gen)
        norm_weight = torch.rand(H, generator=gen, device="cuda").to(DTYPE) + 0.5
        layer_op = moe_layer_op(k, norm_weight)
        for T in args.tokens:
            x = torch.randn(T, H, generator=gen, device="cuda", dtype=DTYPE)
            sets = [(x, *w) for w in layers]
            us = graph_time_us(layer_op, sets)
            normed = ops.rms_norm_ref(x, norm_weight, 1e-6)
            ids = torch.topk(torch.softmax((normed @ layers[0][0].t()).float(), -1), k).indices
            chosen = ids.unique().numel()
            line = f"{name:14} T={T:5d}: {us:9.1f} us"
            if T * k <= 64:
                read = chosen * 3 * H * I * 2 + E * H * 2
                line += f"  {chosen:3d} experts read, {read / us / 1e3:6.0f} GB/s ({read / us / 1e3 / copy:.0%} of copy)"
            else:
                flops = 2 * T * k * 3 * H * I
                line += f"  {flops / us / 1e6:6.1f} TFLOP/s ({flops / us / 1e6 / peak:.0%} of matmul)"
            if T <= 512:
                ref = fused_moe_ref(x, *layers[0], k, True, norm_weight, 1e-6, x)
                got = layer_op(x, *layers[0])
                line += f"  err {rel_err(got, ref):.1e}"
            print(line, flush=True)
        del layers
        torch.cuda.empty_cache()
    return 0


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kernel_bench.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, fn, text):
        p = sub.add_parser(name, help=text, description=f"{text}. {fn.__doc__ or ''}".strip())
        p.set_defaults(run=fn)
        return p

    p = command("micro", micro, "every fused op at real shapes against eager torch, Inductor and the CUDA C++ "
                "provider: device µs, GB/s against the copy bandwidth, TFLOP/s, error against eager; first the "
                "two ceilings (copy bandwidth, bf16 matmul rate)")
    p.add_argument("--cases", default="", help="run only cases whose name contains this text")
    p.add_argument("--list", action="store_true", help="list the cases and their implementations (no GPU)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile (Inductor) baseline")
    p.add_argument("--no-cuda-ext", action="store_true", help="skip the CUDA C++ provider (no JIT build)")
    p.add_argument("--input-sets", type=int, default=3, help="random input sets each timed graph rotates over")

    p = command("attention", attention, "paged attention: decode at runtime-shaped batches over several layer "
                "caches, and the prefill kernel's configs against SDPA")
    p.add_argument("--cases", nargs="+", choices=["decode", "decode-sweep", "prefill"], default=["decode", "prefill"],
                   help="decode-sweep: the large-batch decode configs at Llama-3.1-8B's heads (TP=1 and a TP=2 rank)")
    p.add_argument("--layers", type=int, default=8, help="decode: calls (layer caches) per timed graph")
    p.add_argument("--reps", type=int, default=20, help="graph replays per timing")
    p.add_argument("--no-sweep", action="store_true", help="prefill: the default config only")
    p.add_argument("--prefill-tokens", type=int, default=1024)

    p = command("sweep", sweep, "launch configs of the weight-streaming GEMV kernels and the token counts up to "
                "which they beat cuBLAS, printed as a launch_configs.py snippet")
    p.add_argument("--models", nargs="+", default=list(SWEEP_MODELS), choices=list(SWEEP_MODELS))
    p.add_argument("--roles", nargs="+", default=list(ROLES), choices=list(ROLES))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--stages", nargs="+", type=int, default=[1])
    p.add_argument("--budget-s", type=float, default=160.0,
                   help="wall-clock budget: precompiling stops at half of it, the sweep 20 s before its end "
                        "(the decode-vs-prefill timing gets those), and what ran is reported")
    p.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                   help="processes that precompile the kernels (1: compile while timing)")
    p.add_argument("--no-dispatch", action="store_true", help="skip the decode-vs-prefill form timing")
    p.add_argument("--json-out", type=Path, help="also write the snippet here")
    p.add_argument("--dry-run", action="store_true", help="print the candidate grid and exit (no GPU)")

    p = command("tune", tune, "the T = 1 launch configs of the decode kernels, tuned on the whole batch-1 "
                "decode graph; prints the winning table as JSON")
    p.add_argument("--source", default=QWEN, help=f"model source or engine directory (default {QWEN})")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--tables", nargs="+", choices=list(TUNE_SPACE), default=BF16_TUNE_TABLES,
                   help="tune only these tables (default: the bf16 kernels'; the *_int4 tables need an int4 engine)")

    p = command("gemm-wq", gemm_wq, "launch configs of the weight-only quantized GEMM (triton_gemm_wq) at prefill "
                "sizes, against cuBLAS on bf16 weights and the op's dequantizing reference")
    p.add_argument("--models", nargs="+", default=list(GEMM_WQ_MODELS))
    p.add_argument("--scheme", choices=["int8", "int4"], default="int4")
    p.add_argument("--tokens", nargs="+", type=int, default=[16, 64, 256, 1024],
                   help="row counts; each is a bucket of the printed table, the largest 'inf'")
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip timing the dequantizing reference")

    p = command("int4-stream", int4_stream, "the int4 decode GEMV kernels against a probe that streams the same "
                "weights with TMA bulk copies, with and without its arithmetic")
    p.add_argument("--models", nargs="+", default=[QWEN, LLAMA, "llama-3.1-8b"])
    p.add_argument("--tokens", type=int, default=1, choices=range(1, 5), metavar="{1..4}",
                   help="rows of x (both kernels stage x in shared memory: K = 14336 fits 4 rows)")

    p = command("profile", profile_steps, "where a step's time goes on the GPU")
    p.add_argument("--source", default=QWEN, help=f"model source or engine directory (default {QWEN})")
    p.add_argument("--top", type=int, default=25, help="kernels per table")
    p.add_argument("--prefill", type=int, default=1024, help="prompt length of the profiled prefill")

    p = command("moe", moe, "the fused mixture-of-experts kernels at real shapes: decode GB/s, prefill TFLOP/s")
    p.add_argument("--models", nargs="+", default=list(MOE_SHAPES), choices=list(MOE_SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 64, 512, 2048, 8192])
    p.add_argument("--sweep", action="store_true", help="first tune the decode form's tables at one token")

    p = command("agree", agree, "greedy agreement of the engine's fused kernels + CUDA graphs with the eager spec")
    p.add_argument("--source", default=QWEN, help=f"model source or engine directory (default {QWEN})")
    p.add_argument("--dtype", default="bfloat16", help="the engine's dtype (default bfloat16)")
    p.add_argument("--prompts", type=int, default=16, help="how many prompts (the first N of --prompts-file)")
    p.add_argument("--prompts-file", type=Path, default=None,
                   help="a JSON list of token-id lists to use as prompts (train_synthetic_lm.py writes prompts.json)")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--max-model-len", type=int, default=1024)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
