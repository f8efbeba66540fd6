"""`compiled-llm build SOURCE -o ENGINE_DIR`: capture, fuse, lower and save an engine."""

from __future__ import annotations

import sys


def add_parser(subparsers):
    p = subparsers.add_parser(
        "build",
        help="build a checkpoint, preset or hub id into an engine directory",
        description="Capture the model with torch.export, run the fusion passes, choose kernels for the "
        "target device and save the engine (manifest, weights, program, IR dumps, tokenizer).",
    )
    p.add_argument("source", metavar="SOURCE", help="checkpoint directory, preset name (e.g. tiny-qwen2) or hub id")
    p.add_argument("-o", "--output", required=True, metavar="ENGINE_DIR", help="engine directory to write (replaced if it holds an engine)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"],
                   help="weight and activation dtype; auto (the default) = the checkpoint's float16/bfloat16 on "
                        "a GPU (bfloat16 when it is float32 or says nothing), float32 on a CPU")
    p.add_argument("--device", default="auto",
                   help="target device: auto (the default: cuda when available, else cpu), cpu or cuda")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="longest context the engine serves (default: the model's maximum)")
    p.add_argument("--disable-pass", action="append", default=[], metavar="NAME",
                   help="skip a pass (repeatable); see `compiled-llm inspect` for the pass names")
    p.add_argument("--kernel", action="append", default=[], metavar="OP=PROVIDER",
                   help="force a kernel provider for a cllm op, e.g. paged_attention=triton (repeatable)")
    p.add_argument("--quantization", "-q", default=None, choices=["int8", "int4"],
                   help="weight-only quantization of the linear layers and the lm_head: int8 (per output "
                        "channel) or int4 (groups of 128 along K); default: none")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="shard the model over N GPUs (N processes over gloo on a CPU): heads and MLP columns "
                        "split, one weights file per rank; default: 1")
    p.add_argument("--dump-ir", action="store_true",
                   help="keep the graph code after every pass in ENGINE_DIR/ir (default: captured and final only)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(handler=run)


def parse_kernel_prefs(items: list[str]) -> dict[str, str]:
    from compiled_llm.errors import CompiledLLMError

    prefs = {}
    for item in items:
        op, sep, provider = item.partition("=")
        if not sep or not op or not provider:
            raise CompiledLLMError(f"--kernel {item!r} is not OP=PROVIDER")
        prefs[op] = provider
    return prefs


def format_summary(manifest: dict) -> str:
    lines = [f"{'pass':<18} {'matches':>7} {'ops before':>10} {'ops after':>9} {'time (s)':>9}"]
    for p in manifest["passes"]:
        note = "" if p["matches"] else "  (matched nothing)"
        lines.append(f"{p['name']:<18} {p['matches']:>7} {p['ops_before']:>10} {p['ops_after']:>9} {p['seconds']:>9.3f}{note}")
    before, after = sum(manifest["ops_before"].values()), sum(manifest["ops_after"].values())
    lines.append(f"ops: {before} -> {after}")
    lines.append("stages: " + ", ".join(f"{k} {v:.2f}s" for k, v in manifest["stage_seconds"].items()))
    lines.append("kernels: " + ", ".join(f"{op}={prov}" for op, prov in manifest["kernels"].items()))
    return "\n".join(lines)


def run(args) -> int:
    from compiled_llm.engine.build import build_engine

    manifest = build_engine(
        args.source, args.output,
        dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        disabled_passes=args.disable_pass, dump_ir=args.dump_ir,
        kernel_prefs=parse_kernel_prefs(args.kernel), progress=not args.quiet and sys.stderr.isatty(),
        quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size,
    )
    print(format_summary(manifest))
    opts = manifest["build_options"]
    quant = f", {opts['quantization']} weights" if opts.get("quantization") else ""
    if (opts.get("tensor_parallel_size") or 1) > 1:
        quant += f", tensor parallel over {opts['tensor_parallel_size']} ranks"
    print(f"engine written to {args.output} ({opts['device']}, {opts['dtype']}{quant})")
    return 0
