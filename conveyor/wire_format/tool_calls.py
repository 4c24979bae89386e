"""Tool calls in a model's answer, read as its family writes them: `--tool-call-parser` names the
format, and a chat whose `tool_choice` is "auto" gets the calls in `message.tool_calls`.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, a block per call
                 (Qwen2.5, Qwen3, Hermes); text before the first block is content
    llama3_json  an answer that is calls alone (Llama 3.1-3.3): `<|python_tag|>` optional, then
                 {"name": ..., "parameters": {...}} objects separated by `;`
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (older tokenizers) or
                 [TOOL_CALLS]name[ARGS]{...} per call (v11 and later); text before is content

Text that starts like a call but is not one (JSON that does not parse, a block never closed, a
call without a name or an object of arguments) is all content, as vLLM answers: never an error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class MalformedCall(ValueError):
    """Text after a call's marker that is not a call."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text, as OpenAI's `function.arguments`


@dataclass(frozen=True)
class ToolCallParser:
    name: str
    markers: tuple[str, ...]  # what opens the calls
    read_calls: Callable[[str], list[ToolCall]]  # the text from a marker on; raises MalformedCall
    at_start_only: bool = False  # the calls are the whole answer (llama3_json)
    # Mistral's templates refuse a call id other than 9 letters and digits
    short_ids: bool = False
    # its marker is a special token, which decoding would otherwise drop
    keeps_special_tokens: bool = False

    def call_start(self, text: str, finished: bool = True) -> int | None:
        """Where the calls (may) begin in `text`, None where it holds none. Of a text still
        growing (`finished` False), a tail that may become a marker counts as a beginning."""
        if self.at_start_only:
            head = text.lstrip()
            opens = head.startswith(self.markers) or (
                not finished and any(m.startswith(head) for m in self.markers)
            )
            return len(text) - len(head) if opens else None
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        if found:
            return min(found)
        if not finished:
            for n in range(min(max(map(len, self.markers)) - 1, len(text)), 0, -1):
                if any(m.startswith(text[-n:]) for m in self.markers):
                    return len(text) - n
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer: the content is the text before the calls (None
        when there is none but whitespace); an answer whose calls are malformed is all content."""
        start = self.call_start(text)
        if start is None:
            return text, []
        try:
            calls = self.read_calls(text[start:])
        except MalformedCall:
            return text, []
        if not calls:
            return text, []
        content = text[:start]
        return (content if content.strip() else None), calls


def decode_json(text: str) -> Any:
    """`text` decoded, or `MalformedCall`."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:
        raise MalformedCall(f"not JSON: {err}") from None


def call_from_json(obj: Any, *argument_keys: str) -> ToolCall:
    """A call from its decoded JSON: a name and an object of arguments under one of
    `argument_keys`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise MalformedCall("a call needs a name")
    arguments = next((obj[k] for k in argument_keys if k in obj), None)
    if not isinstance(arguments, dict):
        raise MalformedCall("a call's arguments must be an object")
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


_HERMES_BLOCK = re.compile(r"\s*<tool_call>(.*?)</tool_call>\s*", re.DOTALL)


def _hermes_calls(text: str) -> list[ToolCall]:
    calls, at = [], 0
    while at < len(text):
        block = _HERMES_BLOCK.match(text, at)
        if block is None:  # a block never closed, or text after the calls
            raise MalformedCall("not a <tool_call> block")
        calls.append(call_from_json(decode_json(block.group(1)), "arguments"))
        at = block.end()
    return calls


PYTHON_TAG = "<|python_tag|>"


def _llama3_calls(text: str) -> list[ToolCall]:
    text = text.removeprefix(PYTHON_TAG)
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        at = len(text) - len(text[at:].lstrip())
        try:
            obj, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            raise MalformedCall("not a JSON call") from None
        calls.append(call_from_json(obj, "parameters", "arguments"))
        rest = text[at:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            raise MalformedCall("calls are separated by ';'")
        at = len(text) - len(rest) + 1


TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


def _mistral_calls(text: str) -> list[ToolCall]:
    pieces = text.split(TOOL_CALLS)[1:]
    if len(pieces) == 1 and pieces[0].lstrip().startswith("["):
        calls = decode_json(pieces[0])
        if not isinstance(calls, list):
            raise MalformedCall("[TOOL_CALLS] is followed by a list of calls")
        return [call_from_json(call, "arguments") for call in calls]
    found = []
    for piece in pieces:
        name, args, arguments = piece.partition(ARGS)
        if not args or not name.strip():
            raise MalformedCall("a call is name[ARGS]{...}")
        found.append(
            call_from_json({"name": name.strip(), "arguments": decode_json(arguments)}, "arguments")
        )
    return found


PARSERS = {
    "hermes": ToolCallParser("hermes", ("<tool_call>",), _hermes_calls),
    "llama3_json": ToolCallParser(
        "llama3_json", (PYTHON_TAG, "{"), _llama3_calls, at_start_only=True
    ),
    "mistral": ToolCallParser(
        "mistral", (TOOL_CALLS,), _mistral_calls, short_ids=True, keeps_special_tokens=True
    ),
}
