"""The cold-start workload: a fresh process, from its start to the first generated token.

Each measurement runs in a new interpreter, so nothing (imports, compiled kernels, CUDA context)
is shared with the parent or with the other measurements:

- compiled_llm, cold: a fresh process loads the engine (``LLM(ENGINE)``) and generates one token
  of the latency workload's 128-token prompt, with an empty compiled_llm cache directory, so the
  engine's kernels are unpacked as on a first run; then "warm": the same again, that directory
  kept (every later run on the machine);
- transformers: a fresh process imports transformers, ``from_pretrained`` the same weights onto
  the device and generates one token (the checkpoint is written once beforehand, untimed, with
  ``save_pretrained``, for engines built from a preset);
- build: ``compiled-llm build`` of the engine's source with its build options, in a fresh process.

The child reports its stages: interpreter start, import, the engine load's own stages (manifest,
weights, program, verify, kernels; ``LoadedEngine.stage_seconds``), tokenizer, engine (KV cache
sizing and allocation, then the rest of the engine), first token (prefill, its CUDA graph captured
on first use, sampling). The note says how many kernels the process had to compile (files Triton
added to the engine's kernel directory): none, when the engine shipped all it launches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START = time.time()  # as early as this module can see: the interpreter's own start-up is before it

PROMPT_LEN = 128
CHILD_TIMEOUT_S = 600


def _child_engine(engine_dir: str, device: str) -> dict:
    """Runs in the fresh process: stage times of loading ``engine_dir`` and one token."""
    t0 = time.perf_counter()
    import torch

    from compiled_llm.serve.sampling_params import SamplingParams
    from compiled_llm.serve.llm import LLM
    from compiled_llm.cli.bench.workloads import latency_prompt

    t1 = time.perf_counter()
    llm = LLM(engine_dir, device=device)
    t2 = time.perf_counter()
    prompt = latency_prompt(llm.model.config.vocab_size, PROMPT_LEN)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()
    t3 = time.perf_counter()
    assert len(out[0].token_ids) == 1
    load = {**llm.model.load_stages, **llm.stats.init_s}
    return {"import": t1 - t0, **load, "engine": max(t2 - t1 - sum(load.values()), 0.0), "first_token": t3 - t2}


def _child_hf(model_dir: str, dtype: str, device: str) -> dict:
    """Runs in the fresh process: transformers' from_pretrained and one generated token."""
    t0 = time.perf_counter()
    import torch
    import transformers

    t1 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    from compiled_llm.cli.bench.workloads import latency_prompt

    ids = torch.tensor([latency_prompt(model.config.vocab_size, PROMPT_LEN)], device=device)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return {"import": t1 - t0, "from_pretrained": t2 - t1, "first_token": time.perf_counter() - t2}


def _run_child(args: list[str], env: dict[str, str] | None = None) -> dict:
    """Start ``python -m compiled_llm.cli.bench.coldstart ARGS``; its stage times, with ``interpreter``
    (process start to the child's first line) and ``wall`` (process start to its last stage)."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "compiled_llm.cli.bench.coldstart", *args], capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S, env={**os.environ, **(env or {})})
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"cold-start child {' '.join(args[:1])} failed (exit {proc.returncode}): {tail}")
    report = json.loads(line)
    stages = {"interpreter": report["start"] - t0, **report["stages"]}
    stages["wall"] = report["end"] - t0
    return stages


def _hf_checkpoint(manifest: dict, dtype: str, scratch: Path) -> str | None:
    """The checkpoint directory transformers loads: the engine's source, or (presets) one
    written once with random weights of the same config."""
    source = manifest.get("source") or {}
    if source.get("model_dir") and (Path(source["model_dir"]) / "config.json").is_file():
        return source["model_dir"]
    if not source.get("preset"):
        return None
    import torch
    import transformers

    from compiled_llm.model.presets import preset_hf_config

    cfg = dict(preset_hf_config(source["preset"]))
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items() if k != "architectures"})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    path = scratch / "hf-checkpoint"
    model.save_pretrained(path)
    return str(path)


def _build_args(manifest: dict, out: Path) -> list[str]:
    """``compiled-llm build`` of the engine's source with the options it was built with."""
    from compiled_llm.cli.engine_args import build_flags
    from compiled_llm.engine.artifact import build_config

    source = manifest.get("source") or {}
    src = source.get("preset") or source.get("model_dir")
    return ["-m", "compiled_llm.cli.main", "build", src, "-o", str(out), "--quiet", *build_flags(build_config(manifest))]


def measure(engine_dir: str | Path, device: str, with_hf: bool = True, with_build: bool = True):
    """Results of the cold-start workload (``workloads.Result``): ours cold and warm, the
    transformers peer, and the build."""
    from compiled_llm.engine.artifact import build_config, read_manifest
    from compiled_llm.cli.bench.workloads import Result

    manifest = read_manifest(engine_dir)
    dtype = build_config(manifest).dtype
    results = []
    with tempfile.TemporaryDirectory(prefix="coldstart-") as tmp:
        scratch = Path(tmp)
        fresh_cache = {"COMPILED_LLM_CACHE_DIR": str(scratch / "cache")}
        for label in ("cold", "warm"):
            before = _count_files(scratch / "cache")
            stages = _run_child(["engine", str(engine_dir), device], env=fresh_cache)
            compiled = _count_files(scratch / "cache") - before - (_kernel_files(manifest) if label == "cold" else 0)
            results.append(Result("coldstart", "compiled_llm", _seconds(stages),
                                  note=f"{label}: fresh process -> first token" + (", kernels unpacked" if label == "cold" else "")
                                  + f"; {compiled} kernel files compiled"))
        if with_build:
            if (manifest.get("source") or {}).get("preset") or (manifest.get("source") or {}).get("model_dir"):
                t0 = time.perf_counter()
                proc = subprocess.run([sys.executable, *_build_args(manifest, scratch / "rebuilt")],
                                      capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env={**os.environ, **fresh_cache})
                build_s = time.perf_counter() - t0
                note = "compiled-llm build, fresh process" if proc.returncode == 0 else f"build failed (exit {proc.returncode})"
                results.append(Result("build", "compiled_llm", {"wall_s": build_s} if proc.returncode == 0 else {}, note=note))
        if with_hf:
            try:
                model_dir = _hf_checkpoint(manifest, dtype, scratch)
                if model_dir is None:
                    raise RuntimeError("the engine records no preset or checkpoint directory")
                stages = _run_child(["hf", model_dir, dtype, device])
                results.append(Result("coldstart", "hf", _seconds(stages), note="from_pretrained + generate 1 token"))
            except Exception as e:  # the peer failing must not hide our numbers
                results.append(Result("coldstart", "hf", {}, note=f"failed: {str(e).strip()[:120]}"))
    return results


def format_table(results) -> str:
    """One row per run: each stage in seconds, then the wall time from process start."""
    runs = [r for r in results if r.metrics]
    stages = list(dict.fromkeys(k for r in runs for k in r.metrics if k != "wall_s"))
    header = ["system", *[k.removesuffix("_s") for k in stages], "wall (s)", "note"]
    rows = [header]
    for r in runs:
        cells = [f"{r.metrics[k]:.2f}" if k in r.metrics else "-" for k in stages]
        rows.append([f"{r.workload}: {r.system}", *cells, f"{r.metrics.get('wall_s', 0):.2f}", r.note])
    rows += [[f"{r.workload}: {r.system}", *["-"] * len(stages), "-", r.note] for r in results if not r.metrics]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) + "  " + row[-1]
                     for row in rows)


def _count_files(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0


def _kernel_files(manifest: dict) -> int:
    from compiled_llm.engine.kernel_cache import engine_kernel_files

    return len(engine_kernel_files(manifest))


def _seconds(stages: dict) -> dict[str, float]:
    return {f"{k}_s": round(v, 4) for k, v in stages.items()}


def _main(argv: list[str]) -> int:
    kind, *rest = argv
    stages = _child_engine(*rest) if kind == "engine" else _child_hf(*rest)
    print(json.dumps({"start": START, "end": time.time(), "stages": stages}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
