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


class InvalidRequestError(CompiledLLMError):
    """A request that can never be served (bad sampling values, prompt too long, ...)."""


class EngineError(CompiledLLMError):
    """A missing, corrupt, mismatched or future-format engine directory."""
