"""The OpenAI Batch file format: parse input lines, build output and error lines.

One input line is a JSON object::

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

`parse_request_line` checks it and returns a `ParsedRequest` (the prompt, or chat messages, and
keyword arguments for the engine's `SamplingParams`), or raises `BatchRequestError` whose message
names the line and the offending field. `build_output_line` and `build_error_line` build the
result lines in the shape OpenAI's Batch API writes them.

This module only depends on pydantic and the standard library (no torch, no engine) so that an
HTTP front end can use it to validate requests cheaply. Formatting takes the engine's outputs
duck-typed (`RequestOutput` / `CompletionOutput` attributes) and a `TokenDecoder` for token text.

Body fields that this module does not know (`presence_penalty`, `logit_bias`, `user`, `stream`,
...) are ignored, as OpenAI clients send many of them; known fields are type- and range-checked.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
SUPPORTED_URLS = (CHAT_URL, COMPLETIONS_URL)

# OpenAI accepts this many top alternatives per token.
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5

# Error codes written into the `error.code` field of error lines.
INVALID_JSON = "invalid_json"
INVALID_URL = "invalid_url"
INVALID_METHOD = "invalid_method"
INVALID_REQUEST = "invalid_request"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
MODEL_NOT_FOUND = "model_not_found"
INVALID_SAMPLING_PARAMS = "invalid_sampling_params"
MAX_TOKENS_TOO_LARGE = "max_tokens_too_large"
INVALID_PROMPT = "invalid_prompt"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
CHAT_TEMPLATE_ERROR = "chat_template_error"
INTERNAL_ERROR = "internal_error"
INVALID_UNICODE = "invalid_unicode"
REQUEST_QUARANTINED = "request_quarantined"

# Deepest nesting of objects and arrays a batch line may have (the line itself is level 1).
MAX_JSON_DEPTH = 64


class BatchRequestError(Exception):
    """A batch input line that cannot be run. `str(err)` is the full, human-readable message."""

    def __init__(
        self,
        message: str,
        *,
        code: str = INVALID_REQUEST,
        line: int | None = None,
        custom_id: str | None = None,
        param: str | None = None,
        status_code: int = 400,
    ) -> None:
        self.detail = message
        self.code = code
        self.line = line
        self.custom_id = custom_id
        self.param = param
        self.status_code = status_code
        super().__init__(f"line {line}: {message}" if line is not None else message)

    @property
    def message(self) -> str:
        return str(self)


# --------------------------------------------------------------------------------------------
# Request bodies
# --------------------------------------------------------------------------------------------

_BODY_CONFIG = ConfigDict(extra="ignore", strict=True, frozen=True)


def _check_stop(value: Any) -> str | list[str] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError("must be a string or a list of strings")


def _check_token_ids(value: Any, what: str = "a list of integer token ids") -> list[int]:
    if isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        return value
    raise ValueError(f"must be {what}")


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints, including vLLM's extensions."""

    model_config = _BODY_CONFIG

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1, le=128)
    stop: Any = None
    seed: int | None = None
    # vLLM extensions
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: Any = None
    skip_special_tokens: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        return _check_stop(value)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, value: Any) -> Any:
        return None if value is None else _check_token_ids(value)

    def common_sampling_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "n": 1 if self.n is None else self.n,
            "temperature": 1.0 if self.temperature is None else float(self.temperature),
            "top_p": 1.0 if self.top_p is None else float(self.top_p),
        }
        if self.stop is not None:
            kwargs["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        optional = {
            "seed": self.seed,
            "top_k": self.top_k,
            "min_p": None if self.min_p is None else float(self.min_p),
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": None if self.stop_token_ids is None else list(self.stop_token_ids),
            "skip_special_tokens": self.skip_special_tokens,
        }
        kwargs.update({name: value for name, value in optional.items() if value is not None})
        return kwargs


class ChatMessage(BaseModel):
    model_config = _BODY_CONFIG

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> str | None:
        """Plain text, or a list of `{"type": "text", "text": ...}` parts joined by newlines."""
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            texts = []
            for i, part in enumerate(value):
                if not isinstance(part, dict):
                    raise ValueError(f"part {i} must be an object, got {_describe(part)}")
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(
                        f'must only hold "text" parts, got a part of type {_describe(kind)}'
                    )
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError(f'part {i} needs a string "text", got {_describe(text)}')
                texts.append(text)
            return "\n".join(texts)
        raise ValueError('must be a string or a list of {"type": "text", "text": ...} parts')


class ChatCompletionBody(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = self.common_sampling_kwargs()
        # Chat default: no limit other than the model's context length.
        if self.max_completion_tokens is not None:
            kwargs["max_tokens"] = self.max_completion_tokens
        else:
            kwargs["max_tokens"] = self.max_tokens
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs or 0
        return kwargs

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content or ""} for m in self.messages]


class CompletionBody(_SamplingFields):
    prompt: Any
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            if value and all(isinstance(p, str) for p in value):
                if len(value) == 1:
                    return value[0]
                raise ValueError(
                    f"must be a single prompt, got a list of {len(value)} prompts "
                    "(write one line per prompt)"
                )
            if value and all(isinstance(p, list) for p in value):
                if len(value) == 1:
                    return _check_token_ids(value[0])
                raise ValueError(
                    f"must be a single prompt, got a list of {len(value)} token-id prompts "
                    "(write one line per prompt)"
                )
            return _check_token_ids(value, "a string or a list of integer token ids")
        raise ValueError("must be a string or a list of integer token ids")

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = self.common_sampling_kwargs()
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        # `max_tokens: 0` with `echo` only scores the prompt: generate one token, drop it later.
        kwargs["max_tokens"] = max(max_tokens, 1)
        if self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
            if self.echo:
                kwargs["prompt_logprobs"] = self.logprobs
        return kwargs


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


@dataclass
class ParsedRequest:
    """One valid batch line, ready to hand to the engine."""

    custom_id: str
    url: str
    model: str
    sampling: dict[str, Any]  # keyword arguments for `engine.SamplingParams`
    prompt: str | list[int] | None = None  # completions
    messages: list[dict[str, str]] | None = None  # chat
    echo: bool = False  # completions: prepend the prompt (and its logprobs) to each choice
    drop_generation: bool = False  # completions `max_tokens: 0`: report the prompt only
    top_logprobs: int | None = None  # chat: alternatives per token when logprobs were asked
    line: int | None = None

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT_URL


def _describe(value: Any, limit: int = 60) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _loc_path(prefix: str, loc: Sequence[Any]) -> str:
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def _validation_message(err: ValidationError, prefix: str = "body") -> tuple[str, str]:
    """A one-line message for the first few problems of `err`, and the first offending field."""
    parts = []
    first_param = ""
    for item in err.errors(include_url=False)[:3]:
        path = _loc_path(prefix, item.get("loc", ()))
        first_param = first_param or path
        kind = item.get("type", "")
        if kind == "missing":
            parts.append(f'"{path}" is required')
            continue
        msg = item.get("msg", "is invalid")
        for lead, repl in (("Value error, ", ""), ("Input should", "should")):
            if msg.startswith(lead):
                msg = repl + msg[len(lead) :]
                break
        if "got " not in msg:
            msg += f", got {_describe(item.get('input'))}"
        parts.append(f'"{path}" {msg}')
    extra = err.error_count() - len(parts)
    if extra > 0:
        parts.append(f"and {extra} more problem{'s' if extra > 1 else ''}")
    return "; ".join(parts), first_param


@dataclass
class _BodyText:
    too_deep: str | None = None  # the path of the first container past MAX_JSON_DEPTH
    surrogate: tuple[str, str] | None = None  # (path, where) of the first lone surrogate


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # decoded text holds no valid pair
# what JSON text needs to decode to a surrogate: an escape of one, or one as it is
_SURROGATE_SOURCE = re.compile(r"\\u[dD][89a-fA-F]|[\ud800-\udfff]")


def _check_body_text(body: dict[str, Any], source_text: str | None) -> _BodyText:
    """Walk the body for nesting deeper than `MAX_JSON_DEPTH` and lone surrogates (which no
    tokenizer, UTF-8 file or database column can take), in keys and values alike.

    `body.model` is left to the ledger, which checks it with `custom_id` where it stores them.
    """
    found = _BodyText()
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
            found.too_deep = found.too_deep or _path_text(path)
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
    return _path_text(path), f"\\u{ord(match.group()):04x} at character {match.start()}{suffix}"


def _path_text(path: tuple[str | int, ...], limit: int = 300) -> str:
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


def parse_request_object(
    obj: Any,
    *,
    line: int | None = None,
    served_model_names: Iterable[str] | None = None,
    source_text: str | None = None,
) -> ParsedRequest:
    """Check one decoded batch line. Raises `BatchRequestError`.

    `source_text`, the JSON text `obj` was decoded from, lets the body's walk for nesting and
    lone surrogates be skipped when the text shows it cannot hold them.
    """

    def fail(message: str, code: str = INVALID_REQUEST, param: str | None = None) -> NoReturn:
        raise BatchRequestError(message, code=code, line=line, custom_id=custom_id, param=param)

    custom_id: str | None = None
    if not isinstance(obj, dict):
        fail(f"a batch line must be a JSON object, got {type(obj).__name__}", INVALID_JSON)
    if "custom_id" not in obj:
        fail('"custom_id" is required', param="custom_id")
    if not isinstance(obj["custom_id"], str) or not obj["custom_id"]:
        fail(
            f'"custom_id" must be a non-empty string, got {_describe(obj["custom_id"])}',
            param="custom_id",
        )
    custom_id = obj["custom_id"]

    method = obj.get("method")
    if method is None:
        fail('"method" is required (only "POST" is supported)', INVALID_METHOD, "method")
    if method != "POST":
        fail(f'"method" must be "POST", got {_describe(method)}', INVALID_METHOD, "method")

    url = obj.get("url")
    if url is None:
        fail(f'"url" is required (one of {", ".join(SUPPORTED_URLS)})', INVALID_URL, "url")
    if url not in SUPPORTED_URLS:
        fail(
            f'"url" must be one of {", ".join(SUPPORTED_URLS)}, got {_describe(url)}',
            INVALID_URL,
            "url",
        )

    body = obj.get("body")
    if body is None:
        fail('"body" is required', param="body")
    if not isinstance(body, dict):
        fail(f'"body" must be a JSON object, got {_describe(body)}', param="body")

    text = _check_body_text(body, source_text)
    if text.too_deep is not None:
        path = text.too_deep
        fail(f'"{path}" is nested deeper than {MAX_JSON_DEPTH} levels', param=path)

    model_cls = ChatCompletionBody if url == CHAT_URL else CompletionBody
    try:
        parsed = model_cls.model_validate(body)
    except ValidationError as err:
        message, param = _validation_message(err)
        fail(message, param=param)
    if text.surrogate is not None:
        path, where = text.surrogate
        fail(
            f'"{path}" is not valid Unicode: it holds a lone surrogate ({where}); a JSON '
            "escape \\ud800-\\udbff must be followed by one of \\udc00-\\udfff",
            INVALID_UNICODE,
            path,
        )

    if served_model_names is not None:
        names = list(served_model_names)
        if parsed.model not in names:
            fail(
                f'"body.model" {_describe(parsed.model)} is not served here; '
                f"use {' or '.join(_describe(n) for n in names)}",
                MODEL_NOT_FOUND,
                "body.model",
            )

    if isinstance(parsed, ChatCompletionBody):
        if parsed.top_logprobs is not None and not parsed.logprobs:
            fail('"body.top_logprobs" needs "body.logprobs": true', param="body.top_logprobs")
        return ParsedRequest(
            custom_id=custom_id,
            url=url,
            model=parsed.model,
            sampling=parsed.sampling_kwargs(),
            messages=parsed.message_dicts(),
            top_logprobs=(parsed.top_logprobs or 0) if parsed.logprobs else None,
            line=line,
        )

    if isinstance(parsed.prompt, list) and not parsed.prompt:
        fail('"body.prompt" must not be empty', param="body.prompt")
    if parsed.max_tokens == 0 and not parsed.echo:
        fail(
            '"body.max_tokens" must be at least 1 (0 is allowed only with "echo": true)',
            param="body.max_tokens",
        )
    return ParsedRequest(
        custom_id=custom_id,
        url=url,
        model=parsed.model,
        sampling=parsed.sampling_kwargs(),
        prompt=parsed.prompt,
        echo=bool(parsed.echo),
        drop_generation=parsed.max_tokens == 0,
        line=line,
    )


def parse_request_line(
    text: str | bytes,
    *,
    line: int | None = None,
    served_model_names: Iterable[str] | None = None,
) -> ParsedRequest:
    """Decode and check one line of a batch input file. Raises `BatchRequestError`."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as err:
            raise BatchRequestError(
                f"not valid UTF-8 ({err.reason} at byte {err.start})", code=INVALID_JSON, line=line
            ) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise BatchRequestError(
            f"not valid JSON ({err.msg} at column {err.colno})", code=INVALID_JSON, line=line
        ) from None
    except RecursionError:
        raise BatchRequestError(
            f"not valid JSON here: nested deeper than {MAX_JSON_DEPTH} levels",
            code=INVALID_JSON,
            line=line,
        ) from None
    return parse_request_object(
        obj, line=line, served_model_names=served_model_names, source_text=text
    )


def peek_custom_id(text: str | bytes) -> str | None:
    """The line's `custom_id` if it is a JSON object that has a string one, else None."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return None
    if isinstance(obj, dict) and isinstance(obj.get("custom_id"), str):
        return obj["custom_id"]
    return None


def classify_engine_error(message: str) -> str:
    """Error code for a `ValueError` the engine raised when the request was added."""
    lowered = message.lower()
    if "too long" in lowered or "max_model_len" in lowered:
        return CONTEXT_LENGTH_EXCEEDED
    return INVALID_PROMPT


# --------------------------------------------------------------------------------------------
# Token text
# --------------------------------------------------------------------------------------------


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-to-printable-character map, inverted."""
    keep = list(range(ord("!"), ord("~") + 1))
    keep += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


class TokenDecoder:
    """Token id -> text (for logprob entries) and raw bytes, cached, from a HF tokenizer.

    Without a tokenizer, tokens are shown as `token_id:<id>`.
    """

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._byte_level = False
        if tokenizer is not None:
            backend = getattr(tokenizer, "backend_tokenizer", None)
            decoder = getattr(backend, "decoder", None)
            self._byte_level = "ByteLevel" in type(decoder).__name__
            if not self._byte_level and backend is not None:
                try:
                    spec = json.loads(backend.to_str()).get("decoder") or {}
                    self._byte_level = "ByteLevel" in json.dumps(spec)
                except Exception:
                    self._byte_level = False
        self._table = _byte_level_table() if self._byte_level else {}

    def text(self, token_id: int) -> str:
        cached = self._text.get(token_id)
        if cached is None:
            if self.tokenizer is None:
                cached = f"token_id:{token_id}"
            else:
                cached = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._text[token_id] = cached
        return cached

    def bytes(self, token_id: int) -> list[int]:
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._raw_bytes(token_id)
            self._bytes[token_id] = cached
        return cached

    def decode(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return "".join(self.text(t) for t in token_ids)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def _raw_bytes(self, token_id: int) -> list[int]:
        if self.tokenizer is not None:
            try:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
            except Exception:
                piece = None
            if isinstance(piece, str):
                special = getattr(self.tokenizer, "all_special_tokens", ()) or ()
                if piece not in special:
                    if self._byte_level and all(c in self._table for c in piece):
                        return [self._table[c] for c in piece]
                    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                        try:  # sentencepiece byte-fallback token
                            return [int(piece[3:5], 16)]
                        except ValueError:
                            pass
                    if not self._byte_level and "\u2581" in piece:
                        return list(piece.replace("\u2581", " ").encode("utf-8"))
        return list(self.text(token_id).encode("utf-8"))


# --------------------------------------------------------------------------------------------
# Output lines
# --------------------------------------------------------------------------------------------


_ids = random.Random()  # seeded from os.urandom once; ids need to be unique, not secret


def _hex() -> str:
    return f"{_ids.getrandbits(128):032x}"


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
    completion_tokens = 0
    for comp in sorted(output.outputs, key=lambda c: c.index):
        completion_tokens += len(comp.token_ids)
        logprobs = None
        if request.top_logprobs is not None:
            logprobs = chat_logprobs(comp.token_ids, comp.logprobs, request.top_logprobs, decoder)
        choices.append(
            {
                "index": comp.index,
                "message": {"role": "assistant", "content": comp.text, "refusal": None},
                "logprobs": logprobs,
                "finish_reason": comp.finish_reason,
            }
        )
    return {
        "id": f"chatcmpl-{_hex()}",
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": choices,
        "usage": _usage(output, completion_tokens),
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
        "id": f"cmpl-{_hex()}",
        "object": "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": choices,
        "usage": _usage(output, completion_tokens),
        "system_fingerprint": None,
    }


def build_output_line(
    request: ParsedRequest,
    output: Any,
    model: str,
    decoder: TokenDecoder,
    created: int | None = None,
) -> dict[str, Any]:
    """The result line for a finished request (`output` is the engine's `RequestOutput`)."""
    build = chat_completion_body if request.is_chat else text_completion_body
    return {
        "id": f"batch_req_{_hex()}",
        "custom_id": request.custom_id,
        "response": {
            "status_code": 200,
            "request_id": _hex(),
            "body": build(request, output, model, decoder, created),
        },
        "error": None,
    }


def build_error_line(
    custom_id: str | None,
    code: str,
    message: str,
    *,
    line: int | None = None,
    param: str | None = None,
    status_code: int | None = 400,
) -> dict[str, Any]:
    """An error line.

    `error` always holds `{code, message, line, param}`. When the line named a `custom_id`,
    `response` also carries the HTTP-style error the endpoint would have answered
    (`status_code` 400 for a bad request, 500 for a server failure); for a line that could not
    be attributed to a request (not JSON, no custom_id), `response` is null.
    """
    error = {"code": code, "message": message, "line": line, "param": param}
    response = None
    if custom_id is not None and status_code is not None:
        response = {
            "status_code": status_code,
            "request_id": _hex(),
            "body": {
                "error": {
                    "message": message,
                    "type": "invalid_request_error" if status_code < 500 else "server_error",
                    "param": param,
                    "code": code,
                }
            },
        }
    return {
        "id": f"batch_req_{_hex()}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }


def dump_line(obj: dict[str, Any]) -> str:
    """A result or error line as JSON text that UTF-8 (a file, the ledger) can always hold:
    text as it is, unless it has a lone surrogate (model text or an echoed prompt can), then
    with every non-ASCII character escaped, which decodes to the same line."""
    text = json.dumps(obj, ensure_ascii=False)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(obj)
    return text


def error_line_from_exception(err: BatchRequestError) -> dict[str, Any]:
    return build_error_line(
        err.custom_id,
        err.code,
        str(err),
        line=err.line,
        param=err.param,
        status_code=err.status_code,
    )


def apply_max_tokens_cap(request: ParsedRequest, cap: int | None) -> ParsedRequest:
    """Hold a request to the service's `max_tokens` cap: asking for more is an error (422);
    asking for nothing means the cap."""
    if not cap:
        return request
    asked = request.sampling.get("max_tokens")
    if asked is None:
        request.sampling["max_tokens"] = cap
    elif asked > cap:
        raise BatchRequestError(
            f"max_tokens is {asked}, above this service's limit of {cap}",
            code=MAX_TOKENS_TOO_LARGE,
            line=request.line,
            custom_id=request.custom_id,
            param="body.max_tokens",
            status_code=422,
        )
    return request


class BatchLineParser:
    """Parses the lines of one batch file in order, rejecting repeated `custom_id`s.

    A `custom_id` counts as used as soon as a line names it, even if that line is invalid.
    """

    def __init__(
        self, served_model_names: Iterable[str] | None = None, max_tokens_cap: int | None = None
    ) -> None:
        self.served_model_names = list(served_model_names) if served_model_names else None
        self.max_tokens_cap = max_tokens_cap
        self.seen: dict[str, int | None] = {}

    def parse(self, text: str | bytes, line: int | None = None) -> ParsedRequest:
        try:
            request = parse_request_line(
                text, line=line, served_model_names=self.served_model_names
            )
        except BatchRequestError as err:
            if err.custom_id is not None:
                self.seen.setdefault(err.custom_id, line)
            raise
        if request.custom_id in self.seen:
            first = self.seen[request.custom_id]
            where = f" (first used on line {first})" if first is not None else ""
            raise BatchRequestError(
                f'duplicate "custom_id" {_describe(request.custom_id)}{where}',
                code=DUPLICATE_CUSTOM_ID,
                line=line,
                custom_id=request.custom_id,
                param="custom_id",
            )
        self.seen[request.custom_id] = line
        return apply_max_tokens_cap(request, self.max_tokens_cap)


__all__ = [
    "CHAT_URL",
    "COMPLETIONS_URL",
    "SUPPORTED_URLS",
    "BatchLineParser",
    "BatchRequestError",
    "ChatCompletionBody",
    "ChatMessage",
    "CompletionBody",
    "ParsedRequest",
    "TokenDecoder",
    "build_error_line",
    "build_output_line",
    "chat_completion_body",
    "chat_logprobs",
    "classify_engine_error",
    "completion_logprobs",
    "dump_line",
    "error_line_from_exception",
    "parse_request_line",
    "parse_request_object",
    "peek_custom_id",
    "text_completion_body",
]
