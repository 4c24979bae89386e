"""How a chat's answer is read for tool calls, by its `tool_choice`:

- "auto": the server's tool-call parser (`tool_calls.PARSERS`) finds the calls the model wrote,
  and the text before them is content (null where there is none); `finish_reason` is
  "tool_calls" when it found one;
- "required": the answer is the JSON array the grammar forced (`tools.forced_schema`), every
  item a call; content "", `finish_reason` "tool_calls";
- a named function: the answer is that function's arguments, forced by the grammar; content "",
  the engine's `finish_reason` ("stop"), as vLLM answers.

With `parallel_tool_calls: false`, an answer gives at most one call. An answer that does not
read as calls is all content, with the engine's `finish_reason`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from conveyor.wire_format.tool_calls import (
    MalformedCall,
    ToolCall,
    ToolCallParser,
    call_from_json,
    decode_json,
)


@dataclass(frozen=True)
class ToolAnswer:
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(frozen=True)
class ToolUse:
    choice: Literal["auto", "required", "named"]
    name: str | None = None  # the named function
    parallel: bool = True  # False: at most one call (`parallel_tool_calls: false`)
    parser: ToolCallParser | None = None  # "auto": the server's `--tool-call-parser`

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def content_so_far(self, answer: str, finished: bool) -> str:
        """The content of a growing answer that no later token can change: up to where a call
        may begin, once it holds more than whitespace (forced calls have none)."""
        if self.forced or self.parser is None:
            return ""
        start = self.parser.call_start(answer, finished)
        content = answer if start is None else answer[:start]
        return content if content.strip() else ""

    def read(self, answer: str, finish_reason: str | None) -> ToolAnswer:
        """The content, calls and finish reason of a whole answer."""
        if self.choice == "named":
            assert self.name is not None
            calls = [ToolCall(self.name, answer)] if answer else []
            return ToolAnswer("", calls, finish_reason)
        if self.choice == "required":
            try:
                calls = _forced_calls(answer)
            except MalformedCall:
                return ToolAnswer(answer, [], finish_reason)
            return ToolAnswer("", self._allowed(calls), "tool_calls")
        assert self.parser is not None
        content, calls = self.parser.parse(answer)
        if not calls:
            return ToolAnswer(answer, [], finish_reason)
        return ToolAnswer(content, self._allowed(calls), "tool_calls")

    def _allowed(self, calls: list[ToolCall]) -> list[ToolCall]:
        return calls if self.parallel else calls[:1]


def _forced_calls(answer: str) -> list[ToolCall]:
    """The calls of a "required" answer: `[{"name": ..., "parameters": {...}}, ...]` (or
    "arguments", as a model told of OpenAI's shape may write)."""
    items = decode_json(answer)
    if not isinstance(items, list) or not items:
        raise MalformedCall("not a list of calls")
    return [call_from_json(item, "parameters", "arguments") for item in items]
