"""`compiled-llm inspect ENGINE_DIR`: what the build did: passes, op histograms, kernels, IR, and
a megakernel engine's schedule as a per-SM timeline."""

from __future__ import annotations


def add_parser(subparsers):
    p = subparsers.add_parser(
        "inspect",
        help="show an engine's passes, op histograms, kernel choices and IR",
        description="Show the pass table and op histograms of an engine; --pass prints the IR after one "
        "pass, --diff A B a unified diff of the IR between two stages (pass names or 'captured').",
    )
    p.add_argument("engine", metavar="ENGINE_DIR", help="engine directory made by `compiled-llm build`")
    p.add_argument("--pass", dest="pass_name", metavar="NAME", help="print the IR (graph code) after pass NAME")
    p.add_argument("--diff", nargs=2, metavar=("A", "B"), help="unified diff of the IR after stage A and after stage B")
    p.add_argument("--json", action="store_true", help="print passes, ops_before, ops_after and kernels as JSON")
    p.add_argument("--timeline", action="store_true",
                   help="a megakernel engine's decode schedule: one row per SM, its tiles on the build's time estimate")
    p.set_defaults(handler=run)


def stage_file(engine_dir, manifest: dict, name: str, suffix: str = ".py"):
    """The IR file of a stage named by pass name, 'captured' or its full stage name."""
    from pathlib import Path

    from compiled_llm.engine.artifact import IR_DIR
    from compiled_llm.errors import CompiledLLMError

    stages = manifest.get("ir_stages", [])
    matches = [s for s in stages if s == name or s.split("_", 1)[1] == name]
    if not matches:
        names = ", ".join(s.split("_", 1)[1] for s in stages)
        raise CompiledLLMError(f"no stage {name!r} in this engine; stages: {names}")
    path = Path(engine_dir) / IR_DIR / (matches[-1] + suffix)
    if not path.is_file():
        raise CompiledLLMError(f"{path.name} was not kept; rebuild with --dump-ir to see the IR of every pass")
    return path


def _parallel(manifest: dict) -> dict:
    """How the engine is split over ranks: its tensor-parallel and pipeline sizes, and each
    pipeline stage's layers (an engine built before pipelines records no pipeline size: 1)."""
    from compiled_llm.engine.artifact import build_config

    built = build_config(manifest)
    stages = (manifest.get("pipeline") or {}).get("stages", [])
    return {"tensor_parallel_size": built.tensor_parallel_size, "pipeline_parallel_size": built.pipeline_parallel_size,
            "stages": [{"layers": [s["first_layer"], s["first_layer"] + s["num_layers"] - 1],
                        "activations_in": s["inputs"], "file": s["file"]} for s in stages]}


def _parallel_line(parallel: dict) -> str:
    line = f"parallel: tensor {parallel['tensor_parallel_size']} x pipeline {parallel['pipeline_parallel_size']}"
    stages = [f"stage {k} layers {s['layers'][0]}-{s['layers'][1]}" for k, s in enumerate(parallel["stages"])]
    return line + (f" ({', '.join(stages)})" if stages else "")


def _backend_line(manifest: dict) -> str:
    mk = manifest.get("megakernel")
    if not mk:
        return "decode backend: per-op"
    return (f"decode backend: megakernel ({mk.get('instructions')} instructions on {mk.get('num_sms')} SMs, "
            f"{mk.get('counters')} counters, estimated step {mk.get('estimated_step_us')} us; --timeline shows it)")


def _table(manifest: dict) -> str:
    from compiled_llm.cli.build import format_summary

    lines = [format_summary(manifest), _parallel_line(_parallel(manifest)), _backend_line(manifest), "",
             f"{'op':<36} {'before':>7} {'after':>7}"]
    before, after = manifest["ops_before"], manifest["ops_after"]
    for op in sorted(set(before) | set(after), key=lambda o: (-(after.get(o, 0) + before.get(o, 0)), o)):
        lines.append(f"{op:<36} {before.get(op, 0):>7} {after.get(op, 0):>7}")
    return "\n".join(lines)


def run(args) -> int:
    import difflib
    import json

    from compiled_llm.engine.artifact import read_manifest

    manifest = read_manifest(args.engine)
    if args.json:
        print(json.dumps({
            "passes": [{"name": p["name"], "matches": p["matches"]} for p in manifest["passes"]],
            "ops_before": manifest["ops_before"],
            "ops_after": manifest["ops_after"],
            "kernels": manifest["kernels"],
            "parallel": _parallel(manifest),
            "megakernel": manifest.get("megakernel"),
        }, indent=1))
        return 0
    if args.timeline:
        from pathlib import Path

        from compiled_llm.engine.artifact import load_schedule
        from compiled_llm.errors import CompiledLLMError
        from compiled_llm.megakernel.timeline import timeline

        if not manifest.get("megakernel"):
            raise CompiledLLMError(f"{args.engine} runs decode steps per op: it has no megakernel schedule "
                                   "(build it with --decode-backend megakernel)")
        print(timeline(load_schedule(Path(args.engine), manifest)))
        return 0
    if args.pass_name:
        print(stage_file(args.engine, manifest, args.pass_name).read_text(), end="")
        return 0
    if args.diff:
        a, b = (stage_file(args.engine, manifest, n) for n in args.diff)
        diff = difflib.unified_diff(
            a.read_text().splitlines(keepends=True), b.read_text().splitlines(keepends=True),
            fromfile=f"ir/{a.name}", tofile=f"ir/{b.name}",
        )
        print("".join(diff), end="")
        return 0
    print(_table(manifest))
    return 0
