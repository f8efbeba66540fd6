"""The Hugging Face peers of ``bench``, each in a child process of its own
(``python -m compiled_llm.cli.bench.hf_child SPEC``): the bf16 workloads of ``workloads.py`` and
the torchao peer of ``torchao_peer.py``. Both of those are imported from here, and neither
imports this module.
"""

from __future__ import annotations

import compiled_llm.cli.bench.torchao_peer as torchao_peer
import compiled_llm.cli.bench.workloads as wl
from compiled_llm.cli.bench.workloads import Result


def run_hf_child(hf_config: dict, dtype, device, workload: str, num_requests: int = 256,
                 quantization: str | None = None) -> Result:
    """One HF workload in a fresh interpreter (``python -m compiled_llm.cli.bench.hf_child``): its
    torch.compile and CUDA graphs then share nothing with our engine's, and a crash there (seen:
    a segfault in torch 2.11's CUDA-graph trees) cannot take our finished numbers with it. The
    latency peer retries with the next compile variant when one crashes. ``quantization``
    (latency only): the torchao peer of that scheme (``torchao_peer.py``) instead."""
    import json
    import subprocess
    import sys

    failures = []
    for variant in wl.HF_COMPILE_VARIANTS if workload == "latency" else (None,):
        spec = {"config": hf_config, "dtype": str(dtype).removeprefix("torch."), "device": str(device),
                "workload": workload, "variant": variant, "num_requests": num_requests, "quantization": quantization}
        try:
            proc = subprocess.run([sys.executable, "-m", "compiled_llm.cli.bench.hf_child", json.dumps(spec)],
                                  capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            failures.append(f"variant {variant} timed out (600 s)")
            continue
        for line in reversed(proc.stdout.splitlines()):
            if line.startswith("{"):
                d = json.loads(line)
                return Result(d["workload"], d["system"], d["metrics"], "; ".join(failures + [d.get("note", "")]))
        last = next((ln.strip() for ln in reversed(proc.stderr.splitlines()) if ln.strip()), "")
        failures.append(f"variant {variant} failed (exit {proc.returncode}" + (f": {last[:160]})" if last else ")"))
    if quantization:
        return Result(workload, torchao_peer.system_name(quantization), {}, note="; ".join(failures))
    return Result(workload, "hf", {}, note="; ".join(failures))


def run_torchao_child(hf_config: dict, dtype, device, scheme: str):
    """The torchao peer in a child process (``run_hf_child``); when torchao is not
    installed, the note says so without starting one."""
    why = torchao_peer.missing_reason()
    if why is not None:
        return torchao_peer.not_run(scheme, why)
    return run_hf_child(hf_config, dtype, device, "latency", quantization=scheme)


def main(spec_json: str) -> int:
    """The child: run the workload ``spec_json`` names, print its Result as one JSON line."""
    import dataclasses
    import json

    import torch

    spec = json.loads(spec_json)
    dtype, device = getattr(torch, spec["dtype"]), torch.device(spec["device"])
    if spec["workload"] == "latency" and spec.get("quantization"):
        res = torchao_peer.torchao_latency(spec["config"], dtype, device, spec["quantization"], variant=spec["variant"])
    elif spec["workload"] == "latency":
        res = wl.hf_latency(spec["config"], dtype, device, variant=spec["variant"])
    elif spec["workload"] == "throughput":
        res = wl.hf_throughput(spec["config"], dtype, device, spec.get("num_requests", 256))
    else:
        (res,) = wl.run_hf(spec["config"], dtype, device, (spec["workload"],))
    print(json.dumps({k: v for k, v in dataclasses.asdict(res).items() if k != "extra"}), flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1]))
