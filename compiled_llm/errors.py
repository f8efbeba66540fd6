"""User-facing errors.

Every problem a user can cause (bad path, unsupported architecture, bad sampling values, corrupt
engine, ...) is raised as a ``CompiledLLMError``. The CLI prints its message as one line and exits
with status 2, so users never see a traceback from inside torch for their own mistakes.
"""


class CompiledLLMError(Exception):
    """An error whose message is meant for the user, one line, naming the problem."""


class UnsupportedArchitectureError(CompiledLLMError):
    pass


class WeightLoadError(CompiledLLMError):
    pass


class InvalidRequestError(CompiledLLMError, ValueError):
    """A request that can never be served (bad sampling values, prompt too long, ...). A
    ValueError too, as bad arguments are in Python and in vLLM."""


class InvalidOptionError(CompiledLLMError, ValueError):
    """An engine option with a bad value, or options that together cannot make progress."""


class EngineError(CompiledLLMError):
    """A missing, corrupt, mismatched or future-format engine directory."""


def first_line(error: BaseException, limit: int | None = 200) -> str:
    """The first line of an exception's message (cut to ``limit`` characters), or its type's
    name when it has none: how an error from inside a library becomes part of one line."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    line = text.splitlines()[0]
    return line if limit is None else line[:limit]
