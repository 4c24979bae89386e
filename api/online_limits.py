"""The limits on online work, checked in the API before a request reaches a worker: prompts in
one request, sequences (prompts × n) in one request, one project's sequences in flight, and how
fast one project starts requests.

An online request goes ahead of every batch in the engine, so without them one request, or one
project's many, could keep every batch waiting.
"""

from __future__ import annotations

import math
from typing import Any

from conveyor.api.errors import APIError
from conveyor.dispatch.online import OnlineBus
from conveyor.settings import Settings
from conveyor.wire_format.errors import INVALID_REQUEST, RATE_LIMIT_EXCEEDED
from conveyor.wire_format.request_line import OnlineRequest

RETRY_AFTER_SECONDS = 2


def check_prompt_count(body: dict[str, Any], settings: Settings) -> None:
    """400 naming `prompt` for a completion with more prompts than allowed: read from the raw
    body, so that an oversized list is refused before each of its prompts is checked."""
    limit = settings.max_online_prompts
    prompt = body.get("prompt")
    if not limit or not isinstance(prompt, list) or not prompt or isinstance(prompt[0], int):
        return  # one prompt (text or token ids), or none: the body's checks say what is wrong
    if len(prompt) > limit:
        raise APIError(
            400,
            f"prompt: {len(prompt)} prompts in one request, more than the {limit} allowed "
            "(CONVEYOR_MAX_ONLINE_PROMPTS); split them over several requests, or send them "
            "as a batch",
            code=INVALID_REQUEST,
            param="prompt",
        )


def sequences_of(online: OnlineRequest) -> int:
    return len(online.requests) * online.n


def check_sequences(online: OnlineRequest, settings: Settings) -> None:
    """400 naming `n` for a request whose prompts × n are more sequences than one request may
    ask for, or than its project may ever have in flight."""
    asked = sequences_of(online)
    for limit, name in (
        (settings.max_online_request_sequences, "CONVEYOR_MAX_ONLINE_REQUEST_SEQUENCES"),
        (settings.max_online_sequences, "CONVEYOR_MAX_ONLINE_SEQUENCES"),
    ):
        if limit and asked > limit:
            raise APIError(
                400,
                f"n: {online.n} samples of each of {len(online.requests)} prompts make "
                f"{asked} sequences, more than the {limit} one request may ask for ({name}); "
                "ask for fewer samples or prompts per request",
                code=INVALID_REQUEST,
                param="n",
            )


def too_many_in_flight(limit: int) -> APIError:
    return APIError(
        429,
        f"this project already has close to {limit} online sequences in flight "
        "(CONVEYOR_MAX_ONLINE_SEQUENCES); retry when some have finished, or send the work "
        "as a batch",
        code=RATE_LIMIT_EXCEEDED,
        type="requests",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


async def check_rate(bus: OnlineBus, settings: Settings, project: str) -> None:
    """429 with the seconds to wait when `project` starts online requests faster than
    CONVEYOR_ONLINE_RATE_LIMIT a second (over its burst)."""
    rate = settings.online_rate_limit
    if not rate:
        return
    wait = await bus.rate.take(project, rate, settings.online_rate_burst)
    if wait > 0:
        raise APIError(
            429,
            f"this project starts online requests faster than the {rate:g} a second allowed "
            f"(CONVEYOR_ONLINE_RATE_LIMIT, bursts of {settings.online_rate_burst}); retry in "
            f"{wait:.2f} s, or send the work as a batch",
            code=RATE_LIMIT_EXCEEDED,
            type="requests",
            headers={"Retry-After": str(max(1, math.ceil(wait)))},
        )
