"""Sweep the launch configs of the weight-streaming GEMV kernels on a GPU and print the best ones
as a launch_configs.py snippet.

For every (shape, T) it times each candidate config of the kernel that serves the shape:
  qkv      fused_qkv_rope decode kernel (input RMSNorm + projection + RoPE)   table "qkv_decode"
  o        triton_gemv.gemv + residual                                         table "gemv"
  gate_up  norm_mlp decode activation kernel (RMSNorm + gate/up + silu * up)   table "norm_mlp_decode"
  down     triton_gemv.gemv + residual (tall K)                                table "norm_mlp_down"
  lm_head  triton_gemv.gemv, plain (reported only: no call site uses it yet)
and cuBLAS F.linear on the same weight for scale. Times are CUDA-graph replays of many calls that
rotate over enough copies of the weights (>= 4, and >= 2x the L2 size in all) that every call
streams its weight from HBM, as each layer of a real decode step does; cuda events; µs per call
and GB/s of weight bytes (also as a share of the device-to-device copy bandwidth measured first).
Each candidate's output is checked against the reference (rel err <= 1e-2 in bf16); one that
fails to compile or run is skipped, one that is wrong is reported and never chosen.

Then, with the best configs installed, it times each op's decode form against its cuBLAS
(prefill) form per T and suggests the dispatch limits (MAX_TOKENS / MAX_DECODE_TOKENS).

    python benchmarks/sweep_gemv.py                  # everything, < 3 min on an H200
    python benchmarks/sweep_gemv.py --models qwen2.5-0.5b --roles down --tokens 1 4
    python benchmarks/sweep_gemv.py --dry-run        # the candidate grid, no GPU needed

num_stages is 1 throughout by default: these loops have no tl.dot for Triton to pipeline, and on
Triton 3.9 the PTX for sm_90 is identical for num_stages 1..4; ``--stages 1 3`` sweeps it anyway.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compiled_llm.kernels.triton_gemv import tile_config  # noqa: E402

MODELS = {
    "qwen2.5-0.5b": dict(H=896, I=4864, Hq=14, Hkv=2, D=64, qkv_bias=True),
    "llama-3.2-1b": dict(H=2048, I=8192, Hq=32, Hkv=8, D=64, qkv_bias=False),
}
LM_HEAD = dict(V=151936, H=896)  # Qwen2.5's tied embedding
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
ITEMSIZE = 2  # bf16
TOL = 1e-2


@dataclass(frozen=True)
class Shape:
    model: str
    role: str
    N: int  # weight rows
    K: int  # weight columns (reduction)
    cfg: tuple = ()  # model dims as sorted items

    @property
    def name(self) -> str:
        return f"{self.model}/{self.role} {self.N}x{self.K}"

    @property
    def table(self) -> str:
        return TABLE_OF_ROLE[self.role]

    @property
    def dims(self) -> dict:
        return dict(self.cfg)

    @property
    def weight_bytes(self) -> int:
        return self.N * self.K * ITEMSIZE

    def tile_rows(self) -> int:
        """The extent tile_config caps the table's rows block at."""
        if self.role == "gate_up":
            return self.N // 2
        if self.role == "qkv":
            return self.dims["D"] // 2
        return self.N


def all_shapes(models, roles) -> list[Shape]:
    shapes = []
    for model in models:
        d = MODELS[model]
        H, I, D = d["H"], d["I"], d["D"]
        dims = tuple(sorted(d.items()))
        for role, (n, k) in (("qkv", ((d["Hq"] + 2 * d["Hkv"]) * D, H)), ("o", (H, H)),
                             ("gate_up", (2 * I, H)), ("down", (H, I))):
            if role in roles:
                shapes.append(Shape(model, role, n, k, dims))
    if "lm_head" in roles:
        qwen = tuple(sorted(MODELS["qwen2.5-0.5b"].items()))
        shapes.append(Shape("qwen2.5-0.5b", "lm_head", LM_HEAD["V"], LM_HEAD["H"], qwen))
    return shapes


# ---------------------------------------------------------------------------------------------
# candidate configs
# ---------------------------------------------------------------------------------------------


def raw_candidates(table: str, T: int, stages) -> list[dict]:
    """The table entries to try for T tokens (BLOCK_T = T: one pass over the weights)."""
    g = GRIDS[table]
    out = []
    for rows in g["rows"]:
        for k, warps in g["k_warps"]:
            for st in stages:
                out.append({"BLOCK_T": T, g["rows_key"]: rows, g["k_key"]: k, "num_warps": warps, "num_stages": st})
    return out


def effective(shape: Shape, raw: dict, T: int) -> tuple:
    """What a launch with ``raw`` actually runs for ``shape`` (the wrappers cap blocks at the
    problem and lay warps along K): raw configs that agree here are measured once."""
    g = GRIDS[shape.table]
    tile = tile_config(raw, T, shape.tile_rows(), shape.K, ITEMSIZE, rows_key=g["rows_key"], k_key=g["k_key"])
    return tile["BLOCK_T"], tile["BLOCK_ROWS"], tile["BLOCK_K"], tile["num_warps"], tile["num_stages"]


def acc_regs(shape: Shape, eff: tuple) -> float:
    bt, rows, bk, warps, _ = eff
    return TILES_PER_PROGRAM[shape.table] * bt * rows * bk / (32 * warps)


def plan(shapes, tokens, stages):
    """{(shape, T): {effective key: [raw configs]}} with register-hungry candidates pruned."""
    out = {}
    for shape in shapes:
        for T in tokens:
            groups: dict[tuple, list[dict]] = {}
            for raw in raw_candidates(shape.table, T, stages):
                eff = effective(shape, raw, T)
                if acc_regs(shape, eff) <= MAX_ACC_REGS:
                    groups.setdefault(eff, []).append(raw)
            out[(shape, T)] = groups
    return out


def kernel_variant(shape: Shape) -> str:
    """Shapes whose launches compile the same kernels for the same effective config."""
    if shape.role in ("o", "down"):
        return "gemv+residual"
    return f"qkv/{shape.model}" if shape.role == "qkv" else shape.role  # head counts are constexprs


def compile_jobs(planned) -> dict:
    """One (shape, T, raw config) per distinct kernel compilation the sweep triggers."""
    jobs = {}
    for (shape, T), groups in planned.items():
        for eff, raws in groups.items():
            jobs.setdefault((kernel_variant(shape), *eff), (shape, T, raws[0]))
    return jobs


# ---------------------------------------------------------------------------------------------
# timing (CUDA only)
# ---------------------------------------------------------------------------------------------


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def graph_time_us(fn: Callable, arg_sets: list, calls: int, replays: int = 5) -> float:
    """µs per call of ``fn(*args)`` over ``calls`` calls rotating through ``arg_sets``, replayed
    from one CUDA graph (launch overhead as in the engine's decode graphs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture (allocator, lazy init)
        for args in arg_sets[:2]:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*arg_sets[i % len(arg_sets)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    elapsed_ms = start.elapsed_time(end)
    del graph
    return elapsed_ms * 1e3 / (replays * calls)


def copy_bandwidth_gbs() -> float:
    n = 512 * 2**20
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = graph_time_us(lambda: dst.copy_(src), [()], calls=4)
    return 2 * n / (us * 1e-6) / 1e9


@dataclass
class Op:
    """One shape's kernel call under test: arg sets (one per weight copy), the call, its
    reference, the cuBLAS baseline, and the decode-vs-prefill forms for the dispatch phase."""
    arg_sets: list
    call: Callable
    reference: Callable
    cublas: Callable
    forms: dict = field(default_factory=dict)  # "decode"/"prefill" -> fn(*args)
    ref: object = None  # the reference output of arg_sets[0], once computed


def make_op(shape: Shape, T: int, copies: int, dev: str = "cuda", dt: torch.dtype = torch.bfloat16) -> Op:
    from compiled_llm.graph import fused_ops, ops
    from compiled_llm.kernels import triton_gemv, triton_norm_mlp, triton_qkv_rope

    d = shape.dims
    gen = torch.Generator(device=dev).manual_seed(T)

    def rnd(*s, scale=1.0, shift=0.0):
        return (torch.randn(s, generator=gen, device=dev, dtype=torch.float32) * scale + shift).to(dt)

    H = shape.K
    weights = [rnd(shape.N, shape.K, scale=shape.K ** -0.5) for _ in range(copies)]
    if shape.role == "qkv":
        cos_sin = ops.rope_cos_sin(d["D"], 4096, 1e6).to(dev)
        pos = torch.randint(0, 4096, (T,), generator=gen, device=dev)
        sets = [(rnd(T, H), w, rnd(shape.N, scale=0.5) if d["qkv_bias"] else None, rnd(H, scale=0.1, shift=1.0))
                for w in weights]

        def qkv(form):
            return lambda x, w, b, nw: triton_qkv_rope.fused_qkv_rope(
                x, w, b, None, None, pos, cos_sin, d["Hq"], d["Hkv"], d["D"], 1e-6, norm_weight=nw, norm_eps=1e-6,
                form=form)

        return Op(sets, qkv("decode"),
                  lambda x, w, b, nw: fused_ops.fused_qkv_rope_ref(x, w, b, None, None, pos, cos_sin, d["Hq"], d["Hkv"],
                                                                   d["D"], 1e-6, nw, 1e-6),
                  lambda x, w, b, nw: F.linear(x, w, b), {"decode": qkv("decode"), "prefill": qkv("prefill")})
    if shape.role == "gate_up":
        sets = [(rnd(T, H), rnd(H, scale=0.1, shift=1.0), w) for w in weights]

        def act_ref(x, nw, w):
            gate, up = F.linear(ops.rms_norm_ref(x, nw, 1e-6), w).chunk(2, -1)
            return F.silu(gate) * up

        return Op(sets, lambda x, nw, w: triton_norm_mlp.decode_activation(x, nw, None, 1e-6, w, None, True, True),
                  act_ref, lambda x, nw, w: F.linear(x, w))
    if shape.role in ("o", "down"):
        table = shape.table
        sets = [(rnd(T, shape.K), w, rnd(T, shape.N)) for w in weights]
        return Op(sets, lambda x, w, r: triton_gemv.gemv(x, w, None, r, config=table),
                  lambda x, w, r: r + F.linear(x, w), lambda x, w, r: F.linear(x, w),
                  {"decode": lambda x, w, r: triton_gemv.gemv(x, w, None, r, config=table),
                   "prefill": lambda x, w, r: triton_gemv.dense_linear(x, w, None, r)})
    sets = [(rnd(T, shape.K), w) for w in weights]  # lm_head
    return Op(sets, lambda x, w: triton_gemv.gemv(x, w), lambda x, w: F.linear(x, w), lambda x, w: F.linear(x, w))


def mlp_forms(dims: dict, T: int, copies: int, dev: str = "cuda", dt: torch.dtype = torch.bfloat16) -> Op:
    """The whole norm + MLP op (with residual) for the MLP dispatch decision."""
    from compiled_llm.graph import fused_ops
    from compiled_llm.kernels import triton_norm_mlp

    H, I = dims["H"], dims["I"]
    gen = torch.Generator(device=dev).manual_seed(100 + T)

    def rnd(*s, scale=1.0, shift=0.0):
        return (torch.randn(s, generator=gen, device=dev) * scale + shift).to(dt)

    sets = [(rnd(T, H), rnd(H, scale=0.1, shift=1.0), 1e-6, rnd(2 * I, H, scale=H ** -0.5), rnd(H, I, scale=I ** -0.5),
             rnd(T, H)) for _ in range(copies)]

    def form(f):
        return lambda x, nw, eps, gu, dn, r: triton_norm_mlp.fused_rms_norm_glu_mlp(
            x, nw, eps, gu, dn, residual=r, form=f)

    return Op(sets, form("decode"), lambda *a: fused_ops.fused_rms_norm_glu_mlp_ref(*a[:5], residual=a[5]),
              lambda *a: None, {"decode": form("decode"), "prefill": form("prefill")})


def copies_for(weight_bytes: int) -> int:
    """Weight copies to rotate through: at least MIN_COPIES and 2x the L2 in all."""
    return max(MIN_COPIES, math.ceil(2 * L2_BYTES / weight_bytes))


def check(op: Op, fn: Callable) -> float:
    args = op.arg_sets[0]
    if op.ref is None:
        op.ref = op.reference(*args)
    out, ref = fn(*args), op.ref
    if isinstance(out, tuple):
        return max(rel_err(o, r) for o, r in zip(out, ref))
    return rel_err(out, ref)


# ---------------------------------------------------------------------------------------------
# parallel precompilation
# ---------------------------------------------------------------------------------------------


def _compile_worker(jobs: list, wall_deadline: float) -> int:
    """Run each job once (compiling its kernel into Triton's on-disk cache, which is safe to
    share between processes); returns how many could not run. Runs in a spawned process."""
    from compiled_llm.kernels import launch_configs

    failed, current, op = 0, None, None
    for shape, T, raw in jobs:  # sorted by (shape, T): one op at a time in memory
        if time.time() > wall_deadline:
            break
        try:
            if current != (shape, T):
                op, current = None, (shape, T)
                op = make_op(shape, T, copies=1)
            launch_configs.use_configs({shape.table: {"inf": raw}})
            op.call(*op.arg_sets[0])
        except Exception:
            failed += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return failed


def precompile(jobs: dict, workers: int, wall_deadline: float, log) -> None:
    """Compile every kernel the sweep needs in ``workers`` processes at once: compilation, not
    timing, dominates a sweep of ~200 configs, and the timing process then loads cached kernels."""
    if workers <= 1 or not jobs:
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    items = sorted(jobs.values(), key=lambda j: (j[0].name, j[1]))
    chunks = [items[i::workers] for i in range(workers)]
    t0 = time.monotonic()
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        failed = sum(pool.map(_compile_worker, chunks, [wall_deadline] * workers))
    log(f"precompiled {len(items)} kernels in {workers} processes in {time.monotonic() - t0:.0f} s"
        f" ({failed} could not run; the sweep reports them)")


# ---------------------------------------------------------------------------------------------
# the sweep
# ---------------------------------------------------------------------------------------------


@dataclass
class Result:
    us: dict = field(default_factory=dict)  # effective key -> µs
    raws: dict = field(default_factory=dict)  # effective key -> raw configs
    wrong: dict = field(default_factory=dict)  # effective key -> rel err
    failed: dict = field(default_factory=dict)  # effective key -> error line
    cublas_us: float = float("nan")


def sweep(planned, deadline: float, log) -> dict:
    from compiled_llm.kernels import launch_configs

    results: dict = {}
    by_shape: dict = {}
    for (shape, T), groups in planned.items():
        by_shape.setdefault(shape, []).append((T, groups))
    for shape, per_t in by_shape.items():
        copies = copies_for(shape.weight_bytes)
        calls = max(MIN_CALLS, copies)
        for T, groups in per_t:
            res = results[(shape, T)] = Result(raws=groups)
            if time.monotonic() > deadline:
                log(f"  {shape.name} T={T}: skipped (time budget spent)")
                continue
            op = make_op(shape, T, copies)
            res.cublas_us = graph_time_us(op.cublas, op.arg_sets, calls)
            for eff, raws in groups.items():
                if time.monotonic() > deadline:
                    break
                launch_configs.use_configs({shape.table: {"inf": raws[0]}})
                try:
                    err = check(op, op.call)
                    if not err <= TOL:
                        res.wrong[eff] = err
                        continue
                    res.us[eff] = graph_time_us(op.call, op.arg_sets, calls)
                except Exception as e:  # a config that does not compile or launch is skipped
                    res.failed[eff] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                    torch.cuda.synchronize()
            launch_configs.use_configs(None)
            best = min(res.us.items(), key=lambda kv: kv[1]) if res.us else None
            tail = f"best {best[1]:7.2f} µs {fmt_eff(shape, best[0])}" if best else "no valid config"
            log(f"  {shape.name:34s} T={T}: {len(res.us)}/{len(groups)} ok, cuBLAS {res.cublas_us:7.2f} µs, {tail}")
            del op
            torch.cuda.empty_cache()
    return results


def fmt_eff(shape: Shape, eff: tuple) -> str:
    g = GRIDS[shape.table]
    bt, rows, bk, warps, st = eff
    return f"BLOCK_T={bt} {g['rows_key']}={rows} {g['k_key']}={bk} warps={warps} stages={st}"


def choose_tables(results, tokens) -> dict:
    """Per table and T, the raw config minimising the sum over the table's shapes of time / best
    time of that shape (so a large shape does not drown a small one); lm_head is left out."""
    tables: dict = {}
    for T in tokens:
        per_table: dict = {}
        for (shape, t), res in results.items():
            if t != T or shape.role == "lm_head" or not res.us:
                continue
            per_table.setdefault(shape.table, []).append((shape, res))
        for table, entries in per_table.items():
            scores: dict = {}
            for shape, res in entries:
                best = min(res.us.values())
                for eff, us in res.us.items():
                    for raw in res.raws[eff]:
                        key = json.dumps(raw, sort_keys=True)
                        scores.setdefault(key, []).append(us / best)
            complete = {k: sum(v) for k, v in scores.items() if len(v) == len(entries)}
            if complete:
                # ties (raw configs that run identically) go to the smallest blocks
                best_key = min(complete, key=lambda k: (round(complete[k], 4), sorted(json.loads(k).values())))
                tables.setdefault(table, {})[str(T)] = json.loads(best_key)
    for table, buckets in tables.items():
        largest = max(buckets, key=int)
        buckets["inf"] = dict(buckets[largest])
    return tables


def dispatch_limits(shapes, tokens, deadline, log) -> dict:
    """With the chosen tables installed: the largest T up to which each op's decode form beats its
    prefill form for every model swept (summed over them), and for every smaller T too."""
    ops_by_name: dict = {"gemv_dispatch": [], "qkv_dispatch": [], "norm_mlp_dispatch": []}
    models = sorted({s.model for s in shapes if s.role != "lm_head"})
    for T in tokens:
        if time.monotonic() > deadline:
            log("  dispatch: time budget spent")
            break
        sums = {name: [0.0, 0.0] for name in ops_by_name}
        for model in models:
            o, qkv = find(shapes, model, "o"), find(shapes, model, "qkv")
            for name, make in (("gemv_dispatch", lambda: make_op(o, T, copies_for(o.weight_bytes))),
                               ("qkv_dispatch", lambda: make_op(qkv, T, copies_for(qkv.weight_bytes))),
                               ("norm_mlp_dispatch", lambda: mlp_forms(MODELS[model], T, MIN_COPIES))):
                try:
                    op = make()
                    for i, form in enumerate(("decode", "prefill")):
                        sums[name][i] += graph_time_us(op.forms[form], op.arg_sets, MIN_CALLS)
                except Exception as e:
                    log(f"  dispatch {name} {model} T={T}: {type(e).__name__}: {e}")
                    sums[name] = [math.inf, 0.0]
        for name, (dec, pre) in sums.items():
            ops_by_name[name].append((T, dec, pre))
            log(f"  {name:18s} T={T}: decode form {dec:8.2f} µs, prefill form {pre:8.2f} µs (sum over models)")
    limits = {}
    for name, rows in ops_by_name.items():
        key = "MAX_DECODE_TOKENS" if name == "norm_mlp_dispatch" else "MAX_TOKENS"
        if rows:
            limits[name] = {"inf": {key: decode_limit(rows)}}
    return limits


def decode_limit(rows) -> int:
    """Largest T of (T, decode µs, prefill µs) rows such that the decode form wins there and at
    every smaller T swept (at least 1: one token always streams the weights)."""
    limit = 1
    for T, dec, pre in sorted(rows):
        if dec >= pre:
            break
        limit = T
    return limit


def find(shapes, model, role) -> Shape:
    for s in shapes:
        if s.model == model and s.role == role:
            return s
    d = MODELS[model]
    dims = tuple(sorted(d.items()))
    n, k = {"o": (d["H"], d["H"]), "qkv": ((d["Hq"] + 2 * d["Hkv"]) * d["D"], d["H"])}[role]
    return Shape(model, role, n, k, dims)


def report(results, copy_gbs: float, log) -> None:
    log(f"\n{'shape':36s} {'T':>2s} {'best µs':>8s} {'GB/s':>7s} {'%copy':>6s} {'cuBLAS µs':>9s} {'x':>5s}  config")
    for (shape, T), res in results.items():
        if not res.us:
            log(f"{shape.name:36s} {T:2d} {'-':>8s}   "
                f"(no valid config; failed {len(res.failed)}, wrong {len(res.wrong)})")
            continue
        eff, us = min(res.us.items(), key=lambda kv: kv[1])
        gbs = shape.weight_bytes / (us * 1e-6) / 1e9
        log(f"{shape.name:36s} {T:2d} {us:8.2f} {gbs:7.0f} {100 * gbs / copy_gbs:5.0f}% {res.cublas_us:9.2f} "
            f"{res.cublas_us / us:5.2f}  {fmt_eff(shape, eff)}")
        for eff_bad, err in res.wrong.items():
            log(f"    WRONG (rel err {err:.2e}): {fmt_eff(shape, eff_bad)}")
        for eff_bad, msg in list(res.failed.items())[:2]:
            log(f"    failed: {fmt_eff(shape, eff_bad)}: {msg}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
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
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    shapes = all_shapes(args.models, args.roles)
    planned = plan(shapes, sorted(set(args.tokens)), args.stages)
    n_measure = sum(len(g) for g in planned.values())
    print(f"{len(shapes)} shapes x {len(set(args.tokens))} token counts: {n_measure} measurements, "
          f"{len(compile_jobs(planned))} kernel compilations")
    if args.dry_run:
        for (shape, T), groups in planned.items():
            copies = copies_for(shape.weight_bytes)
            print(f"  {shape.name:36s} T={T}: {len(groups):3d} configs, {copies:3d} weight copies"
                  f" ({copies * shape.weight_bytes / 2**20:.0f} MiB)")
        return 0
    if not torch.cuda.is_available():
        print("sweep_gemv needs a CUDA GPU (try --dry-run)", file=sys.stderr)
        return 2
    log = lambda s: print(s, flush=True)  # noqa: E731
    copy_gbs = copy_bandwidth_gbs()
    log(f"device: {torch.cuda.get_device_name()}, copy bandwidth {copy_gbs:.0f} GB/s")
    left = args.budget_s - (time.monotonic() - t0)
    precompile(compile_jobs(planned), args.jobs, time.time() + left / 2, log)
    results = sweep(planned, t0 + max(args.budget_s - 20, 0), log)
    report(results, copy_gbs, log)
    tables = choose_tables(results, sorted(set(args.tokens)))
    if not args.no_dispatch and tables:
        from compiled_llm.kernels import launch_configs

        launch_configs.use_configs(tables)
        log("\ndecode vs prefill forms with the chosen configs:")
        tables.update(dispatch_limits(shapes, sorted(set(args.tokens)), t0 + args.budget_s, log))
        launch_configs.use_configs(None)
    snippet = json.dumps(tables, indent=1, sort_keys=True)
    log("\n# paste into DEFAULT_CONFIGS in compiled_llm/kernels/launch_configs.py:\n" + snippet)
    if args.json_out:
        args.json_out.write_text(snippet + "\n")
    log(f"\n{time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
