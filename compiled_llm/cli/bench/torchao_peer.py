"""The quantized latency peer of ``bench``: Hugging Face transformers with torchao's weight-only
quantization of the engine's scheme, timed exactly as the bf16 HF latency peer (static cache +
torch.compile, in its own child process; ``workloads.hf_latency``).

An engine built with ``--quantization int8|int4`` records the scheme in its manifest
(``build_options.quantization``); ``bench`` then also runs this peer on the latency workload:

- int8: ``Int8WeightOnlyConfig()``: symmetric, one scale per output channel (ours too).
- int4: ``Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")``:
  asymmetric groups of 128 along K (ours too), packed for PyTorch's own tinygemm kernel
  (``aten._weight_int4pack_mm``, CUDA, bf16 activations). torchao's default int4 packing
  ("plain") needs the separate mslk kernel package, which a plain install lacks.

``torchao.quantization.quantize_`` swaps the weight of every ``nn.Linear``, the lm_head
included (a tied lm_head gets its own quantized copy, the embedding stays as it was), as the
engine's ``quantize_weights`` pass does. A layer whose K is not a multiple of the group size is
left unquantized by torchao (the engine uses smaller groups there); the note counts them.

torchao is optional and imported lazily (never at ``bench`` start): if it is not installed,
cannot be imported, or cannot quantize for this device and dtype (its int4 kernel wants bf16 on
CUDA), the peer's result has no metrics and a note saying why; our number stays in the table.
Tested with torchao 0.18.0 (torch >= 2.11).
"""

from __future__ import annotations

import importlib.util

from compiled_llm.engine.build_config import QUANTIZATIONS
INT4_GROUP_SIZE = 128


def system_name(scheme: str) -> str:
    return f"hf+torchao {scheme} static+compile"


def not_run(scheme: str, why: str):
    from compiled_llm.cli.bench.workloads import Result

    return Result("latency", system_name(scheme), {}, note=f"not run: {why}")


def _first_line(e: BaseException, limit: int = 160) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:limit]}" if text else type(e).__name__


def missing_reason() -> str | None:
    """Why torchao cannot be used here without importing it, or None when it is installed."""
    try:
        found = importlib.util.find_spec("torchao") is not None
    except (ImportError, ValueError) as e:
        return f"torchao cannot be found ({_first_line(e)})"
    return None if found else "torchao is not installed (pip install torchao)"


def torchao_config(scheme: str):
    """torchao's weight-only config for one of our schemes (imports torchao)."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig

    if scheme == "int8":
        return Int8WeightOnlyConfig()
    if scheme == "int4":
        return Int4WeightOnlyConfig(group_size=INT4_GROUP_SIZE, int4_packing_format="tile_packed_to_4d")
    raise ValueError(f"no torchao config for scheme {scheme!r}; choose one of {QUANTIZATIONS}")


def quantize_model(model, scheme: str) -> tuple[int, int]:
    """Quantize ``model``'s linear weights in place with torchao; returns (quantized, linears):
    how many ``nn.Linear`` weights torchao replaced, of how many."""
    import torch
    from torchao.quantization import quantize_

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    before = [type(m.weight) for m in linears]
    quantize_(model, torchao_config(scheme))
    quantized = sum(type(m.weight) is not b for m, b in zip(linears, before))
    if not quantized:
        raise RuntimeError(f"torchao quantized none of the model's {len(linears)} linear layers")
    return quantized, len(linears)


def torchao_latency(hf_config: dict, dtype, device, scheme: str, variant: str = "auto",
                    new_tokens: int = 256, repeats: int = 3):
    """The latency workload on the HF model (random weights, as the bf16 peer) after torchao's
    weight-only quantization. Import and quantization failures come back as a note; a failure
    while compiling or generating raises, so ``run_hf_child`` tries the next compile variant."""
    from compiled_llm.cli.bench.workloads import PrepareError, hf_latency

    if scheme not in QUANTIZATIONS:
        return not_run(scheme, f"no torchao config for scheme {scheme!r}")
    try:
        import torchao
    except Exception as e:  # an ABI mismatch can raise more than ImportError
        return not_run(scheme, f"torchao cannot be imported ({_first_line(e)})")
    version = getattr(torchao, "__version__", "?")

    def prepare(model) -> str:
        done, total = quantize_model(model, scheme)
        skipped = f", {total - done} left unquantized" if done < total else ""
        return f"torchao {version} {scheme} weight-only on {done} of {total} linears{skipped}"

    try:
        return hf_latency(hf_config, dtype, device, new_tokens, repeats, variant, prepare=prepare,
                          system=system_name(scheme))
    except PrepareError as e:
        return not_run(scheme, f"torchao {version} cannot quantize {scheme} on {device} in "
                               f"{str(dtype).removeprefix('torch.')} ({_first_line(e.__cause__ or e)})")
