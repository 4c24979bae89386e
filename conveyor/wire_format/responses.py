"""The completion objects of result lines (`chat.completion`, `text_completion`), built from the
engine's outputs, taken duck-typed (`RequestOutput` / `CompletionOutput` attributes)."""

from __future__ import annotations

import random
import string
import time
from collections.abc import Mapping, Sequence
from typing import Any

from conveyor.wire_format.reasoning import reasoning_tokens
from conveyor.wire_format.request_line import ParsedRequest
from conveyor.wire_format.token_text import TokenDecoder
from conveyor.wire_format.tool_calls import ToolCall
from conveyor.wire_format.tool_use import ToolUse

_ids = random.Random()  # seeded from os.urandom once; ids need to be unique, not secret
_ID_CHARACTERS = string.ascii_letters + string.digits


def new_id() -> str:
    """128 random bits in hex: the ids of completion objects and result lines."""
    return f"{_ids.getrandbits(128):032x}"


def tool_call_id(use: ToolUse) -> str:
    """A new tool call's id: vLLM's shape, or 9 letters and digits for a parser whose model's
    templates refuse any other (Mistral's)."""
    if use.parser is not None and use.parser.short_ids:
        return "".join(_ids.choice(_ID_CHARACTERS) for _ in range(9))
    return f"chatcmpl-tool-{new_id()}"


def tool_call_dicts(calls: Sequence[ToolCall], use: ToolUse) -> list[dict[str, Any]]:
    """`message.tool_calls`: each call with a new id, its arguments as JSON text."""
    return [
        {
            "id": tool_call_id(use),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in calls
    ]


def _sorted_alternatives(entry: Mapping[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)


def _logprob_value(value: float) -> float:
    # JSON has no -inf or NaN; OpenAI uses -9999.0 for "very unlikely".
    value = float(value)
    return value if value >= -9999.0 else -9999.0


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[Mapping[int, float]] | None,
    top_logprobs: int,
    decoder: TokenDecoder,
) -> dict[str, Any] | None:
    """`choices[i].logprobs` of a chat completion."""
    if logprobs is None:
        return None
    content = []
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        lp = entry.get(token_id)
        alternatives = _sorted_alternatives(entry)[:top_logprobs]
        content.append(
            {
                "token": decoder.text(token_id),
                "logprob": _logprob_value(lp if lp is not None else -9999.0),
                "bytes": decoder.bytes(token_id),
                "top_logprobs": [
                    {
                        "token": decoder.text(alt),
                        "logprob": _logprob_value(alt_lp),
                        "bytes": decoder.bytes(alt),
                    }
                    for alt, alt_lp in alternatives
                ],
            }
        )
    return {"content": content, "refusal": None}


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[Mapping[int, float] | None],
    decoder: TokenDecoder,
    text_offset_start: int = 0,
) -> dict[str, Any]:
    """Legacy completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset.

    `top_logprobs[i]` holds the requested alternatives plus the chosen token (so up to
    `logprobs + 1` entries, as OpenAI documents); a `None` entry (the first prompt token with
    `echo`) gives `None` values.
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset_start
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        text = decoder.text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        lp = entry.get(token_id)
        token_logprobs.append(_logprob_value(lp) if lp is not None else None)
        alternatives: dict[str, float] = {}
        for alt, alt_lp in _sorted_alternatives(entry):
            alternatives.setdefault(decoder.text(alt), _logprob_value(alt_lp))
        top.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _usage(output: Any, completion_tokens: int) -> dict[str, Any]:
    prompt_tokens = len(output.prompt_token_ids or [])
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": int(getattr(output, "num_cached_tokens", 0))},
    }


def chat_completion_body(
    request: ParsedRequest,
    output: Any,
    model: str,
    decoder: TokenDecoder,
    created: int | None = None,
) -> dict[str, Any]:
    """A `chat.completion` object from an engine `RequestOutput`."""
    choices = []
    completion_tokens = thinking_tokens = 0
    for comp in sorted(output.outputs, key=lambda c: c.index):
        completion_tokens += len(comp.token_ids)
        logprobs = None
        if request.top_logprobs is not None:
            logprobs = chat_logprobs(comp.token_ids, comp.logprobs, request.top_logprobs, decoder)
        message: dict[str, Any] = {"role": "assistant", "content": comp.text, "refusal": None}
        finish_reason = comp.finish_reason
        if request.reasoning is not None:
            thinking, message["content"] = request.reasoning.split(comp.text)
            # both names: vLLM's newest server says `reasoning`, SGLang `reasoning_content`
            message["reasoning_content"] = message["reasoning"] = thinking
            thinking_tokens += reasoning_tokens(
                request.reasoning, comp.token_ids, decoder.tokenizer, thinking
            )
        if request.tool_use is not None:
            answer = request.tool_use.read(message["content"], finish_reason)
            message["content"], finish_reason = answer.content, answer.finish_reason
            if answer.calls:
                message["tool_calls"] = tool_call_dicts(answer.calls, request.tool_use)
        choices.append(
            {
                "index": comp.index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        )
    usage = _usage(output, completion_tokens)
    if request.reasoning is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": thinking_tokens}
    return {
        "id": f"chatcmpl-{new_id()}",
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": None,
    }


def text_completion_body(
    request: ParsedRequest,
    output: Any,
    model: str,
    decoder: TokenDecoder,
    created: int | None = None,
) -> dict[str, Any]:
    """A `text_completion` object from an engine `RequestOutput`."""
    want_logprobs = "logprobs" in request.sampling
    prompt_ids = list(output.prompt_token_ids or [])
    prompt_text = ""
    if request.echo:
        if isinstance(request.prompt, str):
            prompt_text = request.prompt
        elif output.prompt is not None:
            prompt_text = output.prompt
        else:
            prompt_text = decoder.decode(prompt_ids)

    choices = []
    completion_tokens = 0
    for comp in sorted(output.outputs, key=lambda c: c.index):
        gen_ids = [] if request.drop_generation else list(comp.token_ids)
        gen_text = "" if request.drop_generation else comp.text
        gen_lps = [] if request.drop_generation else list(comp.logprobs or [])
        completion_tokens += len(gen_ids)
        logprobs = None
        if want_logprobs:
            ids: list[int] = []
            lps: list[Mapping[int, float] | None] = []
            if request.echo:
                prompt_lps = list(output.prompt_logprobs or [])
                prompt_lps += [None] * (len(prompt_ids) - len(prompt_lps))
                ids += prompt_ids
                lps += prompt_lps[: len(prompt_ids)]
            ids += gen_ids
            lps += gen_lps + [None] * (len(gen_ids) - len(gen_lps))
            logprobs = completion_logprobs(ids, lps, decoder)
        choices.append(
            {
                "index": comp.index,
                "text": prompt_text + gen_text,
                "logprobs": logprobs,
                "finish_reason": "length" if request.drop_generation else comp.finish_reason,
            }
        )
    return {
        "id": f"cmpl-{new_id()}",
        "object": "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": choices,
        "usage": _usage(output, completion_tokens),
        "system_fingerprint": None,
    }


def merged_body(bodies: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """One completion object for a request of several prompts, from one object per prompt:
    prompt i's sample j is choice i * n + j, and the usage is summed (as OpenAI answers)."""
    merged = dict(bodies[0])
    merged["choices"] = [
        {**choice, "index": i * n + choice["index"]}
        for i, body in enumerate(bodies)
        for choice in body["choices"]
    ]
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    cached = 0
    for body in bodies:
        for key in usage:
            usage[key] += body["usage"][key]
        cached += body["usage"]["prompt_tokens_details"]["cached_tokens"]
    merged["usage"] = {**usage, "prompt_tokens_details": {"cached_tokens": cached}}
    thinking = [b["usage"]["completion_tokens_details"] for b in bodies
                if "completion_tokens_details" in b["usage"]]  # fmt: skip
    if thinking:
        reasoning = sum(d["reasoning_tokens"] for d in thinking)
        merged["usage"]["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return merged
