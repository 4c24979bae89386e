"""A chat's tools as its body gives them (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`,
and the calls and results of earlier turns in `messages`), and the JSON schema that forces a
call where `tool_choice` asks for one, as vLLM builds it:

- a named function: the output is that function's arguments object;
- "required": the output is a JSON array of `{"name": ..., "parameters": {...}}` objects, one
  of the tools each (at most one when `parallel_tool_calls` is false), with no other keys.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from conveyor.wire_format.errors import describe

_CONFIG = ConfigDict(extra="forbid", strict=True, frozen=True)
TOOL_CHOICES = ("none", "auto", "required")
_CHOICES_TEXT = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
# a function without parameters takes an empty object
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class FunctionDefinition(BaseModel):
    model_config = _CONFIG

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # forced calls follow the schema, strict or not


class Tool(BaseModel):
    model_config = _CONFIG

    type: Literal["function"]
    function: FunctionDefinition

    @model_validator(mode="before")
    @classmethod
    def _function_only(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(value, dict) and kind != "function":
            raise ValueError(
                f'must be a "function" tool (the only type supported), got type {describe(kind)}'
            )
        return value

    def schema(self) -> dict[str, Any]:
        return self.function.parameters or NO_PARAMETERS


class ChosenFunction(BaseModel):
    model_config = _CONFIG

    name: str


class NamedToolChoice(BaseModel):
    model_config = _CONFIG

    type: Literal["function"]
    function: ChosenFunction


def check_tool_choice(value: Any, tools: list[Tool] | None) -> str | NamedToolChoice | None:
    """`tool_choice` as the body gives it, checked against its `tools`."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise ValueError(f"must be {_CHOICES_TEXT}, got {describe(value)}")
        choice: str | NamedToolChoice = value
    else:
        try:
            choice = NamedToolChoice.model_validate(value)
        except ValidationError:
            raise ValueError(f"must be {_CHOICES_TEXT}, got {describe(value)}") from None
    if choice not in ("none", "auto") and not tools:
        raise ValueError(f'needs "tools" to call, got {describe(value)} and no tools')
    if isinstance(choice, NamedToolChoice):
        named = choice.function.name
        if all(tool.function.name != named for tool in tools or ()):
            raise ValueError(f'must name a function of "tools", got {describe(named)}')
    return choice


def forced_tools(tools: list[Tool], choice: str | NamedToolChoice | None) -> list[tuple[int, Tool]]:
    """The tools (and their places in `tools`) a forced choice may call: all of them for
    "required", the named one for a named function, none otherwise."""
    if choice == "required":
        return list(enumerate(tools))
    if isinstance(choice, NamedToolChoice):
        return [
            next((i, t) for i, t in enumerate(tools) if t.function.name == choice.function.name)
        ]
    return []


def forced_schema(
    tools: list[Tool], choice: str | NamedToolChoice | None, parallel: bool
) -> dict[str, Any] | None:
    """The JSON schema the output must follow, where `choice` forces a call (vLLM's)."""
    if isinstance(choice, NamedToolChoice):
        return forced_tools(tools, choice)[0][1].schema()
    if choice != "required":
        return None
    calls: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [tool.function.name]},
                        "parameters": tool.schema(),
                    },
                    "required": ["name", "parameters"],
                    # a call is these two alone (xgrammar, vLLM's default, reads the schema so)
                    "additionalProperties": False,
                }
                for tool in tools
            ],
        },
    }
    if not parallel:
        calls["maxItems"] = 1
    return calls


def grammar_error(schema: dict[str, Any]) -> str | None:
    """Why the grammar engine cannot compile `schema` as a constraint, None if it can."""
    return _grammar_error(json.dumps(schema, sort_keys=True))


@lru_cache(maxsize=256)  # a batch repeats the same tools on every line
def _grammar_error(schema: str) -> str | None:
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
    except (ValueError, RuntimeError) as err:
        return str(err)
    return LLMatcher.validate_grammar(grammar) or None


class CalledFunction(BaseModel):
    model_config = _CONFIG

    name: str
    arguments: Any = None  # OpenAI sends JSON text; given to templates as an object

    @field_validator("arguments")
    @classmethod
    def _arguments(cls, value: Any) -> dict[str, Any]:
        """The arguments as an object, as chat templates expect them (vLLM parses them too)."""
        if value is None or value == "":
            return {}
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError(f"must be a JSON object, got {describe(value)}") from None
        if not isinstance(value, dict):
            raise ValueError(f"must be a JSON object, got {describe(value)}")
        return value


class MessageToolCall(BaseModel):
    """A call an assistant message made, given back in the conversation."""

    model_config = _CONFIG

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction
