"""What text Conveyor takes: no lone surrogates (no tokenizer, UTF-8 file or database column
can take one; JSON escapes can make them), no NUL where text is stored, and request bodies
nested no deeper than `MAX_JSON_DEPTH`."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# Deepest nesting of objects and arrays a batch line may have (the line itself is level 1).
MAX_JSON_DEPTH = 64


@dataclass
class BodyTextProblems:
    too_deep: str | None = None  # the path of the first container past MAX_JSON_DEPTH
    surrogate: tuple[str, str] | None = None  # (path, where) of the first lone surrogate


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # decoded text holds no valid pair


# what JSON text needs to decode to a surrogate: an escape of one, or one as it is
_SURROGATE_SOURCE = re.compile(r"\\u[dD][89a-fA-F]|[\ud800-\udfff]")


def check_body_text(body: dict[str, Any], source_text: str | None) -> BodyTextProblems:
    """Walk the body for nesting deeper than `MAX_JSON_DEPTH` and lone surrogates (which no
    tokenizer, UTF-8 file or database column can take), in keys and values alike.

    `body.model` is left to the ledger, which checks it with `custom_id` where it stores them.
    """
    found = BodyTextProblems()
    deep = surrogates = True
    if source_text is not None:
        deep = source_text.count("[") + source_text.count("{") > MAX_JSON_DEPTH
        escaped = "\\u" in source_text or not source_text.isascii()  # cheap, then the regex
        surrogates = escaped and _SURROGATE_SOURCE.search(source_text) is not None
    if not (deep or surrogates):
        return found
    # (value, path parts, depth); the line is level 1, its body level 2
    stack: list[tuple[Any, tuple[str | int, ...], int]] = [(body, ("body",), 2)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            found.too_deep = found.too_deep or path_text(path)
            break
        items = value.items() if isinstance(value, dict) else enumerate(value)
        children = []
        for key, item in items:
            if isinstance(item, dict | list):
                children.append((item, (*path, key), depth + 1))
            elif found.surrogate is None and not (depth == 2 and key == "model"):
                if isinstance(item, str):
                    found.surrogate = _surrogate_in(item, (*path, key))
                if isinstance(key, str) and found.surrogate is None:
                    found.surrogate = _surrogate_in(key, (*path, key), " in the field name")
        stack.extend(reversed(children))  # depth first, in document order
    return found


def _surrogate_in(
    text: str, path: tuple[str | int, ...], suffix: str = ""
) -> tuple[str, str] | None:
    match = _LONE_SURROGATE.search(text)
    if match is None:
        return None
    return path_text(path), f"\\u{ord(match.group()):04x} at character {match.start()}{suffix}"


def path_text(path: tuple[str | int, ...], limit: int = 300) -> str:
    """`body.messages[0].content`; a field name that is not plain text is written escaped."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part.isidentifier() and part.isascii() and len(part) <= 60:
            text += f".{part}" if text else part
        else:
            text += f"[{json.dumps(part if len(part) <= 60 else part[:57] + '...')}]"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def unstorable(value: str, max_chars: int | None = None) -> str | None:
    """Why the ledger cannot hold `value` (in a column of `max_chars`), if it cannot:
    PostgreSQL text holds no NUL, UTF-8 no lone surrogate, and a column only so much."""
    if max_chars is not None and len(value) > max_chars:
        return f"is longer than {max_chars} characters"
    if "\x00" in value:
        return "must not contain NUL characters"
    if escape_surrogates(value) != value:
        return "must not contain lone surrogates (it is not valid Unicode)"
    return None


def escape_surrogates(text: str) -> str:
    """`text` with lone surrogates written as `\\udXXX` escapes, which UTF-8 can hold."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")
