"""One line of a batch input file checked into a `ParsedRequest` (the prompt or chat messages,
and keyword arguments for the engine's `SamplingParams`), or a `RequestError` whose
message names the line and the offending field; and a file's lines parsed in order."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from pydantic import BaseModel, ValidationError

from conveyor.wire_format.bodies import (
    CHAT_URL,
    COMPLETIONS_URL,
    RESPONSES_URL,
    SUPPORTED_URLS,
    ChatCompletionBody,
    CompletionBody,
    template_ending,
)
from conveyor.wire_format.errors import (
    DUPLICATE_CUSTOM_ID,
    INVALID_FUNCTION_PARAMETERS,
    INVALID_JSON,
    INVALID_METHOD,
    INVALID_REQUEST,
    INVALID_UNICODE,
    INVALID_URL,
    MAX_TOKENS_TOO_LARGE,
    MODEL_NOT_FOUND,
    UNKNOWN_PARAMETER,
    UNSUPPORTED_PARAMETER,
    RequestError,
    describe,
)
from conveyor.wire_format.fields import (
    MESSAGE_UNSUPPORTED,
    refused_field,
    without_empty_unsupported,
)
from conveyor.wire_format.reasoning import ReasoningParser
from conveyor.wire_format.responses_body import (
    ItemError,
    ResponsesBody,
    ResponsesFieldError,
    responses_message,
    responses_param,
    translate,
)
from conveyor.wire_format.text import MAX_JSON_DEPTH, check_body_text, path_text
from conveyor.wire_format.tool_use import ToolUse
from conveyor.wire_format.tools import forced_tools, grammar_error


@dataclass
class ParsedRequest:
    """One valid batch line, ready to hand to the engine."""

    custom_id: str
    url: str
    model: str
    sampling: dict[str, Any]  # keyword arguments for `engine.SamplingParams`
    prompt: str | list[int] | None = None  # completions
    messages: list[dict[str, Any]] | None = None  # chat
    echo: bool = False  # completions: prepend the prompt (and its logprobs) to each choice
    drop_generation: bool = False  # completions `max_tokens: 0`: report the prompt only
    top_logprobs: int | None = None  # chat: alternatives per token when logprobs were asked
    chat_template_kwargs: dict[str, Any] | None = None  # chat: the template's variables
    # chat: how the template ends the prompt (`bodies.template_ending`)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # chat: how its answer is split from its thinking (set by the worker, from the model's
    # --reasoning-parser), None: not split
    reasoning: ReasoningParser | None = None
    tools: list[dict[str, Any]] | None = None  # chat: the tools, for the chat template
    # chat: how its answer is read for tool calls (the worker gives "auto" its parser), None:
    # it offers no tools
    tool_use: ToolUse | None = None
    # a Responses API request: its body, which its Response object echoes (it runs as the chat
    # completion it was translated into)
    responses: ResponsesBody | None = None
    line: int | None = None

    @property
    def is_chat(self) -> bool:
        return self.url in (CHAT_URL, RESPONSES_URL)

    def client_param(self, param: str | None) -> str | None:
        """The field of the body the client sent that `param`, a chat body's, came from."""
        return responses_param(param) if self.url == RESPONSES_URL else param


def _loc_path(prefix: str, loc: Sequence[Any]) -> str:
    """`loc` written under `prefix`, a path already written (`body`, `body.input[2]`)."""
    return prefix + path_text(("_", *loc))[1:] if prefix else path_text(tuple(loc))


def validation_message(err: ValidationError, prefix: str = "body") -> tuple[str, str, str]:
    """A one-line message for the first few problems of `err`, the first offending field and
    the error code (`unknown_parameter` when a field is not one of the endpoint's)."""
    errors = err.errors(include_url=False)
    unknown = [item for item in errors if item.get("type") == "extra_forbidden"]
    if unknown:
        path = _loc_path(prefix, unknown[0].get("loc", ()))
        return f'Unrecognized request argument supplied: "{path}"', path, UNKNOWN_PARAMETER
    parts = []
    first_param = ""
    for item in errors[:3]:
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
            msg += f", got {describe(item.get('input'))}"
        parts.append(f'"{path}" {msg}')
    extra = err.error_count() - len(parts)
    if extra > 0:
        parts.append(f"and {extra} more problem{'s' if extra > 1 else ''}")
    return "; ".join(parts), first_param, INVALID_REQUEST


@dataclass
class _Line:
    """Where an error is: the line's number and, once known, its custom_id."""

    number: int | None
    custom_id: str | None = None
    responses: bool = False  # the body is a Responses body's translation: name its fields

    def fail(self, message: str, code: str = INVALID_REQUEST, param: str | None = None) -> NoReturn:
        if self.responses:
            message, param = responses_message(message), responses_param(param)
        raise RequestError(
            message, code=code, line=self.number, custom_id=self.custom_id, param=param
        )


def parse_request_object(
    obj: Any,
    *,
    line: int | None = None,
    served_model_names: Iterable[str] | None = None,
    source_text: str | None = None,
) -> ParsedRequest:
    """Check one decoded batch line. Raises `RequestError`.

    `source_text`, the JSON text `obj` was decoded from, lets the body's walk for nesting and
    lone surrogates be skipped when the text shows it cannot hold them.
    """
    where = _Line(line)
    url, body = _envelope(obj, where)
    parsed, responses = _body(body, url, where, source_text)
    if served_model_names is not None:
        names = list(served_model_names)
        if parsed.model not in names:
            where.fail(
                f'"body.model" {describe(parsed.model)} is not served here; '
                f"use {' or '.join(describe(n) for n in names)}",
                MODEL_NOT_FOUND,
                "body.model",
            )
    assert where.custom_id is not None
    if parsed.stream:
        where.fail(
            '"body.stream" cannot be true in a batch: a batch line is answered whole, in the '
            "output file",
            param="body.stream",
        )
    if isinstance(parsed, ChatCompletionBody):
        return _chat_request(parsed, url, where.custom_id, where, responses)
    if len(parsed.prompts) > 1:
        kind = "token-id prompts" if isinstance(parsed.prompts[0], list) else "prompts"
        where.fail(
            f'"body.prompt" must be a single prompt, got a list of {len(parsed.prompts)} '
            f"{kind} (write one line per prompt)",
            param="body.prompt",
        )
    return _completion_request(parsed, parsed.prompts[0], url, where.custom_id, where)


@dataclass
class OnlineRequest:
    """An online request's body checked: one `ParsedRequest` per prompt (a chat has one; a
    completion one per prompt of its list, `custom_id` its index there)."""

    model: str
    requests: list[ParsedRequest]
    n: int  # samples per prompt
    stream: bool = False
    include_usage: bool = False  # stream a last chunk with the usage


def parse_online_body(
    url: str,
    body: Any,
    *,
    served_model_names: Iterable[str] | None = None,
    max_tokens_cap: int | None = None,
) -> OnlineRequest:
    """Check the body of an online request to `url` as a batch line's body is checked.
    Raises `RequestError`."""
    where = _Line(None)
    if not isinstance(body, dict):
        where.fail(f"the request body must be a JSON object, got {describe(body)}")
    parsed, responses = _body(body, url, where, None)
    if served_model_names is not None and parsed.model not in list(served_model_names):
        where.fail(f"the model {parsed.model!r} does not exist", MODEL_NOT_FOUND, "model")
    if isinstance(parsed, ChatCompletionBody):
        requests = [_chat_request(parsed, url, "0", where, responses)]
    else:
        requests = [
            _completion_request(parsed, prompt, url, str(i), where)
            for i, prompt in enumerate(parsed.prompts)
        ]
    for request in requests:
        apply_max_tokens_cap(request, max_tokens_cap)
    options = parsed.stream_options or {}
    return OnlineRequest(
        model=parsed.model,
        requests=requests,
        n=parsed.n or 1,
        stream=bool(parsed.stream),
        include_usage=bool(options.get("include_usage")),
    )


def _envelope(obj: Any, where: _Line) -> tuple[str, dict[str, Any]]:
    """The line's `url` and `body`, once its `custom_id`, `method`, `url` and `body` are
    checked (`where` learns the custom_id)."""
    if not isinstance(obj, dict):
        where.fail(f"a batch line must be a JSON object, got {type(obj).__name__}", INVALID_JSON)
    if "custom_id" not in obj:
        where.fail('"custom_id" is required', param="custom_id")
    if not isinstance(obj["custom_id"], str) or not obj["custom_id"]:
        where.fail(
            f'"custom_id" must be a non-empty string, got {describe(obj["custom_id"])}',
            param="custom_id",
        )
    where.custom_id = obj["custom_id"]

    method = obj.get("method")
    if method is None:
        where.fail('"method" is required (only "POST" is supported)', INVALID_METHOD, "method")
    if method != "POST":
        where.fail(f'"method" must be "POST", got {describe(method)}', INVALID_METHOD, "method")

    url = obj.get("url")
    if url is None:
        where.fail(f'"url" is required (one of {", ".join(SUPPORTED_URLS)})', INVALID_URL, "url")
    if url not in SUPPORTED_URLS:
        where.fail(
            f'"url" must be one of {", ".join(SUPPORTED_URLS)}, got {describe(url)}',
            INVALID_URL,
            "url",
        )

    body = obj.get("body")
    if body is None:
        where.fail('"body" is required', param="body")
    if not isinstance(body, dict):
        where.fail(f'"body" must be a JSON object, got {describe(body)}', param="body")
    return url, body


def _body(
    body: dict[str, Any], url: str, where: _Line, source_text: str | None
) -> tuple[ChatCompletionBody | CompletionBody, ResponsesBody | None]:
    """The body checked against its endpoint's model, and for what no body may hold (a
    Responses body as the chat body it becomes, and itself)."""
    text = check_body_text(body, source_text)
    if text.too_deep is not None:
        path = text.too_deep
        where.fail(f'"{path}" is nested deeper than {MAX_JSON_DEPTH} levels', param=path)
    model_cls = CompletionBody if url == COMPLETIONS_URL else ChatCompletionBody
    if text.surrogate is not None and "field name" in text.surrogate[1]:
        _fail_surrogate(text.surrogate, where)  # a name that cannot even be quoted back
    responses = None
    if url == RESPONSES_URL:
        if text.surrogate is not None:
            _fail_surrogate(text.surrogate, where)  # its paths are the Responses body's
        responses, body = _translated(body, where)
    body = without_empty_unsupported(body)
    _refuse_fields(body, model_cls, where)
    try:
        parsed = model_cls.model_validate(body)
    except ValidationError as err:
        message, param, code = validation_message(err)
        where.fail(message, code, param)
    if text.surrogate is not None:
        _fail_surrogate(text.surrogate, where)
    return parsed, responses


def _translated(body: dict[str, Any], where: _Line) -> tuple[ResponsesBody, dict[str, Any]]:
    """A Responses body checked, and the chat body it becomes; from here on `where` names the
    Responses body's fields in errors."""
    try:
        responses, chat = translate(body)
    except ResponsesFieldError as err:
        code = UNSUPPORTED_PARAMETER if err.unsupported else INVALID_REQUEST
        if str(err).startswith("Unrecognized"):
            code = UNKNOWN_PARAMETER
        where.fail(str(err), code, f"body.{err.param}")
    except ItemError as err:
        message, param, code = validation_message(err.error, prefix=err.path)
        where.fail(message, code, param)
    except ValidationError as err:
        message, param, code = validation_message(err)
        where.fail(message, code, param)
    where.responses = True
    return responses, chat


def _fail_surrogate(surrogate: tuple[str, str], where: _Line) -> NoReturn:
    path, at = surrogate
    where.fail(
        f'"{path}" is not valid Unicode: it holds a lone surrogate ({at}); a JSON '
        "escape \\ud800-\\udbff must be followed by one of \\udc00-\\udfff",
        INVALID_UNICODE,
        path,
    )


def _refuse_fields(body: dict[str, Any], model_cls: type[BaseModel], where: _Line) -> None:
    """Fail on the first field that is refused, naming it and why (see `fields.py`)."""
    refused = refused_field(body, model_cls.model_fields)
    if refused is not None:
        name, reason, unsupported = refused
        path = path_text(("body", name))  # a name of any characters, written escaped
        if unsupported:
            where.fail(f'"{path}" is not supported: {reason}', UNSUPPORTED_PARAMETER, path)
        where.fail(f'Unrecognized request argument supplied: "{path}" ({reason})',
                   UNKNOWN_PARAMETER, path)  # fmt: skip
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        for name in message if isinstance(message, dict) else ():
            if name in MESSAGE_UNSUPPORTED and message[name] not in (None, []):
                where.fail(
                    f'"body.messages[{i}].{name}" is not supported: {MESSAGE_UNSUPPORTED[name]}',
                    UNSUPPORTED_PARAMETER,
                    f"body.messages[{i}].{name}",
                )


def _chat_request(
    parsed: ChatCompletionBody,
    url: str,
    custom_id: str,
    where: _Line,
    responses: ResponsesBody | None = None,
) -> ParsedRequest:
    if parsed.top_logprobs is not None and not parsed.logprobs:
        where.fail('"body.top_logprobs" needs "body.logprobs": true', param="body.top_logprobs")
    _check_forced_tools(parsed, where)
    ending = template_ending(parsed.add_generation_prompt, parsed.continue_final_message)
    return ParsedRequest(
        custom_id=custom_id,
        url=url,
        model=parsed.model,
        sampling=parsed.sampling_kwargs(),
        messages=parsed.message_dicts(),
        top_logprobs=(parsed.top_logprobs or 0) if parsed.logprobs else None,
        chat_template_kwargs=parsed.chat_template_kwargs,
        add_generation_prompt=ending[0],
        continue_final_message=ending[1],
        tools=parsed.tool_dicts(),
        tool_use=parsed.tool_use(),
        responses=responses,
        line=where.number,
    )


def _check_forced_tools(parsed: ChatCompletionBody, where: _Line) -> None:
    """Fail on a tool whose parameters the grammar engine cannot compile, where `tool_choice`
    forces a call to it (a tool the model only may call is never compiled)."""
    for i, tool in forced_tools(parsed.tools or [], parsed.tool_choice):
        error = grammar_error(tool.schema())
        if error is not None:
            param = f"body.tools[{i}].function.parameters"
            where.fail(
                f"the parameters of the tool {describe(tool.function.name)} cannot be compiled "
                f"by the grammar engine, which forces its calls: {error}",
                INVALID_FUNCTION_PARAMETERS,
                param,
            )


def _completion_request(
    parsed: CompletionBody, prompt: str | list[int], url: str, custom_id: str, where: _Line
) -> ParsedRequest:
    if isinstance(prompt, list) and not prompt:
        where.fail('"body.prompt" must not be empty', param="body.prompt")
    if parsed.max_tokens == 0 and not parsed.echo:
        where.fail(
            '"body.max_tokens" must be at least 1 (0 is allowed only with "echo": true)',
            param="body.max_tokens",
        )
    return ParsedRequest(
        custom_id=custom_id,
        url=url,
        model=parsed.model,
        sampling=parsed.sampling_kwargs(),
        prompt=prompt,
        echo=bool(parsed.echo),
        drop_generation=parsed.max_tokens == 0,
        line=where.number,
    )


def parse_request_line(
    text: str | bytes,
    *,
    line: int | None = None,
    served_model_names: Iterable[str] | None = None,
) -> ParsedRequest:
    """Decode and check one line of a batch input file. Raises `RequestError`."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as err:
            raise RequestError(
                f"not valid UTF-8 ({err.reason} at byte {err.start})", code=INVALID_JSON, line=line
            ) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise RequestError(
            f"not valid JSON ({err.msg} at column {err.colno})", code=INVALID_JSON, line=line
        ) from None
    except RecursionError:
        raise RequestError(
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


def apply_max_tokens_cap(request: ParsedRequest, cap: int | None) -> ParsedRequest:
    """Hold a request to the service's `max_tokens` cap: asking for more is an error (422);
    asking for nothing means the cap."""
    if not cap:
        return request
    asked = request.sampling.get("max_tokens")
    if asked is None:
        request.sampling["max_tokens"] = cap
    elif asked > cap:
        raise RequestError(
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
        except RequestError as err:
            if err.custom_id is not None:
                self.seen.setdefault(err.custom_id, line)
            raise
        if request.custom_id in self.seen:
            first = self.seen[request.custom_id]
            where = f" (first used on line {first})" if first is not None else ""
            raise RequestError(
                f'duplicate "custom_id" {describe(request.custom_id)}{where}',
                code=DUPLICATE_CUSTOM_ID,
                line=line,
                custom_id=request.custom_id,
                param="custom_id",
            )
        self.seen[request.custom_id] = line
        return apply_max_tokens_cap(request, self.max_tokens_cap)
