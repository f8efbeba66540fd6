"""`compiled-llm` entry point: one subcommand per module in this package.

Each subcommand module defines ``add_parser(subparsers)`` and ``run(args) -> int`` and keeps heavy
imports (torch, transformers) inside ``run`` so ``--help`` stays instant. A CompiledLLMError is
the user's problem, not ours: it is printed as one line, without a traceback, and exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ("build", "run", "serve", "inspect", "compare", "bench")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compiled-llm",
        description=(
            "Build Hugging Face checkpoints (GPT-2, Llama, Qwen2/2.5, Qwen3) into compiled inference "
            "engines, run them, inspect what each fusion pass did, and compare compiled against eager."
        ),
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"compiled_llm.cli.{name}")
        module.add_parser(subparsers)
    return parser


LOGGING_LEVEL_VAR = "COMPILED_LLM_LOGGING_LEVEL"


def configure_logging() -> None:
    """Diagnostics go to stderr through the ``compiled_llm`` logger (results go to stdout), at
    the level named by $COMPILED_LLM_LOGGING_LEVEL (DEBUG, INFO, WARNING, ...): by default INFO
    on a terminal, WARNING otherwise, so a pipe or a script gets a clean stderr."""
    import logging
    import os

    logger = logging.getLogger("compiled_llm")
    name = os.environ.get(LOGGING_LEVEL_VAR, "").upper() or ("INFO" if sys.stderr.isatty() else "WARNING")
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        print(f"warning: {LOGGING_LEVEL_VAR}={name} is not a logging level; using WARNING", file=sys.stderr)
        level = logging.WARNING
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()  # stderr, looked up when it writes (tests capture it)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    from compiled_llm.errors import CompiledLLMError

    parser = make_parser()
    args = parser.parse_args(argv)
    configure_logging()
    try:
        return int(args.handler(args) or 0)
    except CompiledLLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
