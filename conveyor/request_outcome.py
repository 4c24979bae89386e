"""What becomes of one request, wherever it runs (a worker's shard or online call, `conveyor
run`), decided here once:

- a checked request (`ParsedRequest`) goes to the engine as a prompt (a chat's messages through
  the model's chat template) and its `SamplingParams` (`prepare_request`);
- a batch line that does not parse or prepare gets its own error line, naming the field (400);
- the engine's refusal, when the request is added or during a step, is the error of its kind
  (`engine_error`: each engine error class has its code);
- a fault of the service's with one request (preparing it, formatting its result, an engine
  error of no kind) says "internal error" and the request's id, which the log line with the
  details carries (500), and touches no other request;
- else the request's output becomes its result line (`output_line`) or online answer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from conveyor.engine.errors import (
    ChatTemplateError,
    ContextLengthError,
    InvalidPromptError,
    InvalidRequestError,
    RequestFailure,
    StructuredOutputError,
)
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.protocol import Engine, Prompt, TokenizedPrompt
from conveyor.engine.sampling_params import SamplingParams
from conveyor.wire_format.errors import (
    CHAT_TEMPLATE_ERROR,
    CONTEXT_LENGTH_EXCEEDED,
    INTERNAL_ERROR,
    INVALID_FUNCTION_PARAMETERS,
    INVALID_PROMPT,
    INVALID_RESPONSE_FORMAT,
    INVALID_SAMPLING_PARAMS,
    RequestError,
)
from conveyor.wire_format.reasoning import reasoning_parser
from conveyor.wire_format.request_line import ParsedRequest, peek_custom_id
from conveyor.wire_format.result_lines import (
    build_error_line,
    build_output_line,
    error_line_from_exception,
)
from conveyor.wire_format.token_text import TokenDecoder
from conveyor.wire_format.tool_calls import PARSERS as TOOL_CALL_PARSERS

log = logging.getLogger(__name__)

# SamplingParams field -> the request body field it comes from, where the names differ
_BODY_FIELD = {"prompt_logprobs": "logprobs"}

# the engine's kinds of refusal -> the error code a client sees; the most specific first (a
# kind not listed is a sampling parameter's)
ERROR_CODES: tuple[tuple[type[InvalidRequestError], str], ...] = (
    (ContextLengthError, CONTEXT_LENGTH_EXCEEDED),
    (InvalidPromptError, INVALID_PROMPT),
    (StructuredOutputError, INVALID_RESPONSE_FORMAT),
)


def internal_error(request_id: str) -> str:
    """What a client is told of a fault of the service's: no internals, and the id that the
    log line with the details carries."""
    return f"internal error (request {request_id}); the service's log has the details"


def engine_error(
    err: BaseException | RequestFailure, request: ParsedRequest, request_id: str
) -> RequestError:
    """The error line (or online error) of a request the engine refused or gave up on, by the
    error's kind and field. A fault of the engine's says "internal error" and `request_id`,
    which the log line with the details carries."""
    failure = err if isinstance(err, RequestFailure) else RequestFailure.of(err)
    where = {"line": request.line, "custom_id": request.custom_id}
    kind = failure.kind
    if kind is None:  # the engine's fault
        log.error("request %s: internal error: %s", request_id, failure.message)
        return RequestError(
            internal_error(request_id),
            code=INTERNAL_ERROR,
            status_code=500,
            **where,
        )
    code = next((c for k, c in ERROR_CODES if issubclass(kind, k)), INVALID_SAMPLING_PARAMS)
    if issubclass(kind, InvalidPromptError):
        param = "body.messages" if request.is_chat else "body.prompt"
    elif issubclass(kind, StructuredOutputError) and request.tool_use and request.tool_use.forced:
        code, param = INVALID_FUNCTION_PARAMETERS, "body.tools"  # a forced call's grammar
    elif issubclass(kind, StructuredOutputError):
        param = "body.response_format"
    else:
        field = failure.field
        param = None if field is None else f"body.{_BODY_FIELD.get(field, field)}"
    return RequestError(failure.message, code=code, param=request.client_param(param), **where)


def prepare_request(llm: Engine, request: ParsedRequest) -> tuple[Prompt, SamplingParams]:
    """The engine prompt and sampling params of a parsed line, the fields it leaves out
    filled from the model's defaults (`Engine.default_sampling`). Raises `RequestError`."""
    thinking_off = (request.chat_template_kwargs or {}).get("enable_thinking") is False
    if request.is_chat and llm.reasoning_parser is not None and not thinking_off:
        request.reasoning = reasoning_parser(llm.reasoning_parser)
    sampling = {**llm.default_sampling, **request.sampling}
    if request.tool_use is not None and not request.tool_use.forced:
        _read_calls_with(llm.tool_call_parser, request, sampling)
    if request.reasoning is not None and sampling.get("structured_outputs"):
        # the answer is constrained, after the thinking, as vLLM does
        after = {"after": request.reasoning.end}
        sampling["structured_outputs"] = {**sampling["structured_outputs"], **after}
    try:
        params = SamplingParams(**sampling)
    except InvalidRequestError as err:
        raise engine_error(err, request, f"line {request.line}") from None
    if not request.is_chat:
        assert request.prompt is not None
        return _prepared(llm, request, request.prompt), params
    try:
        prompt = llm.apply_chat_template(
            request.messages or [],
            request.add_generation_prompt,
            request.chat_template_kwargs,
            request.tools,
            request.continue_final_message,
        )
    except Exception as err:  # the engine's ChatTemplateError, or what a template raised
        raise chat_template_error(err, request) from None
    return _prepared(llm, request, prompt), params


def chat_template_error(err: Exception, request: ParsedRequest | None = None) -> RequestError:
    """What the chat template raised as the error of `request` (an online body where None),
    naming the field at fault."""
    kwargs = getattr(err, "field", None) == "chat_template_kwargs"
    field = "chat_template_kwargs" if kwargs else "messages"
    message = str(err) if isinstance(err, ChatTemplateError) else f"the chat template: {err}"
    if request is None:
        return RequestError(message, code=CHAT_TEMPLATE_ERROR, param=field)
    return RequestError(
        message,
        code=CHAT_TEMPLATE_ERROR,
        line=request.line,
        custom_id=request.custom_id,
        param=request.client_param(f"body.{field}"),
    )


def _prepared(llm: Engine, request: ParsedRequest, prompt: str | list[int]) -> Prompt:
    """`prompt` tokenized and checked here, on the thread that prepares the request, rather
    than on the engine's, which steps the model for every request."""
    try:
        return llm.prepare_prompt(prompt)
    except InvalidRequestError as err:
        raise engine_error(err, request, f"line {request.line}") from None


def _read_calls_with(parser: str | None, request: ParsedRequest, sampling: dict[str, Any]) -> None:
    """Give a chat whose `tool_choice` is "auto" the server's tool-call parser; without one its
    calls could not be read, so it is refused (as vLLM refuses it without
    --enable-auto-tool-choice)."""
    if parser is None:
        raise RequestError(
            '"tool_choice" "auto" (the default with "tools") needs the server started with '
            "--tool-call-parser (hermes, llama3_json or mistral) to read the model's calls; "
            'tool_choice "required" or a named function needs none',
            line=request.line,
            custom_id=request.custom_id,
            param="body.tool_choice",
        )
    assert request.tool_use is not None
    request.tool_use = replace(request.tool_use, parser=TOOL_CALL_PARSERS[parser])
    if request.tool_use.parser.keeps_special_tokens:  # its marker is a special token
        sampling.setdefault("skip_special_tokens", False)


# ---- batch lines ------------------------------------------------------------------------------
@dataclass
class PreparedLine:
    """A batch line ready for the engine."""

    parsed: ParsedRequest
    prompt: Prompt
    params: SamplingParams


def prepare_line(
    llm: Engine,
    raw: str | bytes,
    line: int,
    request_id: str,
    parse: Callable[[str | bytes, int], ParsedRequest],
) -> PreparedLine | dict[str, Any]:
    """The line parsed (by `parse`) and prepared for the engine, or its error line."""
    try:
        parsed = parse(raw, line)
        prompt, params = prepare_request(llm, parsed)
    except RequestError as err:
        return error_line_from_exception(err)
    except Exception:  # a fault of ours with this line: it fails alone
        log.exception("request %s: internal error while preparing it", request_id)
        return internal_error_line(peek_custom_id(raw), line, request_id)
    return PreparedLine(parsed, prompt, params)


def reuse_key(prepared: PreparedLine) -> str | None:
    """The normalised key of a deterministic line (greedy, or sampled with a seed), under which
    its result may answer an equal line later (`ledger.reuse`); None for any other line. It
    holds what can change the answer: the endpoint and model name, the prompt as the engine
    gets it (a chat's rendered template, tools and all), every sampling setting with its
    defaults filled in, and what shapes the answer's body; key order and spacing do not count.
    The model's weights and numerics are its fingerprint's part."""
    params, parsed = prepared.params, prepared.parsed
    if params.temperature != 0 and params.seed is None:
        return None
    shape = {
        "url": parsed.url,
        "model": parsed.model,
        "prompt": _as_given(prepared.prompt),
        "sampling": _sampling_fields(params),
        "echo": parsed.echo,
        "drop_generation": parsed.drop_generation,
        "top_logprobs": parsed.top_logprobs,
        "tools": parsed.tools,
        "tool_use": _tool_use(parsed.tool_use),
        "reasoning": _name(parsed.reasoning),
        "responses": parsed.responses,
    }
    text = json.dumps(shape, sort_keys=True, separators=(",", ":"), default=_plain)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _sampling_fields(params: SamplingParams) -> dict[str, Any]:
    """`dataclasses.asdict(params)` as JSON writes it, without its deep copy of every value
    (a tenth of a chat line's preparation)."""
    values = ((name, getattr(params, name)) for name in _SAMPLING_FIELDS)
    return {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in values}


_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def _as_given(prompt: Prompt) -> str | list[int]:
    """The prompt as the line gave it (a chat's as its template's ids), as keys hold it: a
    key made before prompts were tokenized off the engine's thread still matches."""
    return prompt.as_given if isinstance(prompt, TokenizedPrompt) else prompt


def _name(parser: Any) -> str | None:
    return None if parser is None else getattr(parser, "name", type(parser).__name__)


def _tool_use(use: Any) -> dict[str, Any] | None:
    if use is None:
        return None
    return {"choice": use.choice, "name": use.name, "parallel": use.parallel,
            "parser": _name(use.parser)}  # fmt: skip


def _plain(value: Any) -> Any:
    """What JSON holds of a dataclass or a Pydantic model in a key."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return repr(value)


def refused_line(
    err: BaseException | RequestFailure, request: ParsedRequest, request_id: str
) -> dict[str, Any]:
    """The error line of a request the engine refused or gave up on."""
    return error_line_from_exception(engine_error(err, request, request_id))


def output_line(
    request: ParsedRequest,
    output: RequestOutput,
    model: str,
    decoder: TokenDecoder,
    request_id: str,
) -> tuple[dict[str, Any], bool]:
    """The line of a finished engine output, and whether it is an answer (else an error
    line)."""
    if (error := output.error) is not None:
        return refused_line(error, request, request_id), False
    try:
        return build_output_line(request, output, model, decoder), True
    except Exception:
        log.exception("request %s: internal error while formatting its result", request_id)
        return internal_error_line(request.custom_id, request.line, request_id), False


def internal_error_line(custom_id: str | None, line: int | None, request_id: str) -> dict[str, Any]:
    return build_error_line(
        custom_id, INTERNAL_ERROR, internal_error(request_id), line=line, status_code=500
    )
