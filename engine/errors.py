"""Errors that name the request field they are about (vLLM's `VLLMValidationError(parameter=)`), so
the server answers OpenAI's `param` from where the error was raised, never from its wording."""
from __future__ import annotations


class ParameterError(ValueError):
    """A bad value of one field: `parameter` is its name as the API spells it ("top_p",
    "structured_outputs.json"), or None where no single field is at fault."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


def parameter_of(error: BaseException) -> str | None:
    return getattr(error, "parameter", None)
