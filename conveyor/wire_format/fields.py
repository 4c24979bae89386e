"""Every body field a client may send, in one place: what Conveyor does with it.

A field is either honoured (declared on the endpoint's body model in `bodies.py`, and acted
on), accepted without effect (listed in `ACCEPTED_WITHOUT_EFFECT`, with the reason it cannot
change a result), or refused: a field listed in `UNSUPPORTED` changes results at OpenAI or vLLM
and is not implemented here (`unsupported_parameter`), and any other field is unknown
(`unknown_parameter`, as OpenAI's "Unrecognized request argument supplied"). A refused field
fails its request alone: a batch line's error line, or an online request's 400.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

ACCEPTED_WITHOUT_EFFECT: dict[str, str] = {
    "user": "an end-user id for the provider's abuse monitoring",
    "safety_identifier": "an end-user id for the provider's abuse monitoring",
    "metadata": "tags for OpenAI's stored completions",
    "store": "OpenAI's stored completions; Conveyor keeps every result in its ledger",
    "service_tier": "OpenAI's latency tier; a batch line runs when its batch runs",
    "prompt_cache_key": "a routing hint for OpenAI's prompt cache; Conveyor's prefix cache "
    "finds shared prefixes by their content",
    "prompt_cache_retention": "how long OpenAI keeps cached prefixes",
    "prompt_cache_options": "OpenAI's prompt cache settings",
}

# field -> why it is refused (it would change the result)
UNSUPPORTED: dict[str, str] = {
    "functions": "the deprecated functions are not supported; use tools",
    "function_call": "the deprecated function_call is not supported; use tool_choice",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning effort is for OpenAI's reasoning models",
    "verbosity": "verbosity is for OpenAI's reasoning models",
    "web_search_options": "web search is not supported",
    "moderation": "moderation is not supported",
    "suffix": "insertion (a suffix after the completion) is not supported",
    "bad_words": "bad_words is not supported; use logit_bias for single tokens",
    "use_beam_search": "beam search is not supported",
    "guided_decoding_backend": "the grammar engine is chosen by the server",
    "structural_tag": "structural tags are not supported",
    "chat_template": "a request-supplied chat template is not supported",
}

# fields of a chat message besides role and content
MESSAGE_UNSUPPORTED: dict[str, str] = {
    "function_call": "the deprecated function_call is not supported; use tool_calls",
    "audio": "audio is not supported",
}


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


def without_empty_unsupported(body: dict[str, Any]) -> dict[str, Any]:
    """`body` less the refused fields that are null or empty, which are as if absent (clients
    send `functions: []`)."""
    return {k: v for k, v in body.items() if not (k in UNSUPPORTED and _empty(v))}


def refused_field(body: dict[str, Any], known: Iterable[str]) -> tuple[str, str, bool] | None:
    """The first field of `body` that is refused, as (field, reason, unsupported); None when
    every field is `known` (declared on the body model) or accepted without effect."""
    known = set(known) | set(ACCEPTED_WITHOUT_EFFECT)
    for name in body:
        if name in known:
            continue
        if name in UNSUPPORTED:
            return name, UNSUPPORTED[name], True
        return name, _unknown_reason(name, known), False
    return None


def _unknown_reason(name: str, known: set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f"did you mean {close[0]!r}?" if close else "it is not a field of this endpoint"
