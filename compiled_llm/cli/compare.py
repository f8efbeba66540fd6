"""`compiled-llm compare` (placeholder until its issue lands)."""


def add_parser(subparsers):
    p = subparsers.add_parser("compare", help="(not yet implemented)")
    p.set_defaults(handler=run)


def run(args) -> int:
    from compiled_llm.errors import CompiledLLMError

    raise CompiledLLMError("'compare' is not implemented yet")
