"""How the engine says that one request cannot run, typed, so that a service maps each case to
its error code by kind and field, never by the words of a message.

`InvalidRequestError` is raised when a request is added (or its `SamplingParams` are built):
the request is at fault and nothing else is touched. `RequestFailure` travels on the
`RequestOutput` of a request the engine gave up on during a step, while the others ran on.
"""

from __future__ import annotations

from dataclasses import dataclass

PROMPT = "prompt"  # the field of a prompt's own errors (empty, ids outside the vocabulary)
STRUCTURED_OUTPUTS = "structured_outputs"  # the field of a constraint that cannot compile


class InvalidRequestError(ValueError):
    """A request the engine refuses: `field` names what is wrong (`prompt`,
    `structured_outputs`, or a `SamplingParams` field such as `top_k`)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ContextLengthError(InvalidRequestError):
    """A prompt (or prompt plus the tokens asked for) longer than the model's context."""

    def __init__(self, message: str) -> None:
        super().__init__(message, PROMPT)


@dataclass(frozen=True)
class RequestFailure:
    """Why the engine gave up on one request alone. `internal`: a fault of the engine's with
    this request (a service answers 500); else the request's own, and `field` names it (400)."""

    message: str
    field: str | None = None
    internal: bool = True

    def __str__(self) -> str:
        return self.message

    @classmethod
    def of(cls, err: BaseException) -> RequestFailure:
        if isinstance(err, InvalidRequestError):
            return cls(str(err), err.field, internal=False)
        return cls(f"{type(err).__name__}: {err}")
