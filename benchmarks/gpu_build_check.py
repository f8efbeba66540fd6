"""GPU check of the build pipeline's Inductor backend, in one run (target: ~4 min on an H100).

  1. build the qwen2.5-0.5b preset (random weights, Qwen2.5-0.5B shapes) in bf16 for CUDA with
     the Inductor backend into a temporary directory;
  2. load it twice, each in a fresh process with an *empty* Inductor cache dir, so only the
     compiled result saved in the engine can spare a compile; time load + first step per warm
     shape and count Inductor FX-graph cache hits/misses (misses = compiles);
  3. compare the Inductor program against the engine's portable program over 16 prompts x 64
     tokens (>= 99% greedy agreement, flips inside the other side's top 5).

Usage:  python benchmarks/gpu_build_check.py [--preset qwen2.5-0.5b] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def load_once(engine_dir: str) -> dict:
    """(child process) load the engine, run the warm shapes, report times and cache counters."""
    t0 = time.perf_counter()
    import torch
    from torch._dynamo.utils import counters

    from compiled_llm import backend as backends
    from compiled_llm.artifact import load_engine

    t_import = time.perf_counter() - t0
    t1 = time.perf_counter()
    engine = load_engine(engine_dir)
    t_load = time.perf_counter() - t1
    t2 = time.perf_counter()
    backends.warm(engine.program, engine.params, engine.config, engine.device, engine.dtype)
    t_first = time.perf_counter() - t2
    return {
        "backend": engine.backend,
        "import_s": t_import,
        "load_s": t_load,
        "first_steps_s": t_first,
        "fxgraph_hit": int(counters["inductor"].get("fxgraph_cache_hit", 0)),
        "fxgraph_miss": int(counters["inductor"].get("fxgraph_cache_miss", 0)),
        "aot_hit": int(counters["aot_autograd"].get("autograd_cache_hit", 0)),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }


def _child_load(engine_dir: Path, scratch: Path, tag: str) -> dict:
    cache = scratch / f"inductor-cache-{tag}"
    cache.mkdir()
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache / "triton"))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--load-child", str(engine_dir)],
                          env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"load {tag} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = wall
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-0.5b", help="model preset to build (default: qwen2.5-0.5b)")
    parser.add_argument("--num-prompts", type=int, default=16, help="compare: prompts (default: 16)")
    parser.add_argument("--max-tokens", type=int, default=64, help="compare: greedy tokens per prompt (default: 64)")
    parser.add_argument("--keep", default=None, help="build the engine here and keep it (default: a temp dir)")
    parser.add_argument("--load-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_child:
        print(json.dumps(load_once(args.load_child)))
        return 0

    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="cllm-gpu-check-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / "inductor-cache-build")
    engine_dir = Path(args.keep) if args.keep else scratch / "engine"

    from compiled_llm.build import build_engine
    from compiled_llm.compare import compare_engine

    t0 = time.perf_counter()
    manifest = build_engine(args.preset, engine_dir, dtype="bfloat16", device="cuda", backend="inductor", progress=False)
    build_s = time.perf_counter() - t0
    cache_file = manifest["backend"]["cache_file"]
    cache_mb = (engine_dir / cache_file).stat().st_size / 1e6 if cache_file else 0.0

    loads = [_child_load(engine_dir, scratch, f"load{i}") for i in (1, 2)]

    lines: list[str] = []
    t1 = time.perf_counter()
    verdict, _ = compare_engine(engine_dir, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                                reference="portable", backend="inductor", bisect=False, out=lines.append)
    compare_s = time.perf_counter() - t1

    print(f"\n== gpu_build_check: {args.preset}, bf16, {loads[0]['gpu']}, torch {torch.__version__} ==")
    print(f"build: {build_s:.1f}s  stages: " + ", ".join(f"{k} {v:.1f}s" for k, v in manifest["stage_seconds"].items()))
    print(f"kernels: " + ", ".join(f"{k}={v}" for k, v in manifest["kernels"].items()))
    print(f"inductor cache in engine: {cache_file} ({cache_mb:.1f} MB)")
    print(f"{'load':<6} {'backend':<9} {'process s':>9} {'import s':>8} {'load s':>7} {'1st steps s':>11} {'fx hit':>6} {'fx miss':>7} {'aot hit':>7}")
    for i, r in enumerate(loads, 1):
        print(f"{i:<6} {r['backend']:<9} {r['process_wall_s']:>9.1f} {r['import_s']:>8.1f} {r['load_s']:>7.1f} "
              f"{r['first_steps_s']:>11.1f} {r['fxgraph_hit']:>6} {r['fxgraph_miss']:>7} {r['aot_hit']:>7}")
    no_compile = all(r["backend"] == "inductor" and r["fxgraph_miss"] == 0 for r in loads)
    print(f"loads compile again: {'no' if no_compile else 'YES (fx graph cache misses above)'}")
    print(f"compare inductor vs portable ({args.num_prompts} prompts x {args.max_tokens} tokens, {compare_s:.1f}s):")
    for line in lines[1:-1]:
        print(line)
    print(lines[-1])
    ok = verdict.ok and no_compile
    print(f"RESULT: {'PASS' if ok else 'FAIL'}: agreement {verdict.agreement:.2%}, flips outside top-5 "
          f"{verdict.flips_outside_top_k}, loads without compiling: {no_compile}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
