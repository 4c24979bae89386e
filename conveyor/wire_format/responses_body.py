"""OpenAI's Responses API request (`POST /v1/responses`, and batch lines of that url), checked and
translated into the chat completion body that Conveyor runs: one path to the engine, whichever
API a client speaks.

    instructions            a first "system" message
    input                   the messages: a string is one user message; message items keep their
                            role; a `reasoning` item, an assistant message and `function_call`
                            items in a row are one assistant turn (its thinking, content and
                            `tool_calls`); a `function_call_output` is a "tool" message
    max_output_tokens       max_completion_tokens
    text.format             response_format
    tools                   tools, from the flat `{"type": "function", "name", ...}` shape
    tool_choice             tool_choice, `{"type": "function", "name"}` named as chat names it
    include                 "message.output_text.logprobs": logprobs (top_logprobs alternatives)
    reasoning.effort        the template's `reasoning_effort`, and `enable_thinking` false for
                            "none" (unless chat_template_kwargs says), as vLLM does

A field that would need state Conveyor does not keep (`previous_response_id`, `conversation`,
`background`) or a tool it does not run (web search, file search, ...) is refused, naming it.
`store` is accepted, as vLLM accepts it, but nothing is stored: there is no `GET
/v1/responses/{id}`. The chat body's own checks then run, and their errors name the Responses
field (`max_output_tokens`, not `max_completion_tokens`).
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from conveyor.wire_format.fields import refused_field

_CONFIG = ConfigDict(extra="forbid", strict=True, frozen=True)

ENCRYPTED_REASONING = "reasoning.encrypted_content"
OUTPUT_LOGPROBS = "message.output_text.logprobs"
# `include` values Conveyor fills; others ask for the outputs of tools it does not run
INCLUDABLE = (ENCRYPTED_REASONING, OUTPUT_LOGPROBS)

# field -> why it is refused, where it asks for what Conveyor does not do (a false or empty
# value asks for nothing, and is accepted)
REFUSED: dict[str, str] = {
    "previous_response_id": "responses are not stored; send the whole conversation in input",
    "conversation": "conversations are not stored; send the whole conversation in input",
    "background": "background responses are not supported: they need stored responses",
    "prompt": "prompt templates are not supported; send the prompt in input",
    "max_tool_calls": "a limit on built-in tool calls is not supported",
    "context_management": "context management is not supported",
}
# fields whose default value asks for nothing
_DEFAULTS = {"truncation": "disabled"}

# the chat body's fields a Responses body passes on as they are (vLLM's extensions included)
PASSED_ON = (
    "model", "temperature", "top_p", "seed", "top_k", "min_p", "min_tokens", "stop",
    "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "skip_special_tokens", "structured_outputs",
    "chat_template_kwargs", "parallel_tool_calls", "top_logprobs", "stream", "user",
    "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention",
)  # fmt: skip


class ResponsesFormat(BaseModel):
    """`text.format`: free text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # the schema is always enforced, strict or not

    def response_format(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name, "schema": self.schema_, "description": self.description,
                  "strict": self.strict}  # fmt: skip
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items()
                                                        if v is not None}}  # fmt: skip


class TextConfig(BaseModel):
    model_config = _CONFIG

    format: ResponsesFormat | None = None


class ReasoningConfig(BaseModel):
    """`reasoning`: the thinking comes back whole as a reasoning item's content, never
    summarized, whatever `summary` asks."""

    model_config = _CONFIG

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class FunctionTool(BaseModel):
    model_config = _CONFIG

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # forced calls follow the schema, strict or not

    def chat_tool(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


def text_of(value: Any) -> str:
    """Text, or `input_text` / `output_text` parts joined by newlines (an answer's text given
    back may carry its annotations and logprobs, which go nowhere)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError('must be a string or a list of {"type": "input_text", "text": ...} parts')
    texts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text"):
            raise ValueError(f"part {i} must be an input_text or output_text part (text only), "
                             f"got {_what(part, kind)}")  # fmt: skip
        if not isinstance(part.get("text"), str):
            raise ValueError(f'part {i} needs a string "text"')
        texts.append(part["text"])
    return "\n".join(texts)


class MessageItem(BaseModel):
    model_config = _CONFIG

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Any
    id: str | None = None  # an answer's message, given back
    status: str | None = None
    phase: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> str:
        return text_of(value)


class FunctionCallItem(BaseModel):
    model_config = _CONFIG

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = _CONFIG

    type: Literal["function_call_output"]
    call_id: str
    output: Any
    id: str | None = None
    status: str | None = None

    @field_validator("output")
    @classmethod
    def _output(cls, value: Any) -> str:
        return text_of(value)


class ReasoningPart(BaseModel):
    model_config = _CONFIG

    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(BaseModel):
    model_config = _CONFIG

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = []
    content: list[ReasoningPart] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _ours(cls, value: str | None) -> str | None:
        if value is not None:
            decode_reasoning(value)
        return value

    def thinking(self) -> str | None:
        """The thinking it carries: its text, else what `encrypted_content` holds."""
        if self.content:
            return _joined(self.content)
        if self.encrypted_content is not None:
            return decode_reasoning(self.encrypted_content)
        return None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class ResponsesBody(BaseModel):
    """The Responses body's own fields; `input` and `tools` items are checked one by one
    (`read_input`, `read_tools`), and the sampling fields by the chat body they go to."""

    model_config = _CONFIG

    input: Any
    instructions: str | None = None
    max_output_tokens: int | None = None
    text: TextConfig | None = None
    tools: Any = None
    tool_choice: Any = None
    include: list[str] | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled"] | None = None
    stream_options: dict[str, Any] | None = None  # OpenAI's stream obfuscation: nothing to hide
    # passed on to the chat body, which checks them
    model: Any = None
    temperature: Any = None
    top_p: Any = None
    seed: Any = None
    top_k: Any = None
    min_p: Any = None
    min_tokens: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    skip_special_tokens: Any = None
    structured_outputs: Any = None
    chat_template_kwargs: Any = None
    parallel_tool_calls: Any = None
    top_logprobs: Any = None
    stream: Any = None
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None

    def includes(self, value: str) -> bool:
        return value in (self.include or ())


class ItemError(ValueError):
    """An item of `input` or `tools` that does not validate, and where it is (`input[2]`)."""

    def __init__(self, error: ValidationError, path: str) -> None:
        super().__init__(str(error))
        self.error, self.path = error, path


class ResponsesFieldError(ValueError):
    """A Responses field that is refused or wrong: its path (from the body) and why."""

    def __init__(self, param: str, message: str, unsupported: bool = False) -> None:
        super().__init__(message)
        self.param, self.unsupported = param, unsupported


def refused(body: dict[str, Any]) -> ResponsesFieldError | None:
    """The first field of `body` that asks for what Conveyor cannot do, or is not a field of
    the Responses API; None when there is none."""
    for name, why in REFUSED.items():
        if body.get(name) not in (None, False, "", [], {}):
            return ResponsesFieldError(name, f'"body.{name}" is not supported: {why}', True)
    if body.get("truncation") not in (None, _DEFAULTS["truncation"]):
        why = "truncating the input to fit the context is not supported"
        return ResponsesFieldError("truncation", f'"body.truncation" is not supported: {why}', True)
    found = refused_field(body, ResponsesBody.model_fields)
    if found is None:
        return None
    name, reason, unsupported = found
    if unsupported:
        return ResponsesFieldError(name, f'"body.{name}" is not supported: {reason}', True)
    message = f'Unrecognized request argument supplied: "body.{name}" ({reason})'
    return ResponsesFieldError(name, message)


def read_input(value: Any) -> list[InputItem]:
    """`input` as items: a string is one user message. Raises `ResponsesFieldError` or
    `ItemError`."""
    if isinstance(value, str):
        return [MessageItem(type="message", role="user", content=value)]
    if not isinstance(value, list) or not value:
        why = '"body.input" must be a string or a non-empty list of items'
        raise ResponsesFieldError("input", why)
    items = []
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind not in ITEM_TYPES:
            raise ResponsesFieldError(
                f"input[{i}]",
                f'"body.input[{i}]" must be a message, function_call, function_call_output or '
                f"reasoning item, got {_what(item, kind)}",
                unsupported=isinstance(kind, str),
            )
        items.append(_validated(ITEM_TYPES[kind], item, f"input[{i}]"))
    return items


def read_tools(value: Any) -> list[FunctionTool] | None:
    """`tools`: function tools only; a built-in tool is refused, naming it."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ResponsesFieldError("tools", '"body.tools" must be a list of tools')
    tools = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ResponsesFieldError(
                f"tools[{i}]",
                f'"body.tools[{i}]" must be a "function" tool (built-in tools are not run '
                f"here), got {_what(tool, kind)}",
                unsupported=isinstance(kind, str),
            )
        tools.append(_validated(FunctionTool, tool, f"tools[{i}]"))
    return tools


def chat_tool_choice(value: Any) -> Any:
    """`tool_choice` as chat names it: a function is `{"type": "function", "function":
    {"name"}}`; anything but a function or "none", "auto", "required" is refused."""
    if not isinstance(value, dict):
        return value
    if value.get("type") == "function" and set(value) == {"type", "name"}:
        return {"type": "function", "function": {"name": value["name"]}}
    kind = value.get("type")
    raise ResponsesFieldError(
        "tool_choice",
        '"body.tool_choice" must be "none", "auto", "required" or {"type": "function", '
        '"name": ...}, '
        f"got {_what(value, kind)}",
        unsupported=isinstance(kind, str) and kind != "function",
    )


def check_include(body: ResponsesBody) -> None:
    for i, value in enumerate(body.include or ()):
        if value not in INCLUDABLE:
            raise ResponsesFieldError(
                f"include[{i}]",
                f'"body.include[{i}]" {value!r} cannot be filled here: only '
                f"{' and '.join(map(repr, INCLUDABLE))} can",
                unsupported=True,
            )


def chat_messages(body: ResponsesBody, items: list[InputItem]) -> list[dict[str, Any]]:
    """The chat messages of `instructions` and the input items: what an assistant said in a
    row (its thinking, its text, its calls) is one assistant message."""
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    turn: dict[str, Any] | None = None  # the assistant's turn being put together
    for item in items:
        if isinstance(item, MessageItem) and item.role != "assistant":
            messages.append({"role": item.role, "content": item.content})
            turn = None
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            turn = None
        else:
            if turn is None or (isinstance(item, MessageItem | ReasoningItem) and _has_said(turn)):
                turn = {"role": "assistant", "content": None}
                messages.append(turn)
            _add_to_turn(turn, item)
    return messages


def _has_said(turn: dict[str, Any]) -> bool:
    return bool(turn["content"] or turn.get("tool_calls"))


def _add_to_turn(turn: dict[str, Any], item: InputItem) -> None:
    if isinstance(item, ReasoningItem):
        thinking = item.thinking()
        if thinking is not None:
            turn["reasoning_content"] = thinking
    elif isinstance(item, MessageItem):
        turn["content"] = item.content
    elif isinstance(item, FunctionCallItem):
        call = {"id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
        turn.setdefault("tool_calls", []).append(call)


def chat_body(body: ResponsesBody, items: list[InputItem], tools: list[FunctionTool] | None):
    """The chat completion body that answers `body`."""
    chat: dict[str, Any] = {
        name: getattr(body, name) for name in PASSED_ON if getattr(body, name) is not None
    }
    chat["messages"] = chat_messages(body, items)
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.text is not None and body.text.format is not None:
        chat["response_format"] = body.text.format.response_format()
    if tools is not None:
        chat["tools"] = [tool.chat_tool() for tool in tools]
    if body.tool_choice is not None:
        chat["tool_choice"] = chat_tool_choice(body.tool_choice)
    if body.includes(OUTPUT_LOGPROBS):
        chat["logprobs"] = True
    elif body.top_logprobs:
        raise ResponsesFieldError(
            "top_logprobs", f'"body.top_logprobs" needs "body.include": ["{OUTPUT_LOGPROBS}"]'
        )
    effort = body.reasoning.effort if body.reasoning else None
    if effort is not None:
        kwargs = dict(body.chat_template_kwargs or {})
        kwargs.setdefault("reasoning_effort", effort)
        kwargs.setdefault("enable_thinking", effort != "none")
        chat["chat_template_kwargs"] = kwargs
    if body.stream:
        chat["stream_options"] = {"include_usage": True}  # the last event holds the usage
    return chat


# a chat body's field -> the Responses field it came from, for the chat body's errors
_CHAT_TO_RESPONSES = (
    (re.compile(r"^body\.max_completion_tokens"), "body.max_output_tokens"),
    (re.compile(r"^body\.messages(\[\d+\])?"), "body.input"),
    (re.compile(r"^body\.response_format(\.json_schema)?"), "body.text.format"),
    (re.compile(r"^body\.tools(\[\d+\])\.function"), r"body.tools\1"),
    (re.compile(r"^body\.logprobs"), "body.include"),
    (re.compile(r"^body\.stream_options"), "body.stream"),
)


def responses_param(chat_param: str | None) -> str | None:
    """The Responses field a chat body's field came from."""
    if chat_param is None:
        return None
    for pattern, name in _CHAT_TO_RESPONSES:
        if pattern.match(chat_param):
            return pattern.sub(name, chat_param, count=1)
    return chat_param


def responses_message(message: str) -> str:
    """A chat body's error message, its quoted fields named as the Responses body names them."""
    return re.sub(r'"(body\.[^"]*)"', lambda m: f'"{responses_param(m.group(1))}"', message)


# reasoning handed to the client in `encrypted_content`, to come back in a later turn: the
# thinking of an open model is no secret, so it is encoded, not encrypted
_REASONING_PREFIX = "conveyor-reasoning:"


def encode_reasoning(thinking: str) -> str:
    return _REASONING_PREFIX + base64.b64encode(thinking.encode("utf-8")).decode("ascii")


def decode_reasoning(encoded: str) -> str:
    if not encoded.startswith(_REASONING_PREFIX):
        raise ValueError("must be encrypted_content that this server wrote")
    try:
        return base64.b64decode(encoded[len(_REASONING_PREFIX) :], validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise ValueError("must be encrypted_content that this server wrote") from None


def _validated(model_cls: type[BaseModel], value: Any, path: str) -> Any:
    try:
        return model_cls.model_validate(value)
    except ValidationError as err:
        raise ItemError(err, f"body.{path}") from None  # its errors' paths start at the item


def _joined(parts: list[Any]) -> str:
    return "\n".join(part.text for part in parts)


def _what(value: Any, kind: Any) -> str:
    if isinstance(kind, str):
        return f"type {kind!r}"
    return "an object without a type" if isinstance(value, dict) else type(value).__name__


def translate(raw: dict[str, Any]) -> tuple[ResponsesBody, dict[str, Any]]:
    """The Responses body checked, and the chat completion body that answers it. Raises
    `ResponsesFieldError`, `ItemError` or pydantic's `ValidationError`."""
    error = refused(raw)
    if error is not None:
        raise error
    body = ResponsesBody.model_validate(raw)
    check_include(body)
    items = read_input(body.input)
    tools = read_tools(body.tools)
    return body, chat_body(body, items, tools)
