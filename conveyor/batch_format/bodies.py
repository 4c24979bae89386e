"""The request bodies of the two endpoints a batch line (or an online request) can call,
type- and range-checked, with what they ask of the engine's `SamplingParams`.

Body fields not declared here (`presence_penalty`, `logit_bias`, `user`, `stream`, ...) are
ignored, as OpenAI clients send many of them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from conveyor.batch_format.errors import describe

CHAT_URL = "/v1/chat/completions"


COMPLETIONS_URL = "/v1/completions"


SUPPORTED_URLS = (CHAT_URL, COMPLETIONS_URL)


# OpenAI accepts this many top alternatives per token.
# OpenAI accepts this many top alternatives per token.
MAX_CHAT_TOP_LOGPROBS = 20


MAX_COMPLETION_LOGPROBS = 5


_BODY_CONFIG = ConfigDict(extra="ignore", strict=True, frozen=True)


def _check_stop(value: Any) -> str | list[str] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError("must be a string or a list of strings")


def _check_token_ids(value: Any, what: str = "a list of integer token ids") -> list[int]:
    if isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        return value
    raise ValueError(f"must be {what}")


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints, including vLLM's extensions."""

    model_config = _BODY_CONFIG

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1, le=128)
    stop: Any = None
    seed: int | None = None
    # vLLM extensions
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: Any = None
    skip_special_tokens: bool | None = None
    # online requests only: a batch line cannot stream
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        return _check_stop(value)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, value: Any) -> Any:
        return None if value is None else _check_token_ids(value)

    def common_sampling_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "n": 1 if self.n is None else self.n,
            "temperature": 1.0 if self.temperature is None else float(self.temperature),
            "top_p": 1.0 if self.top_p is None else float(self.top_p),
        }
        if self.stop is not None:
            kwargs["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        optional = {
            "seed": self.seed,
            "top_k": self.top_k,
            "min_p": None if self.min_p is None else float(self.min_p),
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": None if self.stop_token_ids is None else list(self.stop_token_ids),
            "skip_special_tokens": self.skip_special_tokens,
        }
        kwargs.update({name: value for name, value in optional.items() if value is not None})
        return kwargs


class ChatMessage(BaseModel):
    model_config = _BODY_CONFIG

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> str | None:
        """Plain text, or a list of `{"type": "text", "text": ...}` parts joined by newlines."""
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            texts = []
            for i, part in enumerate(value):
                if not isinstance(part, dict):
                    raise ValueError(f"part {i} must be an object, got {describe(part)}")
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(
                        f'must only hold "text" parts, got a part of type {describe(kind)}'
                    )
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError(f'part {i} needs a string "text", got {describe(text)}')
                texts.append(text)
            return "\n".join(texts)
        raise ValueError('must be a string or a list of {"type": "text", "text": ...} parts')


class ChatCompletionBody(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = self.common_sampling_kwargs()
        # Chat default: no limit other than the model's context length.
        if self.max_completion_tokens is not None:
            kwargs["max_tokens"] = self.max_completion_tokens
        else:
            kwargs["max_tokens"] = self.max_tokens
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs or 0
        return kwargs

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content or ""} for m in self.messages]


class CompletionBody(_SamplingFields):
    prompt: Any  # checked into a list of prompts: strings, or lists of token ids
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> list[str] | list[list[int]]:
        if isinstance(value, str):
            return [value]
        if isinstance(value, list):
            if value and all(isinstance(p, str) for p in value):
                return value
            if value and all(isinstance(p, list) for p in value):
                return [_check_token_ids(p) for p in value]
            return [_check_token_ids(value, "a string or a list of integer token ids")]
        raise ValueError(
            "must be a string, a list of strings, a list of integer token ids or a list of "
            "such lists"
        )

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        return self.prompt

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = self.common_sampling_kwargs()
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        # `max_tokens: 0` with `echo` only scores the prompt: generate one token, drop it later.
        kwargs["max_tokens"] = max(max_tokens, 1)
        if self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
            if self.echo:
                kwargs["prompt_logprobs"] = self.logprobs
        return kwargs


class TokenizeBody(BaseModel):
    """`POST /tokenize` (vLLM's): a prompt, or chat messages through the chat template."""

    model_config = _BODY_CONFIG

    model: str | None = None  # may be left out when one model is served
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError('give either "prompt" or "messages"')
        return self


class DetokenizeBody(BaseModel):
    """`POST /detokenize` (vLLM's)."""

    model_config = _BODY_CONFIG

    model: str | None = None
    tokens: Any

    @field_validator("tokens")
    @classmethod
    def _tokens(cls, value: Any) -> list[int]:
        return _check_token_ids(value)
