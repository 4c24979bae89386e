"""A streamed Responses API request's typed server-sent events, made from the chat chunks of
the chat completion that answers it (`streaming.ChunkStream`), as OpenAI sends them:

    response.created, response.in_progress
    a reasoning item:  output_item.added, content_part.added, reasoning_text.delta...,
                       reasoning_text.done, content_part.done, output_item.done
    a message item:    output_item.added, content_part.added, output_text.delta...,
                       output_text.done, content_part.done, output_item.done
    a function call:   output_item.added, function_call_arguments.delta...,
                       function_call_arguments.done, output_item.done
    response.completed (or response.incomplete, cut by max_output_tokens), with the usage

Every event has its `sequence_number`. An item is closed when the next one opens or the answer
ends; the last event holds the same Response object a request that does not stream gets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.wire_format.request_line import ParsedRequest
from conveyor.wire_format.response_object import (
    function_call_item,
    item_status,
    message_item,
    reasoning_item,
    response_body,
    text_part,
)
from conveyor.wire_format.responses import new_id
from conveyor.wire_format.streaming import ChunkStream


@dataclass
class _Item:
    """An output item while it streams: what it has said so far."""

    index: int  # in `output`
    id: str
    kind: str  # "reasoning", "message" or "function_call"
    text: str = ""  # the thinking, the text, or a call's arguments
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    call_id: str = ""
    name: str = ""


@dataclass
class ResponseEvents:
    """The events of one streamed request, from its chat chunks as the outputs grow; the
    worker asks it as it asks a `ChunkStream` (`chunks`, then `usage_chunk` at the end)."""

    chat: ChunkStream
    request: ParsedRequest
    sequence: int = 0
    started: bool = False
    closed: dict[int, dict[str, Any]] = field(default_factory=dict)  # output index -> item
    open: list[_Item] = field(default_factory=list)  # in output order
    calls: dict[int, _Item] = field(default_factory=dict)  # chat tool-call index -> item
    kinds: list[str] = field(default_factory=list)  # of the items opened, in order
    finish_reason: str | None = None

    @property
    def response_id(self) -> str:
        return "resp_" + self.chat.response_id.removeprefix("chatcmpl-")

    def chunks(self, prompt: int, output: Any) -> list[dict[str, Any]]:
        """The events for what `output` (the engine's output so far) adds."""
        events = [] if self.started else self._start()
        self.started = True
        for chunk in self.chat.chunks(prompt, output):
            for choice in chunk["choices"]:
                events += self._choice(choice)
        return events

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last event: the whole Response, with the chat completion's `usage`."""
        status = item_status(self.finish_reason)
        output = [self.closed[i] for i in sorted(self.closed)]
        return self._event(f"response.{status}", response=self._response(status, output, usage))

    def _start(self) -> list[dict[str, Any]]:
        response = self._response("in_progress", [])
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def _response(self, status: str, output: list, usage: dict | None = None) -> dict[str, Any]:
        return response_body(
            self.request,
            response_id=self.response_id,
            created_at=self.chat.created,
            model=self.chat.model,
            output=output,
            status=status,
            usage=usage,
        )

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _choice(self, choice: dict[str, Any]) -> list[dict[str, Any]]:
        delta, events = choice.get("delta") or {}, []
        if delta.get("reasoning"):
            events += self._add("reasoning", delta["reasoning"])
        if delta.get("content"):
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            events += self._add("message", delta["content"], logprobs)
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            if "message" not in self.kinds and "function_call" not in self.kinds:
                events += self._opened("message")  # an empty answer is an empty message
            for item in list(self.open):
                events += self._close(item)
        return events

    def _add(self, kind: str, text: str, logprobs: list | None = None) -> list[dict[str, Any]]:
        """Events for more thinking or text: the item opened first (the ones before it
        closed) when it is not the last one open."""
        events = []
        item = self.open[-1] if self.open and self.open[-1].kind == kind else None
        if item is None:
            for other in list(self.open):
                events += self._close(other)
            events += self._opened(kind)
            item = self.open[-1]
        item.text += text
        item.logprobs += logprobs or []
        where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if kind == "reasoning":
            return [*events, self._event("response.reasoning_text.delta", **where, delta=text)]
        delta = self._event(
            "response.output_text.delta", **where, delta=text, logprobs=logprobs or []
        )
        return [*events, delta]

    def _opened(self, kind: str, call_id: str = "", name: str = "") -> list[dict[str, Any]]:
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = _Item(len(self.kinds), f"{prefix}_{new_id()}", kind, call_id=call_id, name=name)
        self.kinds.append(kind)
        self.open.append(item)
        if kind == "function_call":
            added = {**function_call_item(call_id, name, "", item.id), "status": "in_progress"}
            return [self._event("response.output_item.added", output_index=item.index, item=added)]
        where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if kind == "reasoning":
            added = {"id": item.id, "type": "reasoning", "summary": [], "content": [],
                     "status": "in_progress"}  # fmt: skip
            part = {"type": "reasoning_text", "text": ""}
        else:
            added = {**message_item("", "in_progress", item_id=item.id), "content": []}
            part = text_part("")
        return [
            self._event("response.output_item.added", output_index=item.index, item=added),
            self._event("response.content_part.added", **where, part=part),
        ]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """Events for a chat tool-call delta: a new call (it has an id) opens its item, after
        closing the text before it; more arguments are a delta of it."""
        events = []
        function = call.get("function") or {}
        if call.get("id") is not None:
            for other in [i for i in self.open if i.kind != "function_call"]:
                events += self._close(other)
            events += self._opened("function_call", call["id"], function.get("name") or "")
            self.calls[call["index"]] = self.open[-1]
        item, arguments = self.calls[call["index"]], function.get("arguments") or ""
        if arguments:
            item.text += arguments
            where = {"item_id": item.id, "output_index": item.index}
            events.append(
                self._event("response.function_call_arguments.delta", **where, delta=arguments)
            )
        return events

    def _close(self, item: _Item) -> list[dict[str, Any]]:
        self.open.remove(item)
        status = item_status(self.finish_reason)
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            done = function_call_item(item.call_id, item.name, item.text, item.id)
            events = [
                self._event("response.function_call_arguments.done", **where, arguments=item.text)
            ]
        elif item.kind == "reasoning":
            done = reasoning_item(item.text, status, self.request.responses, item.id)
            part = {"type": "reasoning_text", "text": item.text}
            events = [
                self._event(
                    "response.reasoning_text.done", **where, content_index=0, text=item.text
                ),  # fmt: skip
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ]
        else:
            done = message_item(item.text, status, item.logprobs, item.id)
            part = text_part(item.text, item.logprobs)
            events = [
                self._event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=item.text,
                    logprobs=item.logprobs,
                ),  # fmt: skip
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ]
        self.closed[item.index] = done
        done_event = self._event("response.output_item.done", output_index=item.index, item=done)
        return [*events, done_event]
