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
