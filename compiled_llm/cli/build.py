"""`compiled-llm build SOURCE -o ENGINE_DIR`: capture, fuse, lower and save an engine."""

from __future__ import annotations

import sys

from compiled_llm.cli.engine_args import add_build_arguments, build_config


def add_parser(subparsers):
    p = subparsers.add_parser(
        "build",
        help="build a checkpoint, preset or hub id into an engine directory",
        description="Capture the model with torch.export, run the fusion passes, choose kernels for the "
        "target device and save the engine (manifest, weights, program, IR dumps, tokenizer).",
    )
    p.add_argument("source", metavar="SOURCE", help="checkpoint directory, preset name (e.g. tiny-qwen2) or hub id")
    p.add_argument("-o", "--output", required=True, metavar="ENGINE_DIR", help="engine directory to write (replaced if it holds an engine)")
    add_build_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(handler=run)


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
    from compiled_llm.engine.artifact import build_config as built_with
    from compiled_llm.serve.kernel_warmup import warm_kernels

    config = build_config(args)  # bad values fail before anything loads
    manifest = build_engine(args.source, args.output, config, progress=not args.quiet and sys.stderr.isatty(),
                            warm_up=warm_kernels)
    print(format_summary(manifest))
    built = built_with(manifest)
    quant = f", {built.quantization} weights" if built.quantization else ""
    if built.tensor_parallel_size > 1:
        quant += f", tensor parallel over {built.tensor_parallel_size} ranks"
    if built.pipeline_parallel_size > 1:
        quant += f", {built.pipeline_parallel_size} pipeline stages"
    print(f"engine written to {args.output} ({built.device}, {built.dtype}{quant})")
    return 0
