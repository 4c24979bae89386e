"""The Response object of OpenAI's Responses API (`"object": "response"`), made from the chat
completion that answered the request: the thinking becomes a `reasoning` item, the content a
`message` item of `output_text`, each tool call a `function_call` item, and a completion cut by
its token limit is `"status": "incomplete"`. Streamed, the same items are put together from the
chat chunks (`response_events.py`) and end in the same object."""

from __future__ import annotations

from typing import Any

from conveyor.wire_format.request_line import ParsedRequest
from conveyor.wire_format.responses import new_id
from conveyor.wire_format.responses_body import (
    ENCRYPTED_REASONING,
    ResponsesBody,
    encode_reasoning,
)

# what a Response echoes of its request when the request left it out
_ECHOED_DEFAULTS: dict[str, Any] = {
    "instructions": None,
    "max_output_tokens": None,
    "metadata": {},
    "parallel_tool_calls": True,
    "reasoning": None,
    "service_tier": None,
    "store": True,
    "temperature": None,
    "top_logprobs": None,
    "top_p": None,
    "user": None,
    "safety_identifier": None,
    "prompt_cache_key": None,
}


def item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def reasoning_item(thinking: str, status: str, body: ResponsesBody, item_id: str = "") -> dict:
    item: dict[str, Any] = {
        "id": item_id or f"rs_{new_id()}",
        "type": "reasoning",
        "summary": [],  # the thinking is given whole, never summarized
        "content": [{"type": "reasoning_text", "text": thinking}],
        "status": status,
    }
    if body.includes(ENCRYPTED_REASONING):
        item["encrypted_content"] = encode_reasoning(thinking)
    return item


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(text: str, status: str, logprobs: list | None = None, item_id: str = "") -> dict:
    return {
        "id": item_id or f"msg_{new_id()}",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [text_part(text, logprobs)],
    }


def function_call_item(call_id: str, name: str, arguments: str, item_id: str = "") -> dict:
    return {
        "id": item_id or f"fc_{new_id()}",
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def output_items(choice: dict[str, Any], body: ResponsesBody) -> list[dict[str, Any]]:
    """The output items of a chat completion's choice."""
    message, status = choice["message"], item_status(choice["finish_reason"])
    items = []
    thinking = message.get("reasoning")
    if thinking is not None:
        items.append(reasoning_item(thinking, status, body))
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if content is not None and (content or not calls):
        logprobs = (choice.get("logprobs") or {}).get("content")
        items.append(message_item(content, status, logprobs))
    for call in calls:
        function = call["function"]
        items.append(function_call_item(call["id"], function["name"], function["arguments"]))
    return items


def response_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A chat completion's usage, as a Response counts it."""
    details = usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": usage["prompt_tokens"],
        # no tokens are written to a cache on request: the prefix cache keeps what it can
        "input_tokens_details": {
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
        "total_tokens": usage["total_tokens"],
    }


def response_body(
    request: ParsedRequest,
    *,
    response_id: str,
    created_at: int,
    model: str,
    output: list[dict[str, Any]],
    status: str,
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A Response object: its status ("in_progress", "completed" or "incomplete"), output
    items and usage (a chat completion's), and what it echoes of its request."""
    body = request.responses
    assert body is not None
    sent = body.model_dump(by_alias=True)
    echoed = {name: default if sent[name] is None else sent[name]
              for name, default in _ECHOED_DEFAULTS.items()}  # fmt: skip
    text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": output,
        **echoed,
        "previous_response_id": None,
        "text": {"format": {"type": "text"}, **text},
        "tool_choice": body.tool_choice or "auto",
        "tools": sent["tools"] or [],
        "truncation": "disabled",
        "usage": None if usage is None else response_usage(usage),
    }


def response_from_chat(request: ParsedRequest, chat: dict[str, Any]) -> dict[str, Any]:
    """The Response object of a request, from the chat completion that answered it."""
    (choice,) = chat["choices"]
    return response_body(
        request,
        response_id="resp_" + chat["id"].removeprefix("chatcmpl-"),
        created_at=chat["created"],
        model=chat["model"],
        output=output_items(choice, request.responses),
        status="incomplete" if choice["finish_reason"] == "length" else "completed",
        usage=chat["usage"],
    )
