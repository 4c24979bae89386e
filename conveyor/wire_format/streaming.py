"""Streamed answers of online requests: OpenAI's `chat.completion.chunk` and streamed
`text_completion` objects, made from the engine's output so far, one step at a time.

Text is sent as it becomes final: the tail that a stop string could still take back, and an
unfinished UTF-8 character (decoded as U+FFFD), wait for the next step. Where a chat's answer is
read for tool calls, a call goes out whole once the answer is (`delta.tool_calls`, its id, name
and arguments), the content before it as soon as no call can begin in it, and a named
function's arguments as they come.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from conveyor.wire_format.request_line import ParsedRequest
from conveyor.wire_format.responses import (
    chat_logprobs,
    completion_logprobs,
    new_id,
    tool_call_dicts,
)
from conveyor.wire_format.token_text import TokenDecoder
from conveyor.wire_format.tool_calls import ToolCall
from conveyor.wire_format.tool_use import ToolUse


@dataclass
class _Sent:
    tokens: int = 0
    chars: int = 0  # of the text (of the answer, where the thinking is split from it)
    thinking: int = 0  # chars of the thinking
    started: bool = False
    arguments: int | None = None  # chars of a named function's arguments; None: no call yet


@dataclass
class ChunkStream:
    """The chunks of one online request (all its prompts and samples), as its outputs grow."""

    requests: list[ParsedRequest]  # one per prompt, in order
    n: int
    model: str
    decoder: TokenDecoder
    chat: bool
    response_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    sent: dict[int, _Sent] = field(default_factory=dict)  # choice index -> what went out

    def __post_init__(self) -> None:
        self.response_id = self.response_id or (
            f"chatcmpl-{new_id()}" if self.chat else f"cmpl-{new_id()}"
        )

    def chunks(self, prompt: int, output: Any) -> list[dict[str, Any]]:
        """The chunks for what `output` (the engine's output so far for prompt number
        `prompt`) adds to what was sent."""
        request = self.requests[prompt]
        chunks = []
        for comp in sorted(output.outputs, key=lambda c: c.index):
            index = prompt * self.n + comp.index
            sent = self.sent.setdefault(index, _Sent())
            finished = output.finished or comp.finish_reason is not None
            text = comp.text if finished else _final_part(comp.text, request)
            thinking = ""
            if self.chat and request.reasoning is not None:
                split, text = request.reasoning.split(text, finished)
                thinking = (split or "")[sent.thinking :]
            calls, finish_reason = [], comp.finish_reason
            if self.chat and request.tool_use is not None:
                text, calls, finish_reason = _tool_part(
                    request.tool_use, sent, text, finished, finish_reason
                )
            new_text = text[sent.chars :]
            more = finished or new_text or thinking or calls
            new_ids = list(comp.token_ids[sent.tokens :]) if more else []
            new_lps = list((comp.logprobs or [])[sent.tokens : sent.tokens + len(new_ids)])
            if not sent.started:
                chunks.append(self._first(index, request, output))
                sent.started = True
            if new_text or new_ids or calls:
                delta = _Delta(new_text, new_ids, new_lps, thinking, calls)
                chunks.append(self._delta(index, request, delta))
                sent.chars, sent.tokens = len(text), sent.tokens + len(new_ids)
                sent.thinking += len(thinking)
            if finished:
                chunks.append(self._end(index, finish_reason))
        return chunks

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(), "choices": [], "usage": usage}

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def _choice(self, index: int, **fields: Any) -> dict[str, Any]:
        return {**self._head(), "choices": [{"index": index, **fields}]}

    def _first(self, index: int, request: ParsedRequest, output: Any) -> dict[str, Any]:
        """A chat's first chunk names the role; an echoing completion's holds the prompt."""
        if self.chat:
            delta = {"role": "assistant", "content": ""}
            return self._choice(index, delta=delta, logprobs=None, finish_reason=None)
        text, logprobs = "", None
        if request.echo:
            ids = list(output.prompt_token_ids or [])
            text = request.prompt if isinstance(request.prompt, str) else self.decoder.decode(ids)
            if "logprobs" in request.sampling:
                lps: list[Mapping[int, float] | None] = list(output.prompt_logprobs or [])
                lps += [None] * (len(ids) - len(lps))
                logprobs = completion_logprobs(ids, lps[: len(ids)], self.decoder)
        return self._choice(index, text=text, logprobs=logprobs, finish_reason=None)

    def _delta(self, index: int, request: ParsedRequest, new: _Delta) -> dict[str, Any]:
        ids, lps = new.ids, new.lps
        if self.chat:
            logprobs = None
            if request.top_logprobs is not None:
                logprobs = chat_logprobs(ids, lps, request.top_logprobs, self.decoder)
            delta: dict[str, Any] = {}
            if new.thinking:  # both names, as in the whole message
                delta["reasoning_content"] = delta["reasoning"] = new.thinking
            if new.text or not (new.thinking or new.calls):
                delta["content"] = new.text
            if new.calls:
                delta["tool_calls"] = new.calls
            return self._choice(index, delta=delta, logprobs=logprobs, finish_reason=None)
        logprobs = None
        if "logprobs" in request.sampling:
            logprobs = completion_logprobs(ids, lps + [None] * (len(ids) - len(lps)), self.decoder)
        return self._choice(index, text=new.text, logprobs=logprobs, finish_reason=None)

    def _end(self, index: int, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            return self._choice(index, delta={}, logprobs=None, finish_reason=finish_reason)
        return self._choice(index, text="", logprobs=None, finish_reason=finish_reason)


@dataclass
class _Delta:
    """What one chunk of a choice adds."""

    text: str
    ids: list[int]
    lps: list
    thinking: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # `delta.tool_calls`


def _tool_part(
    use: ToolUse, sent: _Sent, answer: str, finished: bool, finish_reason: str | None
) -> tuple[str, list[dict[str, Any]], str | None]:
    """The content that may go out by now, the tool call deltas to send and the finish reason,
    of an answer read for tool calls. A named function's arguments stream as they come (its
    header first); other calls go out whole once the answer is, and the content before them
    as soon as no call can begin in it."""
    if use.choice == "named":
        new, opened = answer[sent.arguments or 0 :], sent.arguments is not None
        if not new:
            return "", [], finish_reason
        sent.arguments = len(answer)
        if opened:
            return "", [{"index": 0, "function": {"arguments": new}}], finish_reason
        (call,) = tool_call_dicts([ToolCall(use.name or "", new)], use)
        return "", [{"index": 0, **call}], finish_reason
    if not finished:
        return use.content_so_far(answer, finished), [], finish_reason
    read = use.read(answer, finish_reason)
    calls = [{"index": i, **call} for i, call in enumerate(tool_call_dicts(read.calls, use))]
    return read.content or "", calls, read.finish_reason


def _final_part(text: str, request: ParsedRequest) -> str:
    """The part of a growing text that no later step can change: a stop string that a later
    step completes takes back its start, unless the text keeps stop strings."""
    stops = request.sampling.get("stop") or []
    if request.sampling.get("include_stop_str_in_output"):
        stops = []
    hold = max((len(s) for s in stops), default=1) - 1
    if hold > 0:
        text = text[:-hold] if len(text) > hold else ""
    return text.rstrip("\ufffd")
