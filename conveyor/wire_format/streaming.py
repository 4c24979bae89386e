"""Streamed answers of online requests: OpenAI's `chat.completion.chunk` and streamed
`text_completion` objects, made from the engine's output so far, one step at a time.

Text is sent as it becomes final: the tail that a stop string could still take back, and an
unfinished UTF-8 character (decoded as U+FFFD), wait for the next step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from conveyor.wire_format.request_line import ParsedRequest
from conveyor.wire_format.responses import chat_logprobs, completion_logprobs, new_id
from conveyor.wire_format.token_text import TokenDecoder


@dataclass
class _Sent:
    tokens: int = 0
    chars: int = 0  # of the text (of the answer, where the thinking is split from it)
    thinking: int = 0  # chars of the thinking
    started: bool = False


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
            new_text = text[sent.chars :]
            new_ids = (
                list(comp.token_ids[sent.tokens :]) if finished or new_text or thinking else []
            )
            new_lps = list((comp.logprobs or [])[sent.tokens : sent.tokens + len(new_ids)])
            if not sent.started:
                chunks.append(self._first(index, request, output))
                sent.started = True
            if new_text or new_ids:
                chunks.append(self._delta(index, request, new_text, new_ids, new_lps, thinking))
                sent.chars, sent.tokens = len(text), sent.tokens + len(new_ids)
                sent.thinking += len(thinking)
            if finished:
                chunks.append(self._end(index, comp.finish_reason))
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

    def _delta(
        self,
        index: int,
        request: ParsedRequest,
        text: str,
        ids: list[int],
        lps: list,
        thinking: str = "",
    ) -> dict[str, Any]:
        if self.chat:
            logprobs = None
            if request.top_logprobs is not None:
                logprobs = chat_logprobs(ids, lps, request.top_logprobs, self.decoder)
            delta: dict[str, Any] = {}
            if thinking:  # both names, as in the whole message
                delta["reasoning_content"] = delta["reasoning"] = thinking
            if text or not thinking:
                delta["content"] = text
            return self._choice(index, delta=delta, logprobs=logprobs, finish_reason=None)
        logprobs = None
        if "logprobs" in request.sampling:
            logprobs = completion_logprobs(ids, lps + [None] * (len(ids) - len(lps)), self.decoder)
        return self._choice(index, text=text, logprobs=logprobs, finish_reason=None)

    def _end(self, index: int, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            return self._choice(index, delta={}, logprobs=None, finish_reason=finish_reason)
        return self._choice(index, text="", logprobs=None, finish_reason=finish_reason)


def _final_part(text: str, request: ParsedRequest) -> str:
    """The part of a growing text that no later step can change."""
    stops = request.sampling.get("stop") or []
    hold = max((len(s) for s in stops), default=1) - 1
    if hold > 0:
        text = text[:-hold] if len(text) > hold else ""
    return text.rstrip("\ufffd")
