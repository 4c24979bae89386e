"""The request bodies of the two endpoints a batch line (or an online request) can call,
type- and range-checked, with what they ask of the engine's `SamplingParams`.

A field declared here is honoured. Fields accepted without effect, and the refused ones, are
listed in `fields.py`; the models forbid anything else.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from conveyor.wire_format.errors import describe
from conveyor.wire_format.tool_use import ToolUse
from conveyor.wire_format.tools import (
    MessageToolCall,
    NamedToolChoice,
    Tool,
    check_tool_choice,
    forced_schema,
)

CHAT_URL = "/v1/chat/completions"


COMPLETIONS_URL = "/v1/completions"


# OpenAI's Responses API: its body is translated into a chat completion's (`responses_body.py`)
RESPONSES_URL = "/v1/responses"


SUPPORTED_URLS = (CHAT_URL, COMPLETIONS_URL, RESPONSES_URL)


# OpenAI accepts this many top alternatives per token.
MAX_CHAT_TOP_LOGPROBS = 20


MAX_COMPLETION_LOGPROBS = 5

# OpenAI's range for a logit_bias value (the engine's SamplingParams checks the same)
MAX_LOGIT_BIAS = 100.0

# Bounds the engine's SamplingParams also holds to: no token id, count or length is past int32,
# and a seed is a signed 64-bit integer. The model's own bounds (its vocabulary, its context)
# are checked by the worker that serves it.
MAX_INT = 2**31 - 1
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1


_BODY_CONFIG = ConfigDict(extra="forbid", strict=True, frozen=True)


def _check_stop(value: Any) -> str | list[str] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError("must be a string or a list of strings")


def _check_token_ids(value: Any, what: str = "a list of integer token ids") -> list[int]:
    if isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT for t in value
    ):
        return value
    raise ValueError(f"must be {what} (from 0 to {MAX_INT})")


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints, including vLLM's extensions."""

    model_config = _BODY_CONFIG

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1, le=128)
    stop: Any = None
    seed: int | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
    # vLLM extensions
    top_k: int | None = Field(default=None, ge=-1, le=MAX_INT)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(default=None, ge=0, le=MAX_INT)
    ignore_eos: bool | None = None
    stop_token_ids: Any = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # logits: OpenAI's penalties and bias, vLLM's repetition penalty and allowed ids
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: Any = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # online requests only: a batch line cannot stream
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    # accepted without effect (see fields.py)
    user: Any = None
    safety_identifier: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        return _check_stop(value)

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _token_id_list(cls, value: Any) -> Any:
        return None if value is None else _check_token_ids(value)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit() or not key.isascii() or int(key) > MAX_INT:
                raise ValueError(f"keys must be token ids (decimal strings), got {describe(key)}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"values must be in [-100, 100], got {bias} for token {key}")
        return value

    @model_validator(mode="after")
    def _one_structure(self) -> _SamplingFields:
        given = [name for name in _STRUCTURE_FIELDS if getattr(self, name) is not None]
        if isinstance(self.response_format, ResponseFormat) and self.response_format.type == "text":
            given.remove("response_format")
        if len(given) > 1:
            raise ValueError(
                f"give at most one of {', '.join(given)}: they all constrain the output"
            )
        return self

    def structure(self) -> dict[str, Any] | None:
        """The output constraint asked for, as `StructuredOutputsParams` keyword arguments."""
        if self.response_format is not None:
            return self.response_format.structure()
        if self.structured_outputs is not None:
            return self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):  # fmt: skip
            if getattr(self, name) is not None:
                return {key: getattr(self, name)}
        return None

    def common_sampling_kwargs(self) -> dict[str, Any]:
        # a field left out stays out: the engine fills it from the model's defaults
        kwargs: dict[str, Any] = {"n": 1 if self.n is None else self.n}
        if self.stop is not None:
            kwargs["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        optional = {
            "temperature": None if self.temperature is None else float(self.temperature),
            "top_p": None if self.top_p is None else float(self.top_p),
            "seed": self.seed,
            "top_k": self.top_k,
            "min_p": None if self.min_p is None else float(self.min_p),
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": None if self.stop_token_ids is None else list(self.stop_token_ids),
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": None if not self.logit_bias else dict(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids,
            "structured_outputs": self.structure(),
        }
        kwargs.update({name: value for name, value in optional.items() if value is not None})
        return kwargs


class ResponseFormatJsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following a schema."""

    model_config = _BODY_CONFIG

    type: Literal["text", "json_object", "json_schema"]
    json_schema: ResponseFormatJsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('"json_schema" is required with type "json_schema", and only then')
        return self

    def structure(self) -> dict[str, Any] | None:
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            assert self.json_schema is not None
            return {"json": self.json_schema.schema_ or {}}
        return None


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs`: exactly one of a JSON schema, a regex, a choice of strings
    or an EBNF grammar."""

    model_config = _BODY_CONFIG

    json_: Any = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputsBody:
        given = [k for k in ("json_", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]  # fmt: skip
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar or json_object")
        if self.json_ is not None and not isinstance(self.json_, dict | str):
            raise ValueError(
                f'"json" must be a JSON schema (an object), got {describe(self.json_)}'
            )
        return self


_STRUCTURE_FIELDS = (
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar",
)  # fmt: skip


class ChatMessage(BaseModel):
    model_config = _BODY_CONFIG

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None  # given to the chat template, which may use it
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers
    # what an answer carried, as a client that appends the answer's message sends it back: the
    # thinking goes to templates that render it (Qwen3's `reasoning_content`), a refusal nowhere
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError('may have "tool_calls" only as an "assistant" message')
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError('needs "tool_call_id": the id of the call it answers')
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError('may have "tool_call_id" only as a "tool" message')
        return self

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


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template gets them."""
    dicts = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if (thinking := m.reasoning_content or m.reasoning) is not None:
            message["reasoning_content"] = thinking
        dicts.append(message)
    return dicts


def template_ending(
    add_generation_prompt: bool | None, continue_final_message: bool | None
) -> tuple[bool, bool]:
    """How the chat template ends the prompt (vLLM's fields): a new assistant turn by default;
    with `continue_final_message`, the last message left open for the model to go on with."""
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            '"add_generation_prompt" and "continue_final_message" may not both be true: one '
            "starts a new assistant message, the other continues the last one"
        )
    return (add_generation_prompt is not False and not continue_final_message,
            bool(continue_final_message))  # fmt: skip


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template gets them."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


class ChatCompletionBody(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    modalities: list[Literal["text"]] | None = None  # text is what a chat model answers in
    tools: list[Tool] | None = None
    tool_choice: Any = None  # "none", "auto", "required" or a NamedToolChoice
    parallel_tool_calls: bool | None = None
    # variables for the chat template (vLLM's extension), e.g. {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None
    # how the template ends the prompt (vLLM's extensions; `template_ending`)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _ending(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        template_ending(info.data.get("add_generation_prompt"), value)
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any, info: ValidationInfo) -> str | NamedToolChoice | None:
        if "tools" not in info.data:
            return value  # "tools" failed its own check, which the answer names
        choice = check_tool_choice(value, info.data["tools"])
        if choice not in (None, "none", "auto"):
            other = [name for name in _STRUCTURE_FIELDS if info.data.get(name) is not None]
            if info.data.get("response_format") == ResponseFormat(type="text"):
                other.remove("response_format")  # free text: no constraint
            if other:
                raise ValueError(
                    f'forces a tool call, which "{other[0]}" may not constrain too, got '
                    f"{describe(value)}"
                )
        return choice

    def forced_schema(self) -> dict[str, Any] | None:
        """The schema a forced tool call follows (`tool_choice` "required" or a function)."""
        if not self.tools:
            return None
        return forced_schema(self.tools, self.tool_choice, self.parallel_tool_calls is not False)

    def structure(self) -> dict[str, Any] | None:
        forced = self.forced_schema()
        return {"json": forced} if forced is not None else super().structure()

    def tool_use(self) -> ToolUse | None:
        """How the answer is read for calls: None where no tools are offered ("none")."""
        choice = self.tool_choice or "auto"
        if not self.tools or choice == "none":
            return None
        parallel = self.parallel_tool_calls is not False
        if isinstance(choice, NamedToolChoice):
            return ToolUse("named", choice.function.name, parallel)
        return ToolUse("required" if choice == "required" else "auto", None, parallel)

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template gets them (even with "none", as vLLM gives them)."""
        return template_tools(self.tools)

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

    def message_dicts(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)


class CompletionBody(_SamplingFields):
    prompt: Any  # checked into a list of prompts: strings, or lists of token ids
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_INT)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = None
    best_of: int | None = Field(default=None, ge=1, le=128)

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if value is not None and value != n:
            raise ValueError(
                f"best_of other than n is not supported (best_of {value}, n {n}): "
                "ask for n samples and rank them by their logprobs"
            )
        return value

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
    # with "messages": rendered as a chat request with these fields renders them
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError('give either "prompt" or "messages"')
        chat_fields = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                       "tools")  # fmt: skip
        if self.messages is None:
            for name in chat_fields:
                if getattr(self, name) is not None:
                    raise ValueError(f'"{name}" goes with "messages", not with "prompt"')
        template_ending(self.add_generation_prompt, self.continue_final_message)
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
