"""`compiled-llm compare ENGINE_DIR`: engine vs reference on random prompts, greedy."""

from __future__ import annotations


def add_parser(subparsers):
    p = subparsers.add_parser(
        "compare",
        help="check an engine against the spec or transformers (and name the pass that breaks it)",
        description="Run the engine and a reference on the same random prompts (fixed seed, greedy, the "
        "reference fed the engine's tokens); print per-prompt greedy agreement and max |Δlogit|. Out of "
        "tolerance, rebuild with growing prefixes of the pass list and name the first pass that changes "
        "the numbers. Exit status 0 only when within tolerance.",
    )
    p.add_argument("engine", metavar="ENGINE_DIR", help="engine directory made by `compiled-llm build`")
    p.add_argument("--num-prompts", type=int, default=8, metavar="N", help="random prompts (default: 8)")
    p.add_argument("--max-tokens", type=int, default=32, metavar="K", help="greedy tokens per prompt (default: 32)")
    p.add_argument("--reference", default="spec", choices=["spec", "hf"],
                   help="spec: the model with no passes; hf: transformers on the source checkpoint (default: spec)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: 0)")
    p.add_argument("--no-bisect", action="store_true", help="do not search for the pass that breaks the numbers")
    p.set_defaults(handler=run)


def run(args) -> int:
    from compiled_llm.engine.compare import compare_engine
    from compiled_llm.serve.executor.multiproc import start_ranks

    verdict, _ = compare_engine(
        args.engine, num_prompts=args.num_prompts, max_tokens=args.max_tokens, reference=args.reference,
        seed=args.seed, bisect=not args.no_bisect, start_ranks=start_ranks,
    )
    return 0 if verdict.ok else 1
