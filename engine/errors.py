"""How the engine says that one request cannot run: one exception class per kind of fault a
service answers differently, so that it maps each to its error code by type and field, never
by the words of a message.

`InvalidRequestError` (and its kinds) is raised when a request is added (or its
`SamplingParams` are built): the request is at fault and nothing else is touched.
`RequestFailure` travels on the `RequestOutput` of a request the engine gave up on during a
step, while the others ran on; it keeps the kind of the error.
"""

from __future__ import annotations

from dataclasses import dataclass

PROMPT = "prompt"  # the field of a prompt's own errors (empty, ids outside the vocabulary)
STRUCTURED_OUTPUTS = "structured_outputs"  # the field of a constraint that cannot compile


class InvalidRequestError(ValueError):
    """A request the engine refuses: `field` names what is wrong (`prompt`,
    `structured_outputs`, or a `SamplingParams` field such as `top_k`). Raised as one of the
    kinds below."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidPromptError(InvalidRequestError):
    """A prompt the model cannot take: empty, token ids outside the vocabulary, text for a
    model without a tokenizer."""

    def __init__(self, message: str) -> None:
        super().__init__(message, PROMPT)


class ContextLengthError(InvalidPromptError):
    """A prompt (or prompt plus the tokens asked for) longer than the model's context."""


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter out of range, alone or for this model; `field` names it."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message, field)


class StructuredOutputError(InvalidRequestError):
    """A constraint that is malformed, or that the grammar engine cannot compile (or not in
    time); the message says why."""

    def __init__(self, message: str) -> None:
        super().__init__(message, STRUCTURED_OUTPUTS)


class ChatTemplateError(InvalidRequestError):
    """A conversation the chat template cannot render (the template raised, or a request's
    `chat_template_kwargs` sets a name the server sets itself); the message names the
    template."""


@dataclass(frozen=True)
class RequestFailure:
    """Why the engine gave up on one request alone: the request's own fault, of `kind` (a
    service answers 400 naming `field`), or, with no kind, a fault of the engine's with this
    request (a service answers 500)."""

    message: str
    field: str | None = None
    kind: type[InvalidRequestError] | None = None

    @property
    def internal(self) -> bool:
        return self.kind is None

    def __str__(self) -> str:
        return self.message

    @classmethod
    def of(cls, err: BaseException) -> RequestFailure:
        if isinstance(err, InvalidRequestError):
            return cls(str(err), err.field, type(err))
        return cls(f"{type(err).__name__}: {err}")
